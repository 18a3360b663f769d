"""poslsh eval: lm-evaluation-harness tasks on a checkpoint, with its own attention and swapped,
over mask draws, into a run the report reads; every bad input as one line. (The model class lm-eval
runs, PoslshLM: tests/test_harness.py.)"""
import pytest

pytest.importorskip("lm_eval")

from conftest import poslsh  # noqa: E402


def test_eval_command_runs_draws_and_refuses_bad_input(poslsh_checkpoint, task_dir, tmp_path):
    import pandas as pd

    out = tmp_path / "run"
    res = poslsh("eval", str(poslsh_checkpoint), "tasks=[tiny_mc]", f"include_path={task_dir}",
                 "attention=[own,alibi]", "trials=2", "batch_size=4", "device=cpu", f"out={out}")
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "results.csv")
    own, alibi = df[df.attention == "own"], df[df.attention == "alibi"]
    assert sorted(set(df.metric)) == ["acc", "acc_norm"] and (df.documents == 20).all()
    assert sorted(set(own.draw)) == [0, 1] and own.seed.nunique() == 2 and (own.position == "poslsh").all()
    assert len(alibi) == 2 and (alibi.seed == -1).all() and (alibi.s == 0).all()
    assert ((df.value >= 0) & (df.value <= 1)).all() and (df.stderr > 0).all()
    res = poslsh("report", str(out), "--out", str(tmp_path / "report"))
    assert res.exit_code == 0, res.output
    text = (tmp_path / "report" / "report.md").read_text()
    assert "lm-evaluation-harness tasks" in text and "mean over 2 mask draw(s)" in text
    for args, why in ((["tasks=[nope]", f"include_path={task_dir}"], "unknown task 'nope'"),
                      (["tasks=[]"], "give the tasks to run"),
                      (["tasks=[tiny_mc]", "attention=[bogus]"], "unknown attention 'bogus'"),
                      (["tasks=[tiny_mc]", f"include_path={tmp_path / 'none'}"], "not a directory")):
        res = poslsh("eval", str(poslsh_checkpoint), *args, f"out={tmp_path / 'bad'}")
        assert res.exit_code != 0 and why in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = poslsh("eval", str(tmp_path / "missing"), "tasks=[tiny_mc]", f"include_path={task_dir}")
    assert res.exit_code != 0 and "does not exist" in res.stderr
    assert not (tmp_path / "bad").exists()


def test_a_task_whose_data_is_on_an_unreachable_hub_is_one_line(poslsh_checkpoint, tmp_path, monkeypatch):
    """A task that reads its dataset from the hub, without a network: refused before the run
    directory exists, in one line with a hint, without the hub client's retry warnings."""
    from test_data import unreachable_hub

    records = unreachable_hub(monkeypatch)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub.yaml").write_text(
        "task: hub_task\ndataset_path: wikitext\ndataset_name: wikitext-2-raw-v1\ntest_split: test\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{page}}'\n"
        "metric_list:\n  - metric: word_perplexity\n    aggregation: weighted_perplexity\n    higher_is_better: false\n")
    out = tmp_path / "run"
    res = poslsh("eval", str(poslsh_checkpoint), "tasks=[hub_task]", f"include_path={tmp_path / 'tasks'}",
                 f"out={out}")
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "hub_task" in res.stderr and "the Hugging Face hub is not reachable" in res.stderr, res.stderr
    assert "HF_HUB_OFFLINE=1" in res.stderr and not out.exists()
    assert not records, [r.getMessage() for r in records]


def test_the_heldout_task_asks_for_what_follows_in_the_held_out_documents(tmp_path):
    """poslsh_heldout's documents are exactly the corpus's validation split (the same bytes training
    held out), and each question's gold choice is the text that follows its context there, the
    others spans of other held-out documents; the items replay from the documents alone."""
    import json

    import numpy as np

    from poslsh_cli.core.errors import ConfigError
    from poslsh_cli.lm import heldout_task
    from poslsh_cli.lm.data import SEPARATOR, load_corpus

    rng = np.random.default_rng(5)
    folder = tmp_path / "docs"
    folder.mkdir()
    texts = []
    for i in range(12):
        words = rng.choice(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"], 120 + 10 * i)
        texts.append(f"document {i}: " + " ".join(words))
        (folder / f"{i:02d}.txt").write_text(texts[-1])
    held = heldout_task.heldout_documents(texts, 3)
    corpus = load_corpus(str(folder), val_every=3)
    assert bytes(corpus.val.astype(np.uint8)).decode() == "".join(t + SEPARATOR for t in held)
    assert [t.split(":")[0] for t in held] == ["document 2", "document 5", "document 8", "document 11"]

    items = heldout_task.make_items(held, items=60, context=40, span=12, choices=3, seed=1)
    assert items == heldout_task.make_items(held, items=60, context=40, span=12, choices=3, seed=1)
    for it in items:
        assert len(it["context"]) == 40 and [len(c) for c in it["choices"]] == [12, 12, 12]
        gold = it["choices"][it["gold"]]
        home = [t for t in held if it["context"] + gold in t]
        assert home, it
        others = [c for k, c in enumerate(it["choices"]) if k != it["gold"]]
        assert all(any(c in t for t in held if t not in home) for c in others), it
    assert sorted({it["gold"] for it in items}) == [0, 1, 2]
    with pytest.raises(ConfigError, match="fewer than the 3 a question needs"):
        heldout_task.make_items(held[:2], context=40, span=12, choices=3)

    task = heldout_task.write_task(tmp_path / "task", items)
    rows = [json.loads(line) for line in (task / "poslsh_heldout.jsonl").read_text().splitlines()]
    assert rows == items and "target_delimiter: ''" in (task / "poslsh_heldout.yaml").read_text()
    # every choice has the same length: a length-normalised accuracy would equal acc, so none is asked for
    assert "acc_norm" not in (task / "poslsh_heldout.yaml").read_text()


def test_eval_scores_trained_models_on_their_heldout_documents_by_scheme(trained, tmp_path, monkeypatch):
    """tasks=[poslsh_heldout] on a train run: every checkpoint scored on the same questions, rows
    carrying the training seed and bandwidths, the report's per-scheme table and the claim against
    exact ALiBi, INCONCLUSIVE on one seed (the rule needs three)."""
    import pandas as pd

    monkeypatch.setenv("POSLSH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    res = poslsh("eval", str(trained), "tasks=[poslsh_heldout]", "limit=12", "trials=2", "batch_size=8",
                 "device=cpu", f"out={out}")
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "results.csv")
    assert sorted(set(df.position)) == ["alibi", "fixed_block", "none", "poslsh", "rope", "windowed"]
    assert (df.documents == 12).all() and (df.run_seed == 0).all() and set(df.task) == {"poslsh_heldout"}
    assert set(df[df.position == "alibi"].sigmas) == {"standard"} and df[df.position == "rope"].sigmas.isna().all()
    assert df[df.position == "poslsh"].draw.nunique() == 2
    res = poslsh("report", str(out), "--out", str(tmp_path / "report"))
    assert res.exit_code == 0, res.output
    text = (tmp_path / "report" / "report.md").read_text()
    assert "poslsh s=3 reaches exact ALiBi's accuracy on poslsh_heldout" in text
    assert "**INCONCLUSIVE**" in text and "fewer than 3" in text and "mask draws |" in text
    # a missing checkpoint beside the good ones: one line, nothing written
    other = tmp_path / "other"
    res = poslsh("eval", str(trained), str(tmp_path / "missing_too"), "tasks=[poslsh_heldout]", f"out={other}")
    assert res.exit_code != 0 and len(res.stderr.strip().splitlines()) == 1 and not other.exists(), res.stderr


def test_eval_keeps_train_runs_lengths_and_steps_apart():
    """RoPE models of two train runs (other optimiser settings) with the same seeds are two models, never
    one model's draws; Positional LSH is compared with the exact ALiBi of its own run, and the margin
    is 1% of that ALiBi's error rate."""
    import pandas as pd

    from poslsh_cli.experiments.eval.command import claim_reaches_alibi, interval_table

    rows = []
    for run, acc in (("train", {"rope": 0.60, "alibi": 0.70, "poslsh": 0.70}),
                     ("train_official", {"rope": 0.80, "alibi": 0.50, "poslsh": 0.40})):
        for seed in (0, 1, 2):
            for pos, a in acc.items():
                rows.append({"checkpoint": f"{run}/work/{pos}-{seed}/final", "attention": "own", "position": pos,
                             "s": 10 if pos == "poslsh" else 0, "sampler": "iid", "draw": 0, "seed": -1,
                             "task": "poslsh_heldout", "metric": "acc", "filter": "none",
                             "value": a + 0.001 * seed, "stderr": 0.03, "documents": 200, "num_fewshot": 0,
                             "run_seed": seed, "sigmas": "" if pos == "rope" else "standard", "attn_dropout": 0.0,
                             "finetuned": "no", "trained_run": run, "trained_len": 256, "trained_steps": 1000})
    df = pd.DataFrame(rows)
    t = interval_table(df)
    rope = t[t.scheme == "rope"]
    assert sorted(rope.run) == ["train", "train_official"] and sorted(rope["mean"]) == ["0.6010", "0.8010"]
    v = {x.claim: x for x in claim_reaches_alibi(df)}
    assert len(v) == 2
    same = [x for c, x in v.items() if "[train]" in c][0]
    worse = [x for c, x in v.items() if "[train_official]" in c][0]
    assert same.status.value == "SUPPORTED" and "margin 0.30" in same.evidence, same.evidence
    assert worse.status.value == "NOT SUPPORTED" and "exact ALiBi 49.90%" in worse.evidence, worse.evidence
