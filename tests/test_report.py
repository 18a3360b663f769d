"""poslsh report: the report of real (small) runs end to end, and what it refuses. The verdicts
themselves are tested beside their commands (tests/test_<command>.py) on synthetic tables."""
from conftest import one_line, poslsh, small_run


def test_report_from_runs(tmp_path):
    runs = tmp_path / "runs"
    for args in (["matrix-error", "n=[512]", "sigma=4", "s=[2,8,16,32]", "trials=3", f"out={runs / 'm'}"],
                 ["matrix-error", "n=[128]", "sigma=4", "s=[1,8]", "trials=1", "method=both", f"out={runs / 'd'}"],
                 ["block-stats", "n=[1024,8192]", "sigma=4", "s=8", "trials=10", f"out={runs / 'b'}"],
                 ["output-error", "n=64", "layers=[0]", "s=[1,16]", "trials=1", "baselines=[]", f"out={runs / 'o'}"],
                 ["bench", "n=[256,512]", "heads=2", "head_dim=8", "s=[2]", "window_sigmas=[2]", "repeats=1",
                  "warmup=0", "causal=[false,true]", f"out={runs / 'x'}"]):
        r = poslsh(*args)
        assert r.exit_code == 0, (args, r.output)
    r = poslsh("report", runs)
    assert r.exit_code == 0, r.output
    # it says each run as it reads it and each run's figures as they are drawn (a busy machine takes tens of s)
    assert "poslsh report: b (" in r.stderr and "poslsh report: figures of b drawn (" in r.stderr, r.stderr
    md = (runs / "report.md").read_text()
    html = (runs / "report.html").read_text()
    for title in ("Matrix approximation", "Fast O(n) path", "Block sizes", "Attention outputs", "Speed", "Provenance"):
        assert title in md and title in html
    assert "the O(n) fast path equals the dense float64 reference" in md
    # baselines=[]: the baseline claims were not measured, so they are not supported either
    assert "**NOT MEASURED**: at the largest s Positional LSH is more accurate than the no_bias baseline" in md
    assert "data:image/png;base64," in html and "<img" in html  # self-contained
    assert "figures/matrix_error_vs_s.png" in md and "figures/fast_vs_dense.png" in md
    assert oct((runs / "report.html").stat().st_mode & 0o777) != oct(0o600)


def test_a_smoke_scale_run_says_its_verdicts_are_a_smoke_test(tmp_path):
    """A run made from a _quick preset: the report says at its top that such verdicts test the pipeline,
    and each of them reads '(smoke test)'; a run made without a preset reads as before."""
    runs = tmp_path / "runs"
    r = poslsh("block-stats", "experiment=block_stats_quick", f"out={runs / 'quick'}")
    assert r.exit_code == 0, r.output
    r = poslsh("block-stats", "n=[1024,8192]", "sigma=4", "s=8", "trials=10", f"out={runs / 'plain'}")
    assert r.exit_code == 0, r.output
    assert poslsh("report", runs).exit_code == 0
    md = (runs / "report.md").read_text()
    assert "1 of these 2 runs are at smoke scale" in md and "decide none of the paper's claims" in md
    summary = md.split("## Summary", 1)[1].split("\n## ", 1)[0]
    quick = [line for line in summary.splitlines() if "[quick]" in line]
    plain = [line for line in summary.splitlines() if "[plain]" in line]
    assert quick and all("(smoke test)**" in line for line in quick)
    assert plain and not any("smoke test" in line for line in plain)
    assert md.index("1 of these 2 runs are at smoke scale") < md.index("## Summary")  # it qualifies the summary
    assert "(smoke test)" in (runs / "report.html").read_text()


def test_report_rejects_non_runs(tmp_path):
    r = poslsh("report", tmp_path)
    assert r.exit_code == 2 and "no poslsh run" in r.stderr


def test_report_to_an_existing_file_or_of_a_file_is_one_line(tmp_path):
    run = small_run(tmp_path)
    (tmp_path / "x.md").write_text("mine")
    r = poslsh("report", run, "-o", tmp_path / "x.md")
    assert one_line(r) and "is a file: -o names the folder" in r.stderr, r.output
    assert (tmp_path / "x.md").read_text() == "mine"
    r = poslsh("report", tmp_path / "x.md")
    assert one_line(r) and "x.md is not a run" in r.stderr and "does not exist" not in r.stderr, r.output


def _compared(claim, status, a, b, diff):
    from poslsh_cli.verdicts.claims import Status, Verdict

    side = lambda label, mean, seeds: {"label": label, "position": label.split()[0], "mean": mean, "low": mean - 0.01,
                                       "high": mean + 0.01, "seeds": seeds, "draws": 3 if label.startswith("poslsh") else 1}
    return Verdict(claim, Status[status], "evidence", "rule",
                   {"unit": "bits per byte", "length": 256, "a": side(*a), "b": side(*b),
                    "diff": {"estimate": diff[0], "low": diff[1], "high": diff[2], "n": 3, "source": "seeds",
                             "level": 0.9}}, key=claim)


def test_where_two_protocols_disagree_the_sentence_says_which_scheme_moved_and_which_interval_is_wider():
    from poslsh_cli.app.report import disagreement

    claim = "from scratch, Positional LSH s=10 reaches the bits per byte of exact ALiBi"
    ours = _compared(claim, "NOT_SUPPORTED", ("poslsh s=10", 2.50, 3), ("alibi", 2.45, 3), (0.05, 0.03, 0.07))
    theirs = _compared(claim, "INCONCLUSIVE", ("poslsh s=10", 2.41, 3), ("alibi", 2.40, 3), (0.01, -0.03, 0.05))
    text = disagreement(claim, ("perplexity", ours), ("perplexity_official", theirs))
    assert text.startswith(f"*{claim}*: NOT SUPPORTED under perplexity, INCONCLUSIVE under perplexity_official")
    assert "from +0.0500 [+0.0300, +0.0700] to +0.0100 [-0.0300, +0.0500] bits per byte" in text
    assert "the baseline moved alibi 2.4500 -> 2.4000 bits per byte (-0.0500" in text
    assert "Positional LSH poslsh s=10 2.5000 -> 2.4100 bits per byte (-0.0900" in text
    assert "the larger move is Positional LSH's" in text
    assert "0.0400 wide under perplexity (3 seeds) and 0.0800 under perplexity_official (3 seeds): wider under " \
           "perplexity_official" in text
    # the baseline is found on either side of the comparison ("better than": baseline first)
    worse = _compared("x", "SUPPORTED", ("rope", 2.60, 3), ("poslsh s=10", 2.50, 3), (0.10, 0.05, 0.15))
    other = _compared("x", "INCONCLUSIVE", ("rope", 2.45, 3), ("poslsh s=10", 2.44, 3), (0.01, -0.04, 0.06))
    text = disagreement("x", ("a", worse), ("b", other))
    assert "the baseline moved rope 2.6000 -> 2.4500" in text and "the larger move is the baseline's" in text
    from poslsh_cli.verdicts.claims import Status, Verdict

    bare = Verdict("y", Status.SUPPORTED, "e", "r", key="y")
    assert "no two-scheme comparison to take apart" in disagreement("y", ("a", bare), ("b", other))
    # a verdict on one interval (a change between lengths, weights against a model) has no two schemes' values
    change = lambda st, d: Verdict("z", Status[st], "e", "r", {"unit": "bits per byte", "margin": 0.02, "boundary": 0.02,
                                                               "diff": {"estimate": d, "low": d - 0.01, "high": d + 0.01,
                                                                        "n": 3, "source": "seeds", "level": 0.95}},
                                   key="z")
    text = disagreement("z", ("a", change("SUPPORTED", 0.0)), ("b", change("INCONCLUSIVE", 0.02)))
    assert "from +0.0000 [-0.0100, +0.0100] to +0.0200 [+0.0100, +0.0300]" in text
    assert "each run recorded the difference only" in text


def test_the_readme_shows_the_language_model_claims_side_by_side_with_why_they_disagree(tmp_path):
    from poslsh_cli.app.publish import side_by_side_markdown
    from poslsh_cli.app.report import SIDE_BY_SIDE
    from poslsh_cli.verdicts.claims import Joined, Section, Status, Verdict

    sec = Section("perplexity", tmp_path, SIDE_BY_SIDE)
    judged = Verdict("c1", Status.SUPPORTED, "L=256: poslsh s=10 2.5 (3 seeds x 3 draws); " + "x" * 200, "r", key="c1")
    sec.joined = Joined(["perplexity: per-head σ", "perplexity_official: σ = 8 every head"],
                        [("c1", {"perplexity: per-head σ": judged})])
    sec.paragraphs += ["perplexity: bandwidths standard", "Where the protocols disagree (1 of the 1 claims ...):",
                       "- *c1*: SUPPORTED under a, INCONCLUSIVE under b. The difference ..."]
    sec.highlights = sec.paragraphs[1:]  # what the section says a summary shows, not found by reading its sentences
    lines = side_by_side_markdown(sec)
    assert lines[0] == "| claim | perplexity: per-head σ | perplexity_official: σ = 8 every head |"
    assert lines[2].startswith("| c1 | **SUPPORTED**: L=256: poslsh s=10 2.5 (3 seeds x 3 draws); …")
    assert lines[2].endswith("| not judged in this run |")
    assert "Where the protocols disagree (1 of the 1 claims ...):" in lines and "perplexity: bandwidths standard" not in lines


def test_the_summary_lists_the_decided_claims_by_part_with_links_and_a_contents(tmp_path):
    """A report a person reads first: the summary lists one line per claim a rule decided, grouped by
    the paper's parts, each linking to its section's anchor; the undecided ones are counted; a table
    of contents follows; every section's title names its run; the HTML's notes render their code."""
    runs = tmp_path / "runs"
    r = poslsh("block-stats", "n=[1024,8192]", "sigma=4", "s=8", "trials=10", f"out={runs / 'plain'}")
    assert r.exit_code == 0, r.output
    r = poslsh("matrix-error", "n=[256]", "sigma=[4]", "s=[1,4,16]", "trials=2", f"out={runs / 'm'}")
    assert r.exit_code == 0, r.output
    assert poslsh("report", runs).exit_code == 0
    md = (runs / "report.md").read_text()
    summary = md.split("## Summary", 1)[1].split("\n## ", 1)[0]
    decided = [line for line in summary.splitlines() if line.startswith("- **")]
    assert decided and all(("**SUPPORTED" in line or "**NOT SUPPORTED" in line) and "](#" in line for line in decided)
    assert "**Theory: masks, matrix error, block sizes**" in summary
    assert "INCONCLUSIVE" not in "".join(decided)
    for target in {line.rsplit("](#", 1)[1].rstrip(")") for line in decided}:
        assert f'<a id="{target}"></a>' in md  # every link lands on a section
    assert "## Contents" in md and "(plain)" in md.split("## Contents", 1)[1].split("\n## ", 1)[0]
    html = (runs / "report.html").read_text()
    import re

    target = re.search(r"id='(block-stats-[a-z0-9-]*plain)'", html).group(1)
    assert "id='contents'" in html and f"href='#{target}'" in html


def test_a_run_records_its_preset_and_an_older_run_is_read_from_its_command(tmp_path):
    """meta.json names the preset a run was made with (``preset``), which the report's smoke note and the
    README's run column read; a run written before the field existed is read from its recorded command
    (the one migration, ``store.provenance.preset_of``); a run made from keys alone has none."""
    import json

    from poslsh_cli.app.report import is_smoke
    from poslsh_cli.store.provenance import preset_of

    r = poslsh("block-stats", "experiment=block_stats_quick", "n=[1024,4096]", "trials=2", f"out={tmp_path / 'b'}")
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert meta["preset"] == "block_stats_quick" and preset_of(meta) == "block_stats_quick" and is_smoke(meta)
    old = {"argv": "poslsh train experiment=train_official_paper out=/x"}
    assert preset_of(old) == "train_official_paper" and not is_smoke(old)
    r = poslsh("block-stats", "n=[1024]", "sigma=[4.0]", "s=[2]", "trials=2", f"out={tmp_path / 'k'}")
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "k" / "meta.json").read_text())
    assert "preset" not in meta and preset_of(meta) is None and not is_smoke(meta)


def test_a_commands_functions_receive_its_rows_migrated_once_from_older_layouts():
    """Experiment.migrate is the one place an older results layout is repaired: summary, plot, report and
    across_runs receive migrated rows; each command's migration is idempotent and gives a row without a
    column the value it meant (perplexity: no train run, the non-overlapping protocol, no dropout)."""
    from pathlib import Path

    import pandas as pd

    from poslsh_cli.app import registry
    from poslsh_cli.experiments.base import Experiment

    seen = []
    exp = Experiment("toy", object, "toy", ("x",), cells=lambda *a: [], run_cell=lambda *a: ([], {}),
                     summary=lambda df: seen.append(("summary", list(df.columns))),
                     plot=lambda run, df: seen.append(("plot", list(df.columns))),
                     report=lambda run, df: seen.append(("report", list(df.columns))),
                     across_runs=lambda runs: seen.append(("across", [list(df.columns) for _, df in runs])),
                     migrate=lambda df: df.assign(added=1) if "added" not in df.columns else df)
    df = pd.DataFrame({"x": [1]})
    exp.summary(df), exp.plot(Path("r"), df), exp.report(Path("r"), df), exp.across_runs([(Path("r"), df)])
    assert seen == [("summary", ["x", "added"]), ("plot", ["x", "added"]), ("report", ["x", "added"]),
                    ("across", [["x", "added"]])]
    migrating = {name for name, e in registry.experiments().items() if e.migrate is not None}
    assert {"perplexity", "train", "eval", "passkey"} <= migrating
    old = pd.DataFrame({"checkpoint": ["train/work/position-alibi_s-0_seed-3-abc/final"], "position": ["alibi"],
                        "s": [0], "bits_per_byte": [1.9], "trained_len": [256], "length": [256]})
    m = registry.get("perplexity").migrate(old)
    assert m.loc[0, ["trained_run", "protocol", "attn_dropout", "sigmas", "trained_steps"]].tolist() == \
        ["", "nonoverlapping", 0.0, "", 0]
    for name in migrating:
        once = registry.get(name).migrate(old)
        pd.testing.assert_frame_equal(registry.get(name).migrate(once), once, check_dtype=False)
