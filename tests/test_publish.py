"""poslsh report --publish: RESULTS.md, figures and the README block come from a snapshot of the
runs, stamped with where each came from, and publishing the snapshot again gives the same files;
the committed docs/ are what the generator makes from the committed snapshot."""
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import poslsh
from poslsh_cli.app.publish import BEGIN, END, local_paths_cut
from poslsh_cli.store.provenance import device_info, machine_text

ROOT = Path(__file__).resolve().parents[1]


def _readme(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# a project\n\nintro\n\n{BEGIN}\nstale text\n{END}\n\nthe rest\n")
    return path


def _block(text: str) -> str:
    return text.split(BEGIN, 1)[1].split(END, 1)[0]


def _same_figures(a: Path, b: Path) -> None:
    from matplotlib.image import imread

    names = sorted(p.name for p in a.glob("*.png"))
    assert names and names == sorted(p.name for p in b.glob("*.png"))
    for name in names:
        x, y = imread(a / name), imread(b / name)
        assert x.shape == y.shape and np.abs(x - y).max() < 1e-6, name


def _publish(runs, out: Path, readme: Path) -> None:
    r = poslsh("report", *map(str, runs), "--publish", str(out), "--readme", str(readme))
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for args in (["matrix-error", "n=[512]", "sigma=4", "s=[2,8,16,32]", "trials=3", f"out={root / 'm'}"],
                 ["block-stats", "n=[1024,8192]", "sigma=4", "s=8", "trials=10", f"out={root / 'b'}"],
                 ["bench", "n=[256,512]", "heads=2", "head_dim=8", "s=[2]", "window_sigmas=[2]", "repeats=1",
                  "warmup=0", "causal=[false,true]", f"out={root / 'x'}"]):
        r = poslsh(*args)
        assert r.exit_code == 0, (args, r.output)
    return root


def test_publish_stamps_every_section_and_republishing_the_snapshot_gives_the_same_files(runs, tmp_path):
    docs, readme = tmp_path / "docs", _readme(tmp_path / "README.md")
    _publish(sorted(runs.iterdir()), docs, readme)
    md = (docs / "RESULTS.md").read_text()
    # one stamp per run: run, commit, machine, torch, start, wall time, and the command without local paths
    for name in ("m", "b", "x"):
        stamp = re.search(rf"Source: run `{name}` · commit (\S+) · (.+) · torch (\S+) · started (\S+) · (\d+) s", md)
        assert stamp, name
        assert stamp.group(2) == machine_text(device_info()), stamp.group(2)  # the processor by name, not "x86_64"
        assert (docs / "results" / name / "results.csv").exists() and not (docs / "results" / name / "cells").exists()
    assert md.count("Command: `poslsh ") == 3
    assert str(tmp_path) not in md and str(runs) not in md
    for title in ("Matrix approximation", "Block sizes", "Speed"):
        assert title in md
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", md)
    assert links and all((docs / link).is_file() for link in links)
    assert {Path(link).name for link in links} == {p.name for p in (docs / "figures").glob("*.png")}
    text = readme.read_text()
    block = _block(text)
    assert "stale text" not in block and text.startswith("# a project") and text.endswith("the rest\n")
    assert "**Theory" in block and "**Attention" in block and "| claim | verdict | evidence | run |" in block
    assert "Not measured in the published runs." in block  # no language-model run was published
    for link in re.findall(r"\]\(([^)]+)\)", block):
        assert (tmp_path / link).exists(), link

    # the snapshot alone regenerates the same tables, figures and README block
    again, readme2 = tmp_path / "again" / "docs", _readme(tmp_path / "again" / "README.md")
    _publish(sorted((docs / "results").iterdir()), again, readme2)
    assert (again / "RESULTS.md").read_text() == md
    assert _block(readme2.read_text()) == block
    _same_figures(docs / "figures", again / "figures")
    # and in place: publishing docs/results/* into docs changes nothing
    _publish(sorted((docs / "results").iterdir()), docs, readme)
    assert (docs / "RESULTS.md").read_text() == md and _block(readme.read_text()) == block
    _same_figures(docs / "figures", again / "figures")
    # a new run of a published one, given beside the snapshot (DIR/results/* NEW/RUN), replaces its snapshot
    rerun = tmp_path / "rerun" / "b"
    r = poslsh("block-stats", "n=[1024]", "sigma=4", "s=8", "trials=4", f"out={rerun}")
    assert r.exit_code == 0, r.output
    _publish([*sorted((docs / "results").iterdir()), rerun], docs, readme)
    assert sorted(p.name for p in (docs / "results").iterdir()) == ["b", "m", "x"]
    assert pd.read_csv(docs / "results" / "b" / "results.csv").equals(pd.read_csv(rerun / "results.csv"))
    assert (docs / "RESULTS.md").read_text().count("Source: run `b`") == 1
    _publish([runs / "b", *(docs / "results" / n for n in ("m", "x"))], docs, readme)
    assert (docs / "RESULTS.md").read_text() == md
    # a run left out of a later publish leaves the snapshot and its figures
    _publish([docs / "results" / "b"], docs, readme)
    assert sorted(p.name for p in (docs / "results").iterdir()) == ["b"]
    assert all(p.name.startswith("b--") for p in (docs / "figures").glob("*.png"))
    assert (docs / "figures" / ".poslsh-figures").read_text().split() == \
        sorted(p.name for p in (docs / "figures").glob("*.png"))
    # what the publisher did not write survives: a folder of DIR/results that is not a snapshot (publishing
    # refuses in one line and writes nothing), a figure of its own beside the published ones
    notes, mine = docs / "results" / "notes", docs / "figures" / "my-sketch.png"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me\n")
    mine.write_bytes(b"not a published figure")
    r = poslsh("report", str(docs / "results" / "b"), "--publish", str(docs), "--readme", str(readme))
    assert r.exit_code == 2 and "notes" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    assert (notes / "todo.txt").read_text() == "keep me\n" and (docs / "RESULTS.md").read_text() != ""
    shutil.move(str(notes), tmp_path / "notes")
    _publish([docs / "results" / "b"], docs, readme)
    assert mine.read_bytes() == b"not a published figure"
    (docs / "figures" / "b--my-own.png").write_bytes(b"named like a published figure")
    r = poslsh("report", str(docs / "results" / "b"), "--publish", str(docs))
    assert r.exit_code == 2 and "b--my-own.png" in r.stderr, r.output


def test_publish_refuses_a_readme_without_markers_and_readme_without_publish(runs, tmp_path):
    bare = tmp_path / "README.md"
    bare.write_text("# no block here\n")
    r = poslsh("report", str(runs / "b"), "--publish", str(tmp_path / "docs"), "--readme", str(bare))
    assert r.exit_code == 2 and "has no results block" in r.stderr
    assert bare.read_text() == "# no block here\n" and not (tmp_path / "docs").exists()
    r = poslsh("report", str(runs / "b"), "--readme", str(bare))
    assert r.exit_code == 2 and "--readme goes with --publish" in r.stderr


def test_local_paths_are_cut_to_their_last_two_components():
    assert local_paths_cut("poslsh train out=/home/me/runs/reproduce/quick/train seed=0") == \
        "poslsh train out=quick/train seed=0"
    assert local_paths_cut("checkpoints=[/a/b/c/final,/x/y/z]") == "checkpoints=[c/final,y/z]"
    assert local_paths_cut("ratio 1/2 and results/m/results.csv") == "ratio 1/2 and results/m/results.csv"


@pytest.mark.skipif(not (ROOT / "docs" / "results").is_dir(), reason="no committed results snapshot")
def test_the_committed_results_are_what_the_generator_makes_from_the_committed_snapshot(tmp_path):
    from poslsh_cli.app.publish import FIGURES_MARK, is_snapshot

    # marked as the publisher's own, so that make publish-again and make publish may replace them
    assert all(is_snapshot(p) for p in (ROOT / "docs" / "results").iterdir() if p.is_dir())
    assert (ROOT / "docs" / "figures" / FIGURES_MARK).read_text().split() == \
        sorted(p.name for p in (ROOT / "docs" / "figures").glob("*.png"))
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "snapshot")
    docs, readme = tmp_path / "docs", _readme(tmp_path / "README.md")
    _publish(sorted(p for p in (tmp_path / "snapshot").iterdir() if p.is_dir()), docs, readme)
    assert (docs / "RESULTS.md").read_text() == (ROOT / "docs" / "RESULTS.md").read_text(), \
        "docs/RESULTS.md is not what publishing docs/results gives: run make publish-again"
    assert _block(readme.read_text()) == _block((ROOT / "README.md").read_text()), \
        "the README's results block is stale: run make publish-again"
    _same_figures(docs / "figures", ROOT / "docs" / "figures")


def test_readme_evidence_is_cut_at_a_clause_and_says_so():
    from poslsh_cli.app.publish import short

    assert short("6/6 layers") == "6/6 layers"
    long = "; ".join(f"slope layer {i}: -0.50 [-0.55, -0.45]" for i in range(6))
    cut = short(long, 80)
    assert cut.endswith("; …") and len(cut) <= 83 and long.startswith(cut[:-3])


def test_publishing_one_run_beside_another_refuses_and_removes_no_run(tmp_path):
    """Runs made into DIR/results are no snapshots: publishing one of them never removes the other
    (it refuses in one line, writing nothing), and a run published in place keeps its figures."""
    pub = tmp_path / "pub"
    for name, sigma in (("run_a", 2), ("run_b", 4)):
        r = poslsh("matrix-error", "n=[64]", f"sigma=[{sigma}]", "s=[1,2]", "trials=1",
                   f"out={pub / 'results' / name}")
        assert r.exit_code == 0, r.output
    r = poslsh("plot", str(pub / "results" / "run_a"))
    assert r.exit_code == 0, r.output

    def files(run: Path) -> dict:
        return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}

    before = {name: files(pub / "results" / name) for name in ("run_a", "run_b")}
    assert any(p.parts[0] == "figures" for p in before["run_a"])
    r = poslsh("report", str(pub / "results" / "run_a"), "--publish", str(pub))
    assert r.exit_code == 2 and "run_b" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    assert files(pub / "results" / "run_b") == before["run_b"]
    assert not (pub / "RESULTS.md").exists() and not (pub / "figures").exists()
    # both published in place: each run stays whole, figures included
    r = poslsh("report", str(pub / "results" / "run_a"), str(pub / "results" / "run_b"),
               "--publish", str(pub))
    assert r.exit_code == 0, r.output
    for name in ("run_a", "run_b"):
        assert before[name].items() <= files(pub / "results" / name).items(), name
    assert sorted(p.name for p in (pub / "figures").glob("*.png"))


def test_language_model_runs_publish_their_learning_curves_and_side_by_side_claims_from_the_snapshot(trained, tmp_path):
    """A train run and two perplexity runs of it: the snapshot keeps each training cell's
    metrics.csv, so the gap verdicts and figures come back from the snapshot alone; the README's
    language-model part is the side-by-side table of the perplexity runs' claims, then the other
    language-model verdicts."""
    root = tmp_path / "runs"
    shutil.copytree(trained, root / "train")
    for name, protocol in (("perplexity", "nonoverlapping"), ("perplexity_sliding", "sliding")):
        r = poslsh("perplexity", str(root / "train"), "lengths=[32,64]", f"protocol=[{protocol}]", "trials=2",
                   "max_tokens=512", f"out={root / name}")
        assert r.exit_code == 0, r.output
    docs, readme = tmp_path / "docs", _readme(tmp_path / "README.md")
    _publish([root / "train", root / "perplexity", root / "perplexity_sliding"], docs, readme)
    kept = sorted(p.relative_to(docs / "results" / "train") for p in (docs / "results" / "train").rglob("metrics.csv"))
    assert len(kept) == 6 and all(p.parts[0] == "work" for p in kept)
    assert not list((docs / "results" / "train").rglob("*.safetensors"))
    md = (docs / "RESULTS.md").read_text()
    assert "to exact ALiBi shrinks over the second half of training" in md and "gap_vs_tokens" in md
    block = _block(readme.read_text())
    part = block.split("**Language models: training, extrapolation, retrieval**", 1)[1]
    assert part.lstrip().startswith("| claim | perplexity: per-head σ (ALiBi's slopes) | perplexity_sliding: per-head σ")
    assert "The protocols agree on every one of" in part or "Where the protocols disagree" in part
    assert "| claim | verdict | evidence | run |" in part and "shrinks over the second half of training" in part
    again, readme2 = tmp_path / "again" / "docs", _readme(tmp_path / "again" / "README.md")
    _publish(sorted((docs / "results").iterdir()), again, readme2)
    assert (again / "RESULTS.md").read_text() == md and _block(readme2.read_text()) == block
    _same_figures(docs / "figures", again / "figures")


def test_the_machine_is_named_by_its_gpu_or_its_processor_and_cores():
    assert machine_text({"cuda": "NVIDIA H200", "machine": "x86_64", "cpu_count": 16}) == "NVIDIA H200"
    assert machine_text({"cpu": "AMD EPYC 7B13", "machine": "x86_64", "cpu_count": 2}) == "AMD EPYC 7B13, 2 cores"
    # a run recorded before the processor's name was: its architecture, said to be a CPU's
    assert machine_text({"machine": "x86_64", "cpu_count": 2}) == "x86_64 CPU, 2 cores"
    assert machine_text(None) == "unknown CPU"
    here = device_info()
    assert here["cpu_count"] and "cpu" in here



def test_the_readme_folds_a_runs_claims_of_one_rule_into_one_row_with_each_members_verdict(tmp_path):
    """A run's claims of one rule that differ only in the scheme they are about (the gap of each scheme
    shrinks over training, at one number of steps) are one README row from FOLD of them on, each member's
    verdict in it and every count right; a tag (the steps) keeps families apart; fewer than FOLD, or claims
    of another rule, stay one row each, in the order they came."""
    from types import SimpleNamespace

    from poslsh_cli.app.publish import FOLD, families, glance_row
    from poslsh_cli.verdicts.claims import Status, Verdict

    run = SimpleNamespace(run=tmp_path / "train_x")
    gap = "the gap of {} to exact ALiBi shrinks over the second half of training{}"
    family = dict(family="train/gap_shrinks", family_text=gap.format("…", ""))
    statuses = [Status.SUPPORTED, Status.INCONCLUSIVE, Status.INCONCLUSIVE, Status.NOT_SUPPORTED]
    rows = [(run, Verdict(gap.format(m, " [600 steps]"), st, "e", "shrink rule", key=f"g[{m}, 600]", member=m,
                          tag="[600 steps]", **family))
            for m, st in zip(["none", "poslsh s=10", "poslsh s=100 (sigma=8 every head)", "rope"], statuses)]
    rows += [(run, Verdict(gap.format(m, " [1200 steps]"), Status.SUPPORTED, "e", "shrink rule", key=f"g[{m}]",
                           member=m, tag="[1200 steps]", **family))
             for m in ["none", "rope"][:FOLD - 2]]  # fewer than FOLD: one row each
    rows.insert(1, (run, Verdict("poslsh s=10 reaches exact ALiBi", Status.SUPPORTED, "d +0.01", "other rule",
                                 key="reaches")))
    got = families(rows)
    assert [len(g) for _, g in got] == [4, 1, 1, 1]
    line = glance_row(*got[0])
    assert line == ("| the gap of … to exact ALiBi shrinks over the second half of training [600 steps] | 4 claims: "
                    "1 SUPPORTED, 2 INCONCLUSIVE, 1 NOT SUPPORTED | none: **SUPPORTED**; poslsh s=10: **INCONCLUSIVE**; "
                    "poslsh s=100 (sigma=8 every head): **INCONCLUSIVE**; rope: **NOT SUPPORTED** | train_x |")
    assert glance_row(*got[1]) == "| poslsh s=10 reaches exact ALiBi | **SUPPORTED** | d +0.01 | train_x |"
    assert glance_row(*got[2]).startswith(f"| {gap.format('none', ' [1200 steps]')} | **SUPPORTED** |")


@pytest.mark.skipif(not (ROOT / "docs" / "results").is_dir(), reason="no committed results snapshot")
def test_rewording_every_claim_changes_no_row_of_the_readme(tmp_path, monkeypatch):
    """Every claim has an id and the README's rows are made from the verdicts' fields (id, family, member,
    tag, status, evidence), never from their sentences: with every sentence reworded as it is made (words
    joined by "_", so no word is shared and no tag can be read back), the published language-model runs
    (train, perplexity, both protocols: the folded families and the side-by-side table) and a run of each
    other command that has claims give the same rows, verdicts, evidence and runs; only the claim column
    changes."""
    import dataclasses

    from poslsh_cli.app import publish, report
    from poslsh_cli.verdicts import claims
    from poslsh_cli.verdicts.declared import CLAIMS

    names = ["train", "train_official", "perplexity", "perplexity_official", "eval", "bench", "step_bench",
             "block_stats", "matrix_error", "output_error_minilm", "decode_bench"]
    for name in names:
        shutil.copytree(ROOT / "docs" / "results" / name, tmp_path / name)
    monkeypatch.setattr(report, "draw_figures", lambda items, progress=None: {item[0]: [] for item in items})

    def readme_rows() -> list[list[str]]:
        sections, _, _ = report.sections_of([tmp_path / n for n in names], notice=lambda text: None)
        assert all(v.key for s in sections for v in s.verdicts)
        # every verdict is made from a claim its own command declares (the side-by-side table joins them)
        assert all(CLAIMS[v.claim_id].command == s.command for s in sections if s.joined is None for v in s.verdicts)
        for s in sections:  # an id names one claim of a section: joins and folds read it alone
            keys = [v.key for v in s.verdicts]
            assert len(keys) == len(set(keys)), (s.title, sorted(k for k in set(keys) if keys.count(k) > 1))
        md = publish.glance_markdown(sections, tmp_path / "RESULTS.md", tmp_path)
        return [line.split(" | ")[1:] for line in md.splitlines() if line.startswith("| ")]

    plain = readme_rows()
    made = claims.Verdict.__post_init__

    def reworded(self) -> None:
        made(self)
        object.__setattr__(self, "claim", "~" + self.claim.replace(" ", "_"))
        if self.family_text:
            object.__setattr__(self, "family_text", "~" + self.family_text.replace(" ", "_"))

    monkeypatch.setattr(claims.Verdict, "__post_init__", reworded)
    again = readme_rows()
    assert again == plain and len(plain) > 40
    assert any("claims:" in row[0] for row in plain)  # a folded family is among them
    assert dataclasses.replace(claims.Verdict("a b", claims.Status.SUPPORTED, "", "", key="k")).claim.startswith("~")


def test_a_perplexity_runs_claims_of_each_s_fold_into_one_readme_row(tmp_path):
    """From four s on, a run's claims of one family (Positional LSH reaches exact ALiBi, each s) are one
    README row with each s's verdict; the row is found by the family the claim declares (a verdict that
    names a family without its text or member is refused)."""
    from poslsh_cli.app import registry
    from poslsh_cli.app.publish import families, glance_row
    from poslsh_cli.verdicts.claims import Status, Verdict
    from test_perplexity import A, ppl_run

    scratch = {A: 1.70, **{("poslsh", s, 0.0): 1.70 + 0.001 * i for i, s in enumerate((1, 4, 16, 64))}}
    run, df = ppl_run(tmp_path, scratch=scratch, seeds=(0, 1, 2, 3, 4), seed_sd=0.001)
    sec = registry.get("perplexity").report(run, df)
    got = families([(sec, v) for v in sec.verdicts])
    [row] = [glance_row(s, g) for s, g in got if len(g) > 1]
    assert row.startswith("| from scratch, Positional LSH … reaches the bits per byte of exact ALiBi | 4 claims: ")
    assert all(f"s={s}: **" in row for s in (1, 4, 16, 64))
    with pytest.raises(ValueError, match="needs its family_text and member"):
        Verdict("c", Status.SUPPORTED, "e", "r", key="k", family="f")
