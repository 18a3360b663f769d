"""poslsh reproduce: the driver runs the presets (side by side with --jobs), skips what it must and
keeps the skip in the run directories, resumes, and writes the report."""
import json
import re
import subprocess
import sys

import pytest

from conftest import poslsh


@pytest.mark.slow
def test_reproduce_quick_subset_resumes_and_keeps_skipped_in_the_runs(tmp_path):
    """The driver on a shortened experiment list: skips what it must (and says so in the run
    directory), resumes, and a later `poslsh report` on the same root still lists the skip."""
    code = (
        "import sys; import poslsh_cli.app.reproduce as r;"
        "r.plan = lambda scale: [('block_stats','block-stats','block_stats_quick'),"
        "('output_error_qwen3_0_6b','output-error','output_error_qwen3_0_6b_quick')];"
        f"sys.exit(r.main('quick', {str(tmp_path)!r}))"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "POSLSH_MODELS"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "skipped output_error_qwen3_0_6b: POSLSH_MODELS is not set" in res.stdout
    root = tmp_path / "quick"
    marker = json.loads((root / "output_error_qwen3_0_6b" / "skipped.json").read_text())
    assert marker["reason"].startswith("POSLSH_MODELS is not set")
    assert "skipped output_error_qwen3_0_6b" in (root / "report.html").read_text()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "resuming" in res.stderr and "60/60 cells already done" in res.stderr
    # a report written later over the same root (the README's command) keeps the skip and the sessions
    r = poslsh("report", str(root))
    assert r.exit_code == 0, r.output
    md = (root / "report.md").read_text()
    assert "skipped output_error_qwen3_0_6b: POSLSH_MODELS is not set" in md
    assert md.count("reproduce --scale quick: session started") == 2
    # the budget: each experiment's wall time over both sessions, from its meta.json
    wall = json.loads((root / "block_stats" / "meta.json").read_text())["wall_seconds"]
    assert wall > 0 and f"wall time per experiment (meta.json, all sessions): block_stats {wall:.0f} s" in md
    assert f"total {wall:.0f} s" in md


def test_reproduce_runs_presets_side_by_side_each_with_its_log_and_core_share(tmp_path):
    """--jobs 2 with the local launcher: two presets at once, each child with half the cores and
    its output in logs/<preset>.log; a preset that fails is named with the end of its log, the
    others finish and the report is written."""
    import os

    code = (
        "import sys; import poslsh_cli.app.reproduce as r;"
        "r.plan = lambda scale: [('output_error_official_minilm','output-error','output_error_official_minilm_quick'),"
        "('broken','block-stats','no_such_preset_quick')];"
        "r.skip_reason = lambda *a, **k: None;"
        f"sys.exit(r.main('quick', {str(tmp_path)!r}, jobs=2))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    root = tmp_path / "quick"
    assert "== finished output_error_official_minilm" in res.stdout
    assert re.search(r"== FAILED broken \(exit 2\); the end of \S+broken\.log:", res.stdout)
    assert "no_such_preset_quick" in res.stdout.split("== FAILED broken", 1)[1]  # the log's error line, shown
    assert "[22/22] layer=" in (root / "logs" / "output_error_official_minilm.log").read_text()
    meta = json.loads((root / "output_error_official_minilm" / "meta.json").read_text())
    assert meta["status"] == "complete"
    assert meta["device"]["torch_threads"] == max(1, (os.cpu_count() or 1) // 2)
    assert (root / "report.md").exists()
    first = (root / "logs" / "output_error_official_minilm.log").read_text()
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    log = (root / "logs" / "output_error_official_minilm.log").read_text()
    assert log.startswith(first) and "== resumed " in log  # the earlier attempt's log is kept, the new one follows
    r = poslsh("reproduce", "--scale", "quick", "--runs", str(tmp_path), "--jobs", "0")
    assert r.exit_code == 2 and "--jobs must be at least 1" in r.stderr


@pytest.mark.slow
def test_the_report_is_written_as_soon_as_an_evaluation_finishes(tmp_path):
    """The paper's comparison reaches the report before the other presets run: reproduce writes the
    report after each evaluation preset (here perplexity_official after train_official), and again at
    the end."""
    code = (
        "import sys; import poslsh_cli.app.reproduce as r;"
        "r.plan = lambda scale: [('train_official','train','train_official_quick'),"
        "('perplexity_official','perplexity','perplexity_official_quick'),"
        "('block_stats','block-stats','block_stats_quick')];"
        f"sys.exit(r.main('quick', {str(tmp_path)!r}))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    written = [line for line in out.splitlines() if line.startswith("report: ") and line.endswith("report.md")]
    assert len(written) == 2, out[-2000:]
    # the first report comes right after perplexity_official, before block_stats starts
    assert out.index(written[0]) < out.index("== block_stats:"), out[-3000:]
    assert "report: reading the runs under" in out and "report: drawing the figures of" in out  # never silent
    assert "report: figures of block_stats drawn (" in out  # each run's figures said as they are done


def test_a_report_written_after_the_last_preset_is_not_written_again(tmp_path, monkeypatch, capsys):
    """The last preset an evaluation: its report covers every run, and reproduce says it once (it
    built and printed the same report twice, minutes apart)."""
    import poslsh_cli.app.reproduce as r
    from poslsh_cli.app import report

    built = []
    monkeypatch.setattr(report, "build", lambda dirs, out, progress=None, **kw: built.append(out) or
                        (out / "report.md", out / "report.html"))

    def wave(entries, root, launcher, limit, done, failed, include=()):
        done.append(root / "train_official")
        done.append(root / "perplexity_official")
        r._report(root, len(done))  # what the wave does when an evaluation preset finishes

    monkeypatch.setattr(r, "_run_wave", wave)
    monkeypatch.setattr(r, "plan", lambda scale: [("block_stats", "block-stats", "block_stats_quick")])
    assert r.main("quick", str(tmp_path)) == 0
    assert len(built) == 1 and capsys.readouterr().out.count("report.md") == 1


def test_an_evaluation_of_a_training_that_failed_is_skipped_not_run(tmp_path, monkeypatch, capsys):
    """A training preset that fails leaves its models half trained: the evaluation preset reading it
    is skipped with the reason (it ran on whatever checkpoints were there), and the session fails."""
    import poslsh_cli.app.reproduce as r

    started = []

    class Proc:
        def __init__(self, code):
            self.returncode = code

        def poll(self):
            return self.returncode

    def spawn(cmd, log_path, env):
        started.append(cmd[3])
        return Proc(1 if cmd[3] == "train" else 0)

    monkeypatch.setattr(r, "_spawn", spawn)
    monkeypatch.setattr(r, "skip_reason", lambda *a, **k: None)
    monkeypatch.setattr(r, "plan", lambda scale: [("train_official", "train", "train_official_quick"),
                                                  ("perplexity_official", "perplexity", "perplexity_official_quick")])
    assert r.main("quick", str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert started == ["train"]
    assert "== skipped perplexity_official: it reads train_official, which failed in this session" in out
    marker = json.loads((tmp_path / "quick" / "perplexity_official" / "skipped.json").read_text())
    assert "train_official, which failed" in marker["reason"]
