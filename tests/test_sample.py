"""poslsh sample: the masks of a row, replayed from its seed, and the masks of ALiBi's heads."""
import numpy as np
import pandas as pd

from conftest import poslsh
from poslsh_cli.numerics.metrics import max_error_fast
from poslsh_cli.numerics.operators import LaplacianKernel, MeanMask
from poslsh_cli.numerics.sampling import Partitions


def test_row_seed_replays_masks_with_sample(tmp_path):
    assert poslsh("matrix-error", "n=200", "sigma=4", "s=[3,6]", "trials=1", f"out={tmp_path / 'm'}").exit_code == 0
    row = pd.read_csv(tmp_path / "m" / "results.csv").iloc[1]
    r = poslsh("sample", f"n={row.n}", f"sigma={row.sigma}", f"s={row.s}", f"seed={row.seed}", f"out={tmp_path / 's'}")
    assert r.exit_code == 0, r.output
    data = np.load(tmp_path / "s" / "masks.npz")
    bins, widths, shifts = data["bins"], data["widths"], data["shifts"]
    assert bins.shape == (row.s, row.n)
    raw = np.floor((np.arange(row.n)[None, :] + shifts[:, None]) / widths[:, None]).astype(int)
    np.testing.assert_array_equal(bins, raw - raw[:, :1])
    parts = Partitions(int(row.n), float(row.sigma), widths, shifts)
    assert parts.b_max == row.b_max
    assert max_error_fast(LaplacianKernel(int(row.n), float(row.sigma)), MeanMask(parts)) == row.max_err


def test_sample_with_alibi_heads(tmp_path):
    r = poslsh("sample", "n=32", "heads=8", "s=4", f"out={tmp_path}")
    assert r.exit_code == 0, r.output
    data = np.load(tmp_path / "masks.npz")
    assert data["bins"].shape == (8, 4, 32)
    np.testing.assert_allclose(data["sigma"], 2.0 ** np.arange(1, 9))
    assert poslsh("plot", tmp_path).exit_code == 0
    assert (tmp_path / "figures" / "mean_mask_heatmap.png").exists()
