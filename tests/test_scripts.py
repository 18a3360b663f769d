"""The helper scripts docs/GUIDE.md tells users to run still run against the package (they import it
and build schemes the way the commands do): each at a tiny size."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("args", [
    ["profile_step.py", "--seq-len", "64", "--steps", "1", "--positions", "alibi", "poslsh", "--s", "2"],
    ["padded_batch_bench.py", "--sizes", "128:2", "--repeats", "1"],
])
def test_a_guide_script_runs_at_a_tiny_size(args, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(SCRIPTS / args[0]), *args[1:]], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()


def test_plan_fit_measures_fits_and_checks_on_grids_that_do_not_overlap(tmp_path, capsys):
    """scripts/plan_fit.py times both inference paths on a grid (every setting both paths, the plan's
    marked once), fits non-negative constants that reproduce its own times, and checks the plan's
    path against the fastest; the check grid has no n or head dimension of the fit grid."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import plan_fit
    finally:
        sys.path.remove(str(SCRIPTS))
    fit_grid, check_grid = plan_fit.GRIDS["fit"], plan_fit.GRIDS["check"]
    assert not {g[0] for g in fit_grid} & {g[0] for g in check_grid}
    assert not {g[4] for g in fit_grid} & {g[4] for g in check_grid}
    out = tmp_path / "tiny.csv"
    plan_fit.measure("tiny", str(out), repeats=1)
    rows = plan_fit._read(str(out))
    assert len(rows) == 2 * len(plan_fit.GRIDS["tiny"])
    assert all(r["seconds"] > 0 and r["sample_seconds"] < r["seconds"] and r["spread"] >= 1 for r in rows)
    for k in range(0, len(rows), 2):  # each setting: blocks then union, the plan's one of them
        assert [rows[k]["path"], rows[k + 1]["path"]] == ["blocks", "union"]
        assert rows[k]["planned"] != rows[k + 1]["planned"]
    constants = plan_fit.fit(str(out))
    assert set(constants) == {n for names in plan_fit.NAMES.values() for n in names} | {"UNION_MIN_S_CPU"}
    assert all(v >= 0 for v in constants.values()) and any(v > 0 for v in constants.values())
    capsys.readouterr()
    worst = plan_fit.check(str(out))
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    # recomputed from the rows: per setting the plan's time over the faster path's, the largest of them
    ratios = [(a if a["planned"] else b)["seconds"] / min(a["seconds"], b["seconds"])
              for a, b in zip(rows[0::2], rows[1::2])]
    assert worst == pytest.approx(max(ratios)) and len(table) == len(ratios)
    assert sorted(float(line.split(" | ")[9]) for line in table) == pytest.approx(sorted(ratios), abs=0.006)
