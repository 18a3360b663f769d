"""poslsh matrix-error: the spectral error of the mean mask against exact ALiBi's kernel, end to end
into a run directory, and its claims judged on synthetic tables (decay like s^-1/2, the dense
check, the expectation bound)."""
import json

import numpy as np
import pandas as pd
import pytest

from conftest import RUN, poslsh, small_run, status_of
from poslsh_cli.app import registry
from poslsh_cli.verdicts.claims import Status

# ---------------------------------------------------------------------------------------------
# matrix-error: decay like s^-1/2


def matrix_table(exponent, noise, s=(8, 16, 32, 64, 128), trials=3, seed=0, converged=True):
    g = np.random.default_rng(seed)
    rows = []
    for n in (1024, 4096):
        for sigma in (4.0, 16.0):
            for sv in s:
                for t in range(trials):
                    e = 0.5 * sv ** exponent * np.exp(noise * g.standard_normal())
                    rows.append(dict(n=n, sigma=sigma, s=sv, trial=t, seed=t, method="fast", spectral_err=e,
                                     spectral_rel=e / 3, max_err=e, b_max=10, seconds=0.1, lanczos_tol=1e-6,
                                     converged=converged, matvecs=50))
    return pd.DataFrame(rows)


def test_decay_verdicts_pass_fail_inconclusive_and_no_data():
    sec = registry.get('matrix-error').report(RUN, matrix_table(-0.5, 0.03))
    assert status_of(sec, "spectral error decays") is Status.SUPPORTED
    sec = registry.get('matrix-error').report(RUN, matrix_table(-1.0, 0.03))
    assert status_of(sec, "spectral error decays") is Status.NOT_SUPPORTED
    # noisy: every interval holds -0.5 but also 0, so it says nothing
    sec = registry.get('matrix-error').report(RUN, matrix_table(-0.5, 1.5, s=(8, 16, 32)))
    assert status_of(sec, "spectral error decays") is Status.INCONCLUSIVE
    # tight around -0.35: it excludes -0.5 ± 0.1
    sec = registry.get('matrix-error').report(RUN, matrix_table(-0.35, 0.03, s=(8, 16, 32)))
    assert status_of(sec, "spectral error decays") is Status.NOT_SUPPORTED
    sec = registry.get('matrix-error').report(RUN, matrix_table(-0.5, 0.03, s=(1, 2, 4)))
    assert status_of(sec, "spectral error decays") is Status.NOT_MEASURED


def fit(lo, hi):
    from poslsh_cli.numerics.metrics import SlopeFit

    return SlopeFit((lo + hi) / 2, 0.0, (hi - lo) / 4, lo, hi, 5)


@pytest.mark.parametrize("lo,hi,expected", [
    (-0.55, -0.45, Status.SUPPORTED), (-0.6, -0.4, Status.SUPPORTED),      # inside, and at its edges
    (-0.74, -0.26, Status.INCONCLUSIVE),                                     # wide: holds -1/2 but says little
    (-0.61, -0.45, Status.INCONCLUSIVE), (-0.55, -0.39, Status.INCONCLUSIVE),  # just across one edge
    (-0.39, -0.30, Status.NOT_SUPPORTED), (-0.70, -0.62, Status.NOT_SUPPORTED),  # tight, excluding -1/2 ± 0.1
    (-0.405, -0.395, Status.INCONCLUSIVE),                                   # slope within 0.1, interval across
])
def test_decay_rule_is_an_equivalence_rule_at_its_edges(lo, hi, expected):
    from poslsh_cli.verdicts.claims import decay_status

    assert decay_status(fit(lo, hi)) is expected


def test_unconverged_rows_are_flagged_and_left_out_of_fits():
    good = matrix_table(-0.5, 0.03)
    bad = matrix_table(3.0, 0.0, converged=False)
    sec = registry.get('matrix-error').report(RUN, pd.concat([good, bad]))
    assert status_of(sec, "spectral error decays") is Status.SUPPORTED
    assert any("did not certify their interval" in p and str(len(bad)) in p for p in sec.paragraphs)


def test_dense_check_verdict_follows_the_difference():
    fast = matrix_table(-0.5, 0.03, s=(1, 4))
    dense = fast.assign(method="dense")
    sec = registry.get('matrix-error').report(RUN, pd.concat([fast, dense]))
    assert status_of(sec, "equals the dense") is Status.SUPPORTED
    assert "Fast O(n) path" in sec.title and not any("decays" in v.claim for v in sec.verdicts)
    off = dense.assign(spectral_err=dense.spectral_err * 1.01)
    sec = registry.get('matrix-error').report(RUN, pd.concat([fast, off]))
    assert status_of(sec, "equals the dense") is Status.NOT_SUPPORTED


def test_theorem_bound_verdict_holds_fails_and_reads_old_runs():
    from poslsh_cli.numerics.theorem import expectation_bound

    df = matrix_table(-0.5, 0.03)
    sec = registry.get('matrix-error').report(RUN, df)
    assert status_of(sec, "expectation bound holds") is Status.SUPPORTED
    v = [v for v in sec.verdicts if "expectation bound" in v.claim][0]
    assert "20 of 20 (n, σ, s) cells" in v.evidence and "mean over 3 trials" in v.evidence
    # one cell whose mean exceeds the bound (only the certified upper end counts)
    bad = df.copy()
    bad["spectral_err_bound"] = bad["spectral_err"]
    cell = (bad.n == 1024) & (bad.sigma == 4.0) & (bad.s == 128)
    bad.loc[cell, "spectral_err_bound"] = 1.01 * expectation_bound(4.0, 1024, 128)
    sec = registry.get('matrix-error').report(RUN, bad)
    assert status_of(sec, "expectation bound holds") is Status.NOT_SUPPORTED
    v = [v for v in sec.verdicts if "expectation bound" in v.claim][0]
    assert "19 of 20" in v.evidence and "n=1024 σ=4 s=128" in v.evidence
    # the lower end alone would have passed: the check reads the upper end
    assert (bad.loc[cell, "spectral_err"] < expectation_bound(4.0, 1024, 128)).all()


# ---------------------------------------------------------------------------------------------
# poslsh matrix-error end to end


def test_matrix_error_run_writes_contract(tmp_path):
    out = tmp_path / "run"
    r = poslsh("matrix-error", "n=[64,300]", "sigma=[2,5.5]", "s=[1,4]", "trials=2", "method=both", f"out={out}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "results.csv")
    assert list(df.columns[:12]) == ["n", "sigma", "s", "trial", "seed", "sampler", "method", "spectral_err",
                                     "spectral_rel", "max_err", "b_max", "seconds"]
    assert set(df.sampler) == {"iid"}
    assert len(df) == 2 * 2 * 2 * 2 * 2
    fast, dense = df[df.method == "fast"].reset_index(), df[df.method == "dense"].reset_index()
    np.testing.assert_allclose(fast.spectral_err, dense.spectral_err, rtol=1e-6)
    np.testing.assert_array_equal(fast.max_err, dense.max_err)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["cells_done"] == 16 and meta["seed"] == 0
    assert {"argv", "git", "versions", "device", "wall_seconds"} <= set(meta)
    assert "n:" in (out / "config.yaml").read_text()
    assert len(list((out / "cells").glob("*.json"))) == 16


def test_same_command_gives_identical_metrics(tmp_path):
    args = ["matrix-error", "n=[128,500]", "sigma=3", "s=[2,8]", "trials=2", "seed=5"]
    assert poslsh(*args, f"out={tmp_path / 'a'}").exit_code == 0
    assert poslsh(*args, f"out={tmp_path / 'b'}").exit_code == 0
    measured = ["seconds", "peak_mem_mb"]  # timings and memory are measurements, not results
    a = pd.read_csv(tmp_path / "a" / "results.csv").drop(columns=measured)
    b = pd.read_csv(tmp_path / "b" / "results.csv").drop(columns=measured)
    assert a.to_csv(index=False) == b.to_csv(index=False)


def test_matrix_error_table_says_why_a_slope_is_missing(tmp_path):
    from poslsh_cli.experiments.matrix_error.command import summary

    df = pd.read_csv(small_run(tmp_path) / "results.csv")
    head, rows = summary(df)
    assert rows[0][head.index("slope spec (s≥8)")] == "– (fit needs 3 s≥8, has 0)"
