"""poslsh collect: one table from the jobs of a multirun, naming a job with no run directory and
cells run by more than one job. (A sweep's table against one process, through the launchers:
tests/test_launchers.py; a cut job table rebuilt: tests/test_faults.py.)"""
import pandas as pd

from conftest import poslsh


def test_collect_names_a_missing_job(tmp_path):
    sweep = tmp_path / "sweep"
    r = poslsh("block-stats", "-m", "n=64,128", "sigma=2", "s=4", "trials=2", f"out={sweep}")
    assert r.exit_code == 0, r.output
    import shutil

    shutil.rmtree(sweep / "1")
    r = poslsh("collect", str(sweep))
    assert r.exit_code == 1 and "job 1 (n=128 sigma=2 s=4 trials=2) has no run directory" in r.stderr
    assert len(pd.read_csv(sweep / "results.csv")) == 2  # what there is, is still collected
    r = poslsh("collect", str(tmp_path))
    assert r.exit_code == 2 and "not a multirun directory" in r.stderr


def test_collect_names_cells_run_by_two_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    r = poslsh("block-stats", "-m", "n=64,64", "sigma=2", "s=4", "trials=2", f"out={sweep}")
    assert r.exit_code == 0, r.output
    assert "2 cells were run by more than one job (jobs 0, 1)" in r.stderr
    r = poslsh("collect", str(sweep))
    assert r.exit_code == 1 and "2 cells were run by more than one job" in r.stderr
