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
