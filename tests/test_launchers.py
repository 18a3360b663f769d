"""Beyond one process: Hydra's joblib launcher and submitit's local executor (the SLURM code path
without a cluster) run sweeps end to end; a job killed with SIGKILL and run again resumes; one
table from a sweep (poslsh collect) equals the same cells run in one process."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import poslsh, poslsh_process

pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

METRICS = ["n", "sigma", "s", "trial", "seed", "method", "spectral_err", "spectral_rel", "max_err", "b_max"]
#: The environment of the sweeps: unbuffered output, the threads this machine gives
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def descendants(pid):
    """pid and every process below it (from /proc): what SLURM kills when it kills a job."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def one_process(tmp_path, *grid):
    out = tmp_path / "single"
    r = poslsh("matrix-error", *grid, f"out={out}")
    assert r.exit_code == 0, r.output
    return pd.read_csv(out / "results.csv")


def same_cells(collected, single):
    key = ["n", "sigma", "s", "trial"]
    a = collected.sort_values(key).reset_index(drop=True)[METRICS]
    b = single.sort_values(key).reset_index(drop=True)[METRICS]
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.slow
def test_joblib_sweep_collects_one_table_equal_to_one_process(tmp_path):
    sweep = tmp_path / "sweep"
    r = poslsh_process("matrix-error", "-m", "n=64,128", "sigma=2,4", "s=[1,8]", "trials=2", "hydra/launcher=joblib",
                       "hydra.launcher.n_jobs=2", f"out={sweep}", env=ENV)
    assert r.returncode == 0, r.stderr
    assert "collected 16 rows of 4 jobs" in r.stdout  # the callback at the end of the multirun
    df = pd.read_csv(sweep / "results.csv")
    assert sorted(df.job.unique()) == [0, 1, 2, 3] and {"job.n", "job.sigma"} <= set(df.columns)
    assert (df["job.n"].astype(int) == df.n).all()
    same_cells(df, one_process(tmp_path, "n=[64,128]", "sigma=[2,4]", "s=[1,8]", "trials=2"))
    meta = json.loads((sweep / "2" / "meta.json").read_text())
    assert meta["argv"].startswith("poslsh matrix-error -m ") and meta["job"] == 2 and "n=128" in meta["job_overrides"]
    # plot and report take the sweep root directly
    assert poslsh("plot", str(sweep)).exit_code == 0
    assert poslsh("report", str(sweep)).exit_code == 0 and (sweep / "report.html").exists()


@pytest.mark.slow
def test_submitit_local_job_killed_and_rerun_resumes_without_repeating_a_cell(tmp_path):
    """submitit's local executor is SLURM's code path on one machine: each job is its own process
    (its pid is the job id). Kill one with SIGKILL half-way; the same command again finishes it."""
    sweep = tmp_path / "sweep"
    grid = ["s=[2,4,8,16,32]", "trials=3", "sigma=[3,5]"]
    args = ["matrix-error", "-m", "n=3000,3500", *grid, "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=10", f"out={sweep}"]
    proc = subprocess.Popen([sys.executable, "-m", "poslsh_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV)
    killed = None
    deadline = time.time() + 300
    while time.time() < deadline and killed is None:
        for job in (sweep / "0", sweep / "1"):
            cells = list((job / "cells").glob("*.json")) if (job / "cells").exists() else []
            if len(cells) >= 4:
                folders = [p for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
                for folder in folders:  # a local job id is its controller's pid; the job runs below it
                    for pid in descendants(int(folder.name)):
                        try:
                            os.kill(pid, signal.SIGKILL)
                            killed = pid
                        except ProcessLookupError:
                            continue
                break
        time.sleep(0.05)
    proc.communicate(timeout=300)
    assert killed is not None
    before = {p.name for job in ("0", "1") for p in (sweep / job / "cells").glob("*.json")} \
        if (sweep / "0" / "cells").exists() else set()
    assert 0 < len(before) < 60
    r = poslsh_process(*args, env=ENV)
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(sweep / "results.csv")
    assert len(df) == 60 and not df.duplicated(["n", "sigma", "s", "trial"]).any()
    after = {p.name for job in ("0", "1") for p in (sweep / job / "cells").glob("*.json")}
    assert before <= after and len(after) == 60
    same_cells(df, one_process(tmp_path, "n=[3000,3500]", *grid))


@pytest.mark.slow
def test_train_and_reproduce_run_under_a_launcher(tmp_path):
    sweep = tmp_path / "train"
    r = poslsh_process("train", "-m", "position=[alibi],[rope]", "hidden=32", "layers=1", "heads=4", "kv_heads=4",
                       "head_dim=8", "intermediate=64", "seq_len=32", "batch=2", "steps=3", "eval_every=0",
                       "eval_tokens=512", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"out={sweep}", env=ENV)
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(sweep / "results.csv")
    assert sorted(df.position) == ["alibi", "rope"] and (df.val_bpb > 0).all()
    code = (
        "import sys; import poslsh_cli.app.reproduce as r;"
        "r.plan = lambda scale: [('block_stats','block-stats','block_stats_quick'),"
        "('sample_like','matrix-error','matrix_dense_check_quick')];"
        f"sys.exit(r.main('quick', {str(tmp_path / 'rep')!r}, 'joblib', 2))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=600)
    assert res.returncode == 0, res.stderr
    root = tmp_path / "rep" / "quick"
    assert (root / "block_stats" / "0" / "results.csv").exists() and (root / "report.html").exists()
    assert "Block sizes" in (root / "report.md").read_text()
