"""poslsh bench: the contract of its rows, its accuracy column and its plots (no timing asserts)."""
import math

import numpy as np
import pandas as pd
from typer.testing import CliRunner

from poslsh_cli.app.cli import app
from poslsh_cli.experiments.bench import _band_pairs
from poslsh_cli.experiments.bench_report import crossover

runner = CliRunner()


def test_bench_rows_and_plots(tmp_path):
    r = runner.invoke(app, ["bench", "n=[128,512]", "heads=4", "head_dim=16", "s=[1,4]", "window_sigmas=[1,64]",
                            "causal=[false,true]", "repeats=1", "warmup=0", f"out={tmp_path}"])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "results.csv")
    for col in ["method", "n", "head_dim", "heads", "s", "causal", "seconds", "peak_mem_mb", "rel_fro"]:
        assert col in df.columns
    assert len(df) == 2 * 2 * (1 + 2 + 2 + 1)
    assert set(df.method) == {"exact", "poslsh", "windowed", "fixed_block"}
    assert (df.seconds > 0).all() and (df.gflops > 0).all()
    assert df[df.method == "exact"].rel_fro.isna().all()
    others = df[df.method != "exact"]
    assert others.rel_fro.notna().all() and (others.rel_fro >= 0).all()
    # a window wider than the sequence is exact ALiBi: error at float32 rounding level
    wide = df[(df.method == "windowed") & (df.window_sigmas == 64)]
    assert (wide.rel_fro < 1e-5).all()
    # more samples, smaller error (median over heads, same inputs)
    p = df[df.method == "poslsh"].pivot_table(index=["n", "causal"], columns="s", values="rel_fro")
    assert (p[4] < p[1]).all()
    r = runner.invoke(app, ["plot", str(tmp_path)])
    assert r.exit_code == 0, r.output
    for name in ("bench_time_vs_n_bidir", "bench_time_vs_n_causal", "bench_pareto_bidir", "bench_pareto_causal"):
        assert (tmp_path / "figures" / f"{name}.png").exists()


def test_useful_pair_counts():
    n = 50
    i = np.arange(n)
    d = np.abs(i[:, None] - i[None, :])
    for w in (0, 1, 7, 49, 200):
        assert _band_pairs(n, w, False) == (d <= w).sum()
        assert _band_pairs(n, w, True) == ((d <= w) & (i[None, :] <= i[:, None])).sum()


def test_crossover_is_the_first_n_from_which_a_method_stays_faster():
    df = pd.DataFrame({"method": ["exact"] * 4 + ["poslsh"] * 4, "n": [1, 2, 4, 8] * 2,
                       "seconds": [1, 2, 4, 8, 0.5, 3, 3, 4]})
    assert crossover(df, "poslsh") == 4
    assert math.isnan(crossover(df.assign(seconds=[1, 1, 1, 1, 2, 2, 2, 2]), "poslsh"))


def test_bench_bad_input(tmp_path):
    for args, needle in ((["methods=[exact,magic]"], "unknown method"), (["causal=[maybe]"], "causal must be"),
                         (["repeats=0"], "repeats must be"), (["device=cuda"], "CUDA is not available")):
        r = runner.invoke(app, ["bench", "n=[64]", *args, f"out={tmp_path / 'x'}"])
        if "CUDA" in needle and r.exit_code == 0:
            continue  # a machine with a GPU
        assert r.exit_code == 2 and needle in r.stderr, (args, r.stderr)
        assert not (tmp_path / "x").exists()


def test_measure_skips_the_warmup_after_a_long_memory_pass(monkeypatch):
    """measure() runs the memory pass first; a call that took WARM_AFTER_S or longer there is warm,
    so its warm-up calls are skipped: one memory call, then exactly ``repeats`` timed calls. A short
    call keeps its ``warmup`` calls. (Counts calls; times nothing.)"""
    import torch

    from poslsh_cli.experiments import measure as m

    def count(threshold):
        monkeypatch.setattr(m, "WARM_AFTER_S", threshold)
        calls = []
        x = torch.ones(4, requires_grad=True)
        t = m.measure(lambda: calls.append("prepare"), lambda _: x * 2, torch.device("cpu"), repeats=3, warmup=2,
                      backward=True, inputs=(x,))
        assert torch.equal(t.out, torch.full((4,), 2.0)) and t.seconds >= 0
        return len(calls)

    assert count(float("inf")) == 1 + 2 + 3  # memory pass, warm-up, repeats
    assert count(0.0) == 1 + 3  # every call counts as long: the memory pass was the warm-up
