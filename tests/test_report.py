"""poslsh report: claims beside measurements, from real (small) runs; reproduce resumes."""
import re
import subprocess
import sys

import pytest

from typer.testing import CliRunner

from poslsh_cli.cli import app

runner = CliRunner()


def test_report_from_runs(tmp_path):
    runs = tmp_path / "runs"
    for args in (["matrix-error", "n=[512]", "sigma=4", "s=[2,8,16,32]", "trials=3", f"out={runs / 'm'}"],
                 ["matrix-error", "n=[128]", "sigma=4", "s=[1,8]", "trials=1", "method=both", f"out={runs / 'd'}"],
                 ["block-stats", "n=[1024,8192]", "sigma=4", "s=8", "trials=10", f"out={runs / 'b'}"],
                 ["output-error", "n=64", "layers=[0]", "s=[1,16]", "trials=1", f"out={runs / 'o'}"],
                 ["bench", "n=[256,512]", "heads=2", "head_dim=8", "s=[2]", "window_sigmas=[2]", "repeats=1",
                  "warmup=0", f"out={runs / 'x'}"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, (args, r.output)
    r = runner.invoke(app, ["report", str(runs)])
    assert r.exit_code == 0, r.output
    md = (runs / "report.md").read_text()
    html = (runs / "report.html").read_text()
    for title in ("Matrix approximation", "Block sizes", "Attention outputs", "Speed", "Provenance"):
        assert title in md and title in html
    assert re.search(r"\*\*(SUPPORTED|NOT SUPPORTED)\*\*: spectral error decays", md)
    assert "the O(n) fast path equals the dense float64 reference" in md
    assert "data:image/png;base64," in html and "<img" in html  # self-contained
    assert "](m/figures/matrix_error_vs_s.png)" in md or "figures/matrix_error_vs_s.png" in md


def test_report_rejects_non_runs(tmp_path):
    r = runner.invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "no poslsh run" in r.stderr


@pytest.mark.slow
def test_reproduce_quick_subset_resumes(tmp_path, monkeypatch):
    """The driver on a shortened experiment list: skips what it must, resumes, writes the report."""
    code = (
        "import sys; import poslsh_cli.reproduce as r;"
        "r.EXPERIMENTS = [('block_stats','block-stats','block_stats'),"
        "('output_error_qwen3_0_6b','output-error','output_error_qwen3_0_6b')];"
        f"sys.exit(r.main('quick', {str(tmp_path)!r}))"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "POSLSH_MODELS"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "skipped output_error_qwen3_0_6b: POSLSH_MODELS is not set" in res.stdout
    html = (tmp_path / "quick" / "report.html").read_text()
    assert "skipped output_error_qwen3_0_6b" in html
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "resuming" in res.stderr and "60/60 cells already done" in res.stderr
