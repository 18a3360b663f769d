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
