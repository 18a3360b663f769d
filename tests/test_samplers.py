"""Mask samplers (iid, stratified, scrambled Sobol): every sampler is unbiased (the mean mask
estimates L* = exp(-|i-j|/sigma)), replays by seed, keeps each width Gamma(2, sigma)-distributed,
and the two that spread their draws lower the mean-mask error at the same s."""
import numpy as np
import pytest

from conftest import poslsh
from poslsh_cli.numerics.sampling import Sampler, sample_partitions

SAMPLERS = [s.value for s in Sampler]


def _mean_mask(p):
    n = p.seq_len
    m = np.zeros((n, n))
    for k in range(p.num_samples):
        b = p.bins_of(k)
        m += b[:, None] == b[None]
    return m / p.num_samples


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sampler_is_unbiased_and_replays(sampler):
    """Mean over 400 draws of s=8 masks of the entries at lags 0..40 against exp(-lag/sigma):
    within 5 standard errors of the per-draw means (a stratified draw's entries are averages of
    8 dependent indicators; draws are independent of each other)."""
    n, sigma, s, trials = 64, 6.0, 8, 400
    lags = np.arange(0, 41)
    per = np.empty((trials, lags.size))
    for t in range(trials):
        m = _mean_mask(sample_partitions(n, sigma, s, np.random.default_rng(t), sampler))
        per[t] = [np.mean(np.diagonal(m, lag)) for lag in lags]
    mean, se = per.mean(0), per.std(0, ddof=1) / np.sqrt(trials)
    want = np.exp(-lags / sigma)
    assert np.all(np.abs(mean - want) <= 5 * se + 1e-12), np.max(np.abs(mean - want) / (se + 1e-12))
    a = sample_partitions(n, sigma, s, np.random.default_rng(5), sampler)
    b = sample_partitions(n, sigma, s, np.random.default_rng(5), sampler)
    assert np.array_equal(a.widths, b.widths) and np.array_equal(a.shifts, b.shifts)
    assert np.all((a.shifts >= 0) & (a.shifts < a.widths))


@pytest.mark.parametrize("sampler", [pytest.param("stratified", marks=pytest.mark.slow), "sobol"])
def test_spread_samplers_keep_the_width_law_and_lower_the_error(sampler):
    """Widths pooled over draws follow Gamma(2, sigma) (Kolmogorov-Smirnov, p > 0.001), and the
    mean spectral error of the mean mask at n=512, sigma=16, s=16 over 12 draws is below iid's."""
    from scipy import stats

    w = np.concatenate([sample_partitions(10, 3.0, 16, np.random.default_rng(t), sampler).widths for t in range(200)])
    assert stats.kstest(w, stats.gamma(a=2.0, scale=3.0).cdf).pvalue > 1e-3
    n, sigma, s = 512, 16.0, 16
    i = np.arange(n)
    L = np.exp(-np.abs(i[:, None] - i[None]) / sigma)

    def err(smp):
        return np.mean([np.linalg.norm(_mean_mask(sample_partitions(n, sigma, s, np.random.default_rng(100 + t), smp))
                                       - L, 2) for t in range(12)])

    assert err(sampler) < err("iid")


# ---------------------------------------------------------------------------------------------
# the iid equivalent of a sampler's s, and the samplers in the commands


def test_iid_equivalent_inverts_the_iid_curve_exactly_on_a_power_law():
    """On an iid curve err = c s^-1/2 measured at s = 2, 4, 16, 64, log-log interpolation is exact:
    the error of iid s=8 maps back to 8, a measured point to itself; beyond the range it is bounded."""
    from poslsh_cli.verdicts.samplers import iid_equivalent

    s = np.array([2.0, 4.0, 16.0, 64.0])
    e = 3.0 / np.sqrt(s)
    for want in (2.0, 4.0, 8.0, 11.0, 64.0):
        got, bound = iid_equivalent(s, e, 3.0 / np.sqrt(want))
        assert bound == "=" and got == pytest.approx(want, rel=1e-12)
    assert iid_equivalent(s, e, 3.0 / np.sqrt(100.0)) == (64.0, ">")
    assert iid_equivalent(s, e, 3.0) == (2.0, "<")
    assert np.isnan(iid_equivalent([], [], 0.1)[0])


def test_comparison_ratios_and_sentences_come_from_the_rows():
    """A sampler whose error is the iid error at twice the samples (c (2s)^-1/2): ratio 1/sqrt(2) at
    every s, and "s=8 matches iid s ≈ 16" in the sentence."""
    import pandas as pd

    from poslsh_cli.verdicts.samplers import comparison, worth_sentences

    rows = [{"n": 64, "sampler": sm, "s": s, "trial": t, "err": 2.0 / np.sqrt(s * (2 if sm == "sobol" else 1))}
            for sm in ("iid", "sobol") for s in (4, 8, 16, 32, 64) for t in range(3)]
    cmp = comparison(pd.DataFrame(rows), ["n"], "err")
    sob = cmp[cmp.sampler == "sobol"].set_index("s")
    assert np.allclose(sob.ratio_to_iid, 1 / np.sqrt(2))
    assert sob.loc[8, "iid_equivalent"] == pytest.approx(16.0) and sob.loc[64, "bound"] == ">"
    text = " ".join(worth_sentences(cmp, "error", ["n"]))
    assert "median ratio 0.707" in text and "sobol s=8 matches iid s ≈ 16" in text and "s=64 matches iid s > 64" in text


def test_position_state_keeps_its_sampler_and_reads_older_checkpoints_as_iid():
    from poslsh_cli.lm.positions import PositionState

    st = PositionState("poslsh", [4.0, 8.0], s=4, seed=3, sampler="sobol")
    d = st.to_json()
    assert d["sampler"] == "sobol" and PositionState.from_json(d).sampler == "sobol"
    plain = PositionState("poslsh", [4.0, 8.0], s=4).to_json()
    assert "sampler" not in plain and PositionState.from_json(plain).sampler == "iid"
    a, b = st.attention_spec(0, 128, None), PositionState.from_json(d).attention_spec(0, 128, None)
    assert np.array_equal(a.bin_table[0], b.bin_table[0])  # the same masks after a reload
    iid = PositionState.from_json({**d, "sampler": "iid"}).attention_spec(0, 128, None)
    assert not np.array_equal(a.bin_table[0], iid.bin_table[0])
    with pytest.raises(ValueError):
        PositionState("poslsh", [4.0], s=4, sampler="halton")
    # a scheme saved before s had its name (num_samples) loads as the same scheme, the same masks
    old = {("num_samples" if k == "s" else k): v for k, v in d.items() if k != "layout"}
    assert "s" not in old and PositionState.from_json(old).to_json() == PositionState.from_json(d).to_json()
    assert np.array_equal(PositionState.from_json(old).attention_spec(0, 128, None).bin_table[0], a.bin_table[0])


def test_matrix_error_runs_the_samplers_side_by_side_and_sample_replays_a_row(tmp_path):
    """matrix-error with three samplers: one row per sampler and cell with the cell's seed, the
    report's sampler sentences and figure; ``poslsh sample ... sampler= seed=`` gives the masks of a
    sobol row (its b_max); a wrong sampler is one error line."""
    import pandas as pd

    out = tmp_path / "me"
    r = poslsh("matrix-error", "n=[512]", "sigma=[16]", "s=[4,8,16]", "trials=2",
               "sampler=[iid,stratified,sobol]", f"out={out}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "results.csv")
    assert sorted(df.sampler.unique()) == ["iid", "sobol", "stratified"] and len(df) == 18
    assert df.groupby(["s", "trial"]).seed.nunique().eq(1).all()  # a sampler changes how the seed is used
    rep = tmp_path / "rep.md"
    assert poslsh("report", str(out), "-o", str(rep)).exit_code == 0
    assert (out / "figures" / "matrix_error_samplers.png").exists()
    text = (rep / "report.md").read_text()
    assert "sobol against iid at equal s" in text and "matches iid s" in text
    row = df[df.sampler == "sobol"].iloc[0]
    smp = tmp_path / "smp"
    r = poslsh("sample", f"n={int(row.n)}", f"sigma={row.sigma}", f"s={int(row.s)}", "sampler=sobol",
               f"seed={int(row.seed)}", f"out={smp}")
    assert r.exit_code == 0, r.output
    masks = np.load(smp / "masks.npz")
    want = sample_partitions(int(row.n), float(row.sigma), int(row.s), np.random.default_rng(int(row.seed)), "sobol")
    assert np.array_equal(masks["widths"], want.widths) and want.b_max == row.b_max
    bad = poslsh("matrix-error", "sampler=halton", f"out={tmp_path / 'bad'}")
    assert bad.exit_code == 2 and "halton" in bad.output and not (tmp_path / "bad").exists()


def test_output_error_and_bench_compare_the_samplers(tmp_path):
    """output-error on MiniLM and bench with two samplers: Positional-LSH rows per sampler (baselines
    and exact without one), every table but the samplers' on iid, the comparison sentences."""
    import pandas as pd

    oe, be = tmp_path / "oe", tmp_path / "be"
    r = poslsh("output-error", "model=minilm", "n=128", "layers=[0]", "s=[4,8,16]", "trials=2",
               "sampler=[iid,sobol]", "baselines=[no_bias]", f"out={oe}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(oe / "results.csv", keep_default_na=False)
    assert set(df[df.method == "poslsh"].sampler) == {"iid", "sobol"} and set(df[df.method != "poslsh"].sampler) == {""}
    r = poslsh("bench", "n=[640]", "heads=2", "head_dim=16", "methods=[exact,poslsh]", "s=[2,4,8]",
               "sampler=[iid,sobol]", "repeats=1", "warmup=0", f"out={be}")
    assert r.exit_code == 0, r.output
    b = pd.read_csv(be / "results.csv", keep_default_na=False)
    assert len(b[b.method == "poslsh"]) == 6 and set(b[b.method == "exact"].sampler) == {""}
    for run_dir, want in ((oe, "output error, sobol against iid"), (be, "rel_fro, median over heads), sobol")):
        rep = tmp_path / f"rep-{run_dir.name}"
        assert poslsh("report", str(run_dir), "-o", str(rep)).exit_code == 0
        assert want in (rep / "report.md").read_text()
