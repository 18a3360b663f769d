"""poslsh block-stats: the largest block of the mask against its law, end to end into a run
directory, and its claim judged on synthetic tables (b_max / (sigma log log n) bounded when
s ~ log n)."""
import numpy as np
import pandas as pd

from conftest import RUN, poslsh, status_of
from poslsh_cli.app import registry
from poslsh_cli.verdicts.claims import Status

# ---------------------------------------------------------------------------------------------
# block-stats: b_max / (sigma log log n) bounded when s ~ log n


def block_table(grow, c=1.0, trials=5):
    from poslsh_cli.numerics.sampling import block_max_quantile, width_max_quantile

    rows = []
    g = np.random.default_rng(0)
    for n in (2**10, 2**14, 2**18, 2**22):
        s = int(np.ceil(c * np.log(n))) if c else 16
        for sigma in (4.0,):
            for t in range(trials):
                ll = sigma * np.log(np.log(n))
                b = int(ll * (1.8 if not grow else np.log(n) / 4))
                rows.append(dict(n=n, sigma=sigma, s=s, trial=t, seed=t, b_max=b,
                                 b_max_theory_median=width_max_quantile(0.5, sigma, s), mean_block=8.0, num_blocks=n / 8,
                                 max_width=g.gamma(2, sigma, size=s).max(), b_max_loglog=ll,
                                 b_max_law_q05=block_max_quantile(0.05, sigma, s),
                                 b_max_law_q95=block_max_quantile(0.95, sigma, s), s_per_log_n=c if c else np.nan))
    return pd.DataFrame(rows)


def test_loglog_band_verdict():
    claim = "stays bounded"
    assert status_of(registry.get('block-stats').report(RUN, block_table(grow=False)), claim) is Status.SUPPORTED
    assert status_of(registry.get('block-stats').report(RUN, block_table(grow=True)), claim) is Status.NOT_SUPPORTED
    assert status_of(registry.get('block-stats').report(RUN, block_table(grow=False, c=None)), claim) is Status.NOT_MEASURED


# ---------------------------------------------------------------------------------------------
# poslsh block-stats end to end


def test_block_stats_and_plots(tmp_path):
    r = poslsh("block-stats", "n=[256,4096]", "sigma=[2,8]", "s=16", "trials=3", f"out={tmp_path}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "results.csv")
    assert {"b_max", "b_max_theory_median", "mean_block", "num_blocks"} <= set(df.columns)
    assert (df.b_max <= np.ceil(df.max_width)).all()
    hist = pd.read_csv(tmp_path / "block_lengths.csv")
    sums = hist.groupby(["n", "sigma", "trial"])["count"].sum().reset_index()
    merged = sums.merge(df, on=["n", "sigma", "trial"])
    np.testing.assert_allclose(merged["count"], merged["num_blocks"] * merged["s"])
    r = poslsh("plot", tmp_path)
    assert r.exit_code == 0
    for name in ("b_max_vs_n", "block_length_hist"):
        assert (tmp_path / "figures" / f"{name}.png").exists() and (tmp_path / "figures" / f"{name}.pdf").exists()
