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
