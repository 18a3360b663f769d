"""poslsh plot: the figures of a run, of the runs under a folder (around one it cannot read), and
what it refuses."""
from conftest import one_line, poslsh, small_run


def test_plot_matrix_error(tmp_path):
    assert poslsh("matrix-error", "n=128", "sigma=4", "s=[1,2,4]", "trials=2", f"out={tmp_path}").exit_code == 0
    r = poslsh("plot", tmp_path)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "figures" / "matrix_error_vs_s.png").stat().st_size > 1000


def test_plot_rejects_non_run(tmp_path):
    r = poslsh("plot", tmp_path)
    assert r.exit_code == 2 and "no poslsh run" in r.stderr


def test_plot_reads_around_a_binary_cell_and_over_a_parent_plots_the_rest(tmp_path):
    good = small_run(tmp_path / "runs", "good")
    bad = small_run(tmp_path / "runs", "bad")
    for cell in (bad / "cells").glob("*.json"):
        cell.write_bytes(bytes(range(256)))
    r = poslsh("plot", good.parent)
    assert r.exit_code == 2 and "is unreadable (not UTF-8 text)" in r.stderr and "Traceback" not in r.output
    assert "1 of 2 runs not plotted" in r.stderr.strip().splitlines()[-1], r.stderr
    assert (good / "figures" / "matrix_error_vs_s.png").exists()


def test_plot_that_cannot_write_its_figures_is_one_line(tmp_path):
    run = small_run(tmp_path)
    (run / "figures").write_text("a file where the figures folder goes")  # like a read-only run: mkdir fails
    r = poslsh("plot", run)
    assert one_line(r) and "cannot write its figures" in r.stderr, r.output
