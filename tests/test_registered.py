"""The registered confirmatory analysis: Holm's correction over the primary comparisons, the stability
check on the gap's slope against log2 T, a verdict only with every registered seed, and no verdict for
a secondary comparison (docs/PREREGISTRATION.md; poslsh_cli/verdicts/registered.py)."""
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from poslsh_cli.app import registry
from poslsh_cli.app.report import sections_of
from poslsh_cli.experiments.perplexity import registered as pr
from poslsh_cli.verdicts.claims import Status
from poslsh_cli.verdicts.registered import (CONFIRM_L256, GapPoint, Reading, holm, noninferiority, stability)
from test_perplexity import A, NONE, ROPE, ppl_run

P10, P20, P100 = ("poslsh", 10, 0.0), ("poslsh", 20, 0.0), ("poslsh", 100, 0.0)


# ---------------------------------------------------------------------------------------------
# Holm


def test_holm_steps_down_and_rejects_more_than_bonferroni():
    """0.01, 0.02, 0.04 at 5%: 0.01 <= 0.05/3, 0.02 <= 0.05/2, 0.04 <= 0.05: all three (Bonferroni,
    every p against 0.05/3, rejects only the first)."""
    steps = holm({"a": 0.04, "b": 0.01, "c": 0.02}, 0.05)
    assert [steps[k].rank for k in "bca"] == [1, 2, 3]
    assert [steps[k].level for k in "bca"] == pytest.approx([0.05 / 3, 0.05 / 2, 0.05])
    assert all(steps[k].rejected for k in "abc")
    assert sum(p <= 0.05 / 3 for p in (0.04, 0.01, 0.02)) == 1  # Bonferroni's count
    # adjusted p-values: max over the steps so far of (m - i + 1) p_(i)
    assert [steps[k].adjusted for k in "bca"] == pytest.approx([0.03, 0.04, 0.04])


def test_holm_stops_at_the_first_hypothesis_it_keeps():
    """0.01, 0.03, 0.031: 0.03 > 0.05/2 keeps the second, and the third (0.031 > ... though below 0.05)
    is kept with it: the procedure stops."""
    steps = holm({"a": 0.01, "b": 0.03, "c": 0.031}, 0.05)
    assert steps["a"].rejected and not steps["b"].rejected and not steps["c"].rejected
    assert steps["c"].adjusted == pytest.approx(0.06)  # max(0.03, 0.06, 0.031)
    one = holm({"a": 0.049}, 0.05)
    assert one["a"].rejected and one["a"].level == 0.05


def test_holm_decides_what_an_unadjusted_test_would_not():
    """Three primary comparisons, one-sided 5%: s=20 plainly reaches (p ~ 0), s=10 plainly does not
    (p ~ 1), s=100 has p_reach ~ 0.03. Unadjusted, s=100 would read SUPPORTED (0.03 <= 0.05); under Holm
    it is tested second against 0.05/2 and stays INCONCLUSIVE, with its bound marked as at that level."""
    from poslsh_cli.verdicts.registered import decide_primary

    z = np.array([-1.5, -1.2, -0.9, -0.5, -0.2, 0.0, 0.2, 0.5, 0.9, 1.2, 1.5])
    z = (z - z.mean()) / z.std(ddof=1)  # 11 standardised deviations: each comparison's mean and sd exact
    margin, sd = 0.017, 0.008
    se = sd / math.sqrt(11)
    t_needed = stats.t.ppf(0.03, 10)  # p_reach = 0.03
    gaps = {CONFIRM_L256.primary[0]: 0.06 + sd * z, CONFIRM_L256.primary[1]: 0.0 + sd * z,
            CONFIRM_L256.primary[2]: margin + t_needed * se + sd * z}
    out = {p.s: r for p, r in decide_primary(gaps, margin, 0.05).items()}
    assert out[100].test.p_reach == pytest.approx(0.03, abs=1e-6)
    assert out[20].status is Status.SUPPORTED and out[10].status is Status.NOT_SUPPORTED
    assert out[100].status is Status.INCONCLUSIVE and out[100].reach.rank == 2 and out[100].reach.tested
    assert out[100].test.p_reach <= 0.05  # what an unadjusted test would have called SUPPORTED
    assert out[100].bound > margin  # the bound at Holm's level 0.025 is above the margin


def test_holm_marks_what_it_never_tested():
    steps = holm({"a": 0.03, "b": 0.04, "c": 0.5}, 0.05)
    assert not steps["a"].rejected and steps["a"].tested
    assert not steps["b"].tested and not steps["c"].tested


def test_holm_ranks_a_missing_p_value_last_and_never_rejects_it():
    steps = holm({"a": math.nan, "b": 0.001}, 0.05)
    assert steps["b"].rank == 1 and steps["b"].rejected and not steps["a"].rejected


def test_noninferiority_p_values_are_the_paired_t_tests_against_the_margin():
    gaps = [0.010, 0.002, 0.007, 0.012, 0.004]
    t = noninferiority(gaps, 0.018)
    d = np.array(gaps)
    tstat = (d.mean() - 0.018) / (d.std(ddof=1) / math.sqrt(5))
    assert t.p_reach == pytest.approx(stats.t.cdf(tstat, 4)) and t.p_worse == pytest.approx(stats.t.sf(tstat, 4))
    assert t.p_reach + t.p_worse == pytest.approx(1.0)
    half = stats.t.ppf(0.95, 4) * d.std(ddof=1) / math.sqrt(5)
    assert (t.low90, t.high90) == pytest.approx((d.mean() - half, d.mean() + half))
    # the one-sided upper bound at level a is below the margin exactly when p_reach <= a
    for a in (0.05 / 3, 0.025, 0.05, 0.2):
        assert (t.bound(a, upper=True) < 0.018) == (t.p_reach <= a)


# ---------------------------------------------------------------------------------------------
# stability


def test_stability_is_the_weighted_slope_per_doubling_with_its_interval():
    pts = [GapPoint(600, 0.038, 0.004, 5), GapPoint(1200, 0.036, 0.003, 5), GapPoint(2400, 0.035, 0.002, 11)]
    st = stability(pts, band=0.009, level=0.90, df=4)
    x, y, w = np.log2([600, 1200, 2400]), np.array([0.038, 0.036, 0.035]), 1 / np.array([0.004, 0.003, 0.002]) ** 2
    b, *_ = np.linalg.lstsq(np.sqrt(w)[:, None] * np.c_[np.ones(3), x], np.sqrt(w) * y, rcond=None)
    assert st.slope == pytest.approx(b[1])
    xm = (w * x).sum() / w.sum()
    half = stats.t.ppf(0.95, 4) / math.sqrt((w * (x - xm) ** 2).sum())
    assert (st.low, st.high) == pytest.approx((b[1] - half, b[1] + half))
    assert st.reading is Reading.SETTLED and "settled" in st.text()


def test_stability_reads_a_gap_still_moving_and_says_which_way():
    shrinking = stability([GapPoint(600, 0.06, 0.001, 5), GapPoint(1200, 0.04, 0.001, 5),
                           GapPoint(2400, 0.02, 0.001, 11)], band=0.009, level=0.90, df=4)
    assert shrinking.reading is Reading.MOVING and "shrinking by 0.0200 per doubling" in shrinking.text()
    growing = stability([GapPoint(600, 0.00, 0.001, 5), GapPoint(2400, 0.04, 0.001, 11)], 0.009, 0.90, 4)
    assert growing.reading is Reading.MOVING and "growing" in growing.text()
    # the same move measured with wide intervals decides nothing: the two-point-estimate rule would
    # have read it as moving (0.012 > 0.009) on point estimates alone
    noisy = stability([GapPoint(1200, 0.00, 0.01, 5), GapPoint(2400, 0.012, 0.01, 11)], 0.009, 0.90, 4)
    assert noisy.reading is Reading.UNDETERMINED
    with pytest.raises(ValueError):
        stability([GapPoint(2400, 0.01, 0.001, 11)], 0.009, 0.90, 4)


# ---------------------------------------------------------------------------------------------
# the registered run's report


def confirm_rows(tmp_path, gaps, seeds=CONFIRM_L256.seeds, name="perplexity_confirm", secondary=True):
    scratch = {A: 1.70, **{(p, s, d): 1.70 + gaps[s] for (p, s, d) in (P10, P20, P100)}}
    if secondary:
        scratch.update({NONE: 2.7, ROPE: 1.6})
    return ppl_run(tmp_path, scratch=scratch, seeds=seeds, seed_sd=0.001, steps=2400, train_run="train_confirm",
                   name=name)


def official_rows(tmp_path, gaps, steps):
    scratch = {A: 1.9, **{(p, s, d): 1.9 + gaps[s] for (p, s, d) in (P10, P20, P100)}}
    return ppl_run(tmp_path, scratch=scratch, seeds=(0, 1, 2, 3, 4), seed_sd=0.001, steps=steps,
                   train_run="train_official", name="perplexity_official")


def test_primary_verdicts_are_decided_under_holm_over_every_registered_seed(tmp_path):
    _, df = confirm_rows(tmp_path, {10: 0.040, 20: 0.005, 100: 0.0165})
    verdicts = {v.key: v for v in pr.primary_verdicts([df], CONFIRM_L256)}
    assert set(verdicts) == {f"primary/reaches_alibi_s{s}" for s in (10, 20, 100)}
    s10, s20, s100 = (verdicts[f"primary/reaches_alibi_s{s}"] for s in (10, 20, 100))
    assert s10.status is Status.NOT_SUPPORTED and s20.status is Status.SUPPORTED
    assert s100.status is Status.INCONCLUSIVE  # on the margin (0.017)
    assert "11 seeds x 3 draws" in s20.evidence and "Holm rank" in s20.evidence and "adjusted p" in s20.evidence
    assert s20.numbers["bound"] < s20.numbers["margin"] < s10.numbers["bound"]
    assert "stability not measured: no train_official at 600 steps, train_official at 1200 steps" in s20.evidence


def test_a_primary_verdict_needs_the_registered_draws_and_no_missing_value(tmp_path):
    _, df = confirm_rows(tmp_path, {10: 0.040, 20: 0.005, 100: 0.0})
    two = df[~((df.position == "poslsh") & (df.trial == 2))]  # two mask draws where three were registered
    assert all(v.status is Status.NOT_MEASURED and "3 registered" in v.evidence
               for v in pr.primary_verdicts([two], CONFIRM_L256))
    nan = df.copy()
    nan.loc[nan.index[0], "bits_per_byte"] = float("nan")
    assert all(v.status is Status.NOT_MEASURED and "NaN" in v.evidence for v in pr.primary_verdicts([nan], CONFIRM_L256))


def test_the_margin_is_one_percent_of_exact_alibis_mean_over_the_registered_seeds(tmp_path):
    _, df = confirm_rows(tmp_path, {10: 0.040, 20: 0.005, 100: 0.0})
    alibi = df[(df.position == "alibi") & (df.length == 256)].groupby("run_seed").bits_per_byte.mean()
    v = pr.primary_verdicts([df], CONFIRM_L256)[0]
    assert v.numbers["margin"] == pytest.approx(0.01 * alibi[list(CONFIRM_L256.seeds)].mean())


def test_a_primary_verdict_needs_every_registered_seed_and_shows_no_gap_before(tmp_path):
    _, df = confirm_rows(tmp_path, {10: 0.040, 20: 0.005, 100: 0.0}, seeds=CONFIRM_L256.seeds[:7])
    verdicts = pr.primary_verdicts([df], CONFIRM_L256)
    assert {v.status for v in verdicts} == {Status.NOT_MEASURED}
    assert all(v.evidence.startswith("7 of the 11 registered seeds evaluated") for v in verdicts)
    assert not any("gap" in v.evidence.split(":")[0] or "+0.0" in v.evidence for v in verdicts)


def test_the_stability_check_reads_the_earlier_runs_of_the_report(tmp_path):
    _, df = confirm_rows(tmp_path, {10: 0.030, 20: 0.020, 100: 0.005})
    _, half = official_rows(tmp_path, {10: 0.045, 20: 0.025, 100: 0.010}, 600)
    _, full = official_rows(tmp_path, {10: 0.038, 20: 0.021, 100: 0.006}, 1200)
    verdicts = {v.key: v for v in pr.primary_verdicts([df, pd.concat([half, full])], CONFIRM_L256)}
    st = verdicts["primary/reaches_alibi_s10"].numbers["stability"]
    assert st["slope"] < 0 and [p["steps"] for p in st["points"]] == [600, 1200, 2400]
    assert "per doubling of training" in verdicts["primary/reaches_alibi_s10"].evidence
    # the gap-against-s figure draws these points; the endpoint's 90% half-width is the verdict's own
    from poslsh_cli.experiments.perplexity.gap_figures import gap_points, plot_gap_against_s

    v = verdicts["primary/reaches_alibi_s10"]
    pts = gap_points(v)
    assert [p[0] for p in pts] == [600, 1200, 2400] and pts[-1][1] == pytest.approx(v.numbers["gap"])
    assert pts[-1][2] == pytest.approx((v.numbers["high90"] - v.numbers["low90"]) / 2)
    drawn = plot_gap_against_s(tmp_path, "confirm-L256-v1", verdicts.values())
    assert [p.name for p in drawn if p.suffix == ".png"] == ["registered_gap_vs_s_confirm-L256-v1.png"]
    assert plot_gap_against_s(tmp_path, "none", []) == []


def test_a_registered_runs_other_comparisons_are_estimates_not_verdicts(tmp_path):
    """The same rows under an exploratory run's name carry verdicts; under the registered run's name
    every comparison but the primary ones is an ESTIMATE (and its reaches-ALiBi claims are left to
    the registered section). An estimate's evidence says no count of seeds that would decide it, where
    the exploratory verdict of an undecided comparison does (s=10 against exact ALiBi: no gap)."""
    run, df = confirm_rows(tmp_path, {10: 0.0, 20: 0.005, 100: 0.0})
    sec = registry.get("perplexity").report(run, df)
    decided = {Status.SUPPORTED, Status.NOT_SUPPORTED, Status.INCONCLUSIVE}
    assert sec.verdicts and not [v.claim for v in sec.verdicts if v.status in decided]
    assert any(v.status is Status.ESTIMATE and "RoPE" in v.claim for v in sec.verdicts)
    assert not any("reaches the bits per byte" in v.claim for v in sec.verdicts)
    # an estimate is decided by no number of seeds: its evidence says none would
    assert not any("would decide" in v.evidence or "no number of seeds" in v.evidence for v in sec.verdicts)
    explored = registry.get("perplexity").report(run, df.assign(trained_run="train_official"))
    assert any(v.status in decided for v in explored.verdicts)
    assert any("would decide" in v.evidence or "no number of seeds" in v.evidence for v in explored.verdicts)


def test_the_report_puts_the_registered_section_before_the_language_model_sections(tmp_path):
    run, df = confirm_rows(tmp_path, {10: 0.040, 20: 0.005, 100: 0.0})
    # a perplexity run directory the report can read: config, meta, results
    from poslsh_cli.core.config import CONF_DIR  # noqa: F401  (the run's config is composed by the readers)
    import json
    import yaml

    spec_cfg = {"checkpoints": ["train_confirm"], "seed": 0}
    (run / "config.yaml").write_text(yaml.safe_dump(spec_cfg))
    (run / "meta.json").write_text(json.dumps({"command": "perplexity", "status": "complete", "argv": "poslsh perplexity"}))
    df.to_csv(run / "results.csv", index=False)
    sections, _, _ = sections_of([run], notice=lambda _: None)
    titles = [s.title for s in sections]
    assert titles[0].startswith("Registered confirmatory experiment"), titles
    got = {v.key: v for v in sections[0].verdicts}
    assert set(got) == {f"primary/reaches_alibi_s{s}" for s in (10, 20, 100)} | \
        {f"across/gap_grows_with_L_s{s}" for s in (10, 20, 100)}
    # the comparison across lengths waits for the L = 1024 experiment, and says so
    across = got["across/gap_grows_with_L_s10"]
    assert across.status is Status.NOT_MEASURED and "confirm-L1024-v1: 0 of the 11 registered seeds" in across.evidence


# ---------------------------------------------------------------------------------------------
# across lengths (docs/PREREGISTRATION_L1024.md)


def test_welch_is_scipys_unequal_variance_t_test():
    from poslsh_cli.verdicts.registered import welch

    a, b = [0.021, 0.025, 0.019, 0.024, 0.022], [0.030, 0.041, 0.028, 0.035, 0.039, 0.033]
    t = welch(a, b, bound=0.01)
    ref = stats.ttest_ind(b, a, equal_var=False, alternative="greater")
    assert t.d == pytest.approx(np.mean(b) - np.mean(a)) and t.p_above == pytest.approx(ref.pvalue)
    below = stats.ttest_ind(np.array(b) - 0.01, a, equal_var=False, alternative="less")
    assert t.p_below == pytest.approx(below.pvalue)
    half = stats.t.ppf(0.95, t.df) * t.se
    assert (t.low90, t.high90) == pytest.approx((t.d - half, t.d + half))
    with pytest.raises(ValueError):
        welch([0.1], b, 0.01)


def l1024_rows(tmp_path, gaps, seeds=None):
    from poslsh_cli.verdicts.registered import CONFIRM_L1024

    scratch = {A: 1.86, **{(p, s, d): 1.86 + gaps[s] for (p, s, d) in (P10, P20, P100)}}
    return ppl_run(tmp_path, scratch=scratch, seeds=seeds or CONFIRM_L1024.seeds, seed_sd=0.001, steps=2400,
                   trained_len=1024, far=2048, train_run="train_confirm_l1024", name="perplexity_confirm_l1024")


def test_the_gap_across_lengths_is_decided_as_registered(tmp_path):
    """Per s, D = the mean relative gap at L = 1024 minus at L = 256 by Welch's t, Holm over the three
    s in each direction: a gap that grows by 3 points is SUPPORTED, one that stays is NOT SUPPORTED
    (does not grow by more than 1%), one that grows by half a point reads "grows, by less than 1%"; the
    registered section carries the verdicts and the table; with a seed missing, NOT MEASURED."""
    from poslsh_cli.experiments.perplexity.across import across_lengths, relative_gaps
    from poslsh_cli.verdicts.registered import CONFIRM_L1024

    short_run, short = confirm_rows(tmp_path, {10: 0.040, 20: 0.020, 100: 0.005})
    long_run, long_ = l1024_rows(tmp_path, {10: 0.100, 20: 1.86 * 0.02 / 1.70, 100: 1.86 * (0.005 / 1.70 + 0.005)})
    verdicts, table = across_lengths([short, long_])
    got = {v.key: v for v in verdicts}
    assert list(got) == [f"across/gap_grows_with_L_s{s}" for s in (10, 20, 100)]
    s10, s20, s100 = got.values()
    assert s10.status is Status.SUPPORTED and s10.evidence.startswith("grows: D +")
    assert s20.status is Status.NOT_SUPPORTED and s20.evidence.startswith("does not grow by more than 1%")
    assert s100.status is Status.SUPPORTED and s100.evidence.startswith("grows, by less than 1%")
    # D recomputed from the rows: the relative gaps' means at each length
    rows = {r: pr.endpoint_rows(pd.concat([short, long_]), r, 2400) for r in ("train_confirm", "train_confirm_l1024")}
    def relative(run, s):  # per seed (poslsh - alibi) / alibi, each the mean over its draws, from the rows alone
        r = rows[run]
        p = r[(r.position == "poslsh") & (r.trained_s == s)].groupby("run_seed").bits_per_byte.mean()
        a = r[r.position == "alibi"].groupby("run_seed").bits_per_byte.mean()
        return ((p - a) / a).dropna()

    for v, s in zip(verdicts, (10, 20, 100)):
        a, b = relative("train_confirm", s), relative("train_confirm_l1024", s)
        assert len(a) == len(b) == 11 and v.numbers["d"] == pytest.approx(b.mean() - a.mean())
        assert sorted(relative_gaps(rows["train_confirm"], CONFIRM_L256.primary[(10, 20, 100).index(s)]).values()) == \
            pytest.approx(sorted(a.values))
    assert len(table) == 3 and table[0][0] == "Positional LSH s = 10"
    from poslsh_cli.experiments.perplexity.across import section

    sec = section([(long_run, long_), (short_run, short)])
    assert {v.key for v in sec.verdicts} >= set(got) and any("D (1024 - 256)" in t.columns for t in sec.tables)
    # its figures: the gap against s of each registration and the gap against L, in the first run's figures/
    first = min(short_run, long_run)
    assert sorted(p.name for p in sec.figures) == ["registered_gap_vs_L_across_lengths.png",
                                                   "registered_gap_vs_s_confirm-L1024-v1.png",
                                                   "registered_gap_vs_s_confirm-L256-v1.png"]
    assert all(p.parent == first / "figures" and p.stat().st_size > 0 for p in sec.figures)
    # the figure's points are the verdict's numbers: the relative gap at each length with its 90% interval
    nb = s10.numbers
    assert (nb["short_length"], nb["long_length"]) == (256, 1024)
    assert nb["short"] == pytest.approx(relative("train_confirm", 10).mean())
    iv = stats.t.interval(0.90, 10, loc=relative("train_confirm_l1024", 10).mean(),
                          scale=stats.sem(relative("train_confirm_l1024", 10)))
    assert (nb["long_low"], nb["long_high"]) == pytest.approx(iv)
    _, few = l1024_rows(tmp_path / "few", {10: 0.1, 20: 0.02, 100: 0.01}, seeds=CONFIRM_L1024.seeds[:5])
    missing, table = across_lengths([short, few])
    assert {v.status for v in missing} == {Status.NOT_MEASURED} and not table
    assert "confirm-L1024-v1: 5 of the 11 registered seeds" in missing[0].evidence
    assert across_lengths([official_rows(tmp_path / "o", {10: 0.04, 20: 0.02, 100: 0.01}, 1200)[1]]) == ([], [])


# ---------------------------------------------------------------------------------------------
# the answer the README opens its language-model part with


def test_the_registered_answer_is_computed_from_the_primary_endpoints_and_opens_the_readme_part(tmp_path):
    """The answer paragraph quotes each primary verdict's gap in bits per byte and in percent with its
    interval; the paper-form table recomputes from the rows (seed means, seed-paired gaps, top-1) with a
    verdict on the primary rows only; the caveats carry their numbers (the paper's L, each train run's
    exact-ALiBi baseline, the last-20% fall against the margin); the README part is that answer, its
    figure and a link (no verdict rows), in at most 40 lines. Before every seed is in: no lead."""
    from poslsh_cli.app import publish
    from poslsh_cli.experiments.perplexity.across import section
    from poslsh_cli.experiments.perplexity.headline import TABLE_HEAD

    run, df = confirm_rows(tmp_path, {10: 0.040, 20: 0.005, 100: 0.0})
    g = np.random.default_rng(1)
    df = df.assign(top1=0.4 + g.normal(0, 0.01, len(df)), trained_fall=df.run_seed * 0.001)
    _, other = official_rows(tmp_path, {10: 0.04, 20: 0.02, 100: 0.01}, 2400)
    sec = section([(run, df), (run.parent / "perplexity_official", other)])
    primary = {v.numbers["s"]: v for v in sec.verdicts if v.key.startswith("primary/")}
    first = sec.lead[0]
    assert first.startswith("confirm-L256-v1 (L = 256, sigma = 8, T = 2400 steps, 11 seeds, margin 1%")
    rows = pr.endpoint_rows(pd.concat([df]), "train_confirm", 2400)
    alibi = rows[rows.position == "alibi"].groupby("run_seed").bits_per_byte.mean()
    for s, v in primary.items():
        p = rows[(rows.position == "poslsh") & (rows.trained_s == s)].groupby("run_seed").bits_per_byte.mean()
        gap = float((p - alibi).mean())
        assert v.numbers["gap"] == pytest.approx(gap)
        assert f"s = {s} " in first and f"gap {gap:+.4f} bits per byte, {100 * gap / alibi.mean():+.2f}%" in first
    assert "s = 10 does not reach it (NOT SUPPORTED" in first and "s = 100 reaches it (SUPPORTED" in first
    table = next(t for t in sec.tables if list(t.columns) == TABLE_HEAD)
    assert list(table.scheme) == ["no position", "RoPE", "exact ALiBi", "Positional LSH s = 10",
                                  "Positional LSH s = 20", "Positional LSH s = 100"]
    by = table.set_index("scheme")
    assert by.loc["exact ALiBi", "verdict"] == "" and by.loc["RoPE", "verdict"] == ""
    assert by.loc["Positional LSH s = 10", "verdict"] == "**NOT SUPPORTED**"
    iv = stats.t.interval(0.90, 10, loc=alibi.mean(), scale=stats.sem(alibi))
    assert by.loc["exact ALiBi", "bits per byte [90%]"] == f"{alibi.mean():.4f} [{iv[0]:.4f}, {iv[1]:.4f}] (11 seeds)"
    top1 = rows[rows.position == "rope"].groupby("run_seed").top1.mean().mean()
    assert by.loc["RoPE", "top-1 %"] == f"{100 * top1:.2f}"
    caveats = "\n".join(sec.lead)
    assert "L = 256 is 32x shorter than the paper's L = 8192" in caveats
    assert f"{alibi.mean():.4f} (train_confirm, 2400 steps, 11 seeds)" in caveats and "(train_official, 2400" in caveats
    fall = rows.drop_duplicates("checkpoint").trained_fall
    assert f"still fell {fall.mean():.4f} bits per byte" in caveats and f"margin of {primary[10].numbers['margin']:.4f}" in caveats
    # the README part: the answer, its figure, a link; no verdict rows; short
    sec.figures = [tmp_path / "figures" / "registered_gap_vs_s_confirm-L256-v1.png"]
    md = publish.glance_markdown([sec], tmp_path / "RESULTS.md", tmp_path)
    part = md[md.index("**Language models"):]
    assert sec.lead[0] in part and "![registered_gap_vs_s_confirm-L256-v1](figures/" in part
    assert "| claim | verdict |" not in part and len(part.split("\n\n**")[0].splitlines()) <= 40
    # an interim look: no lead, the part keeps its rows
    _, few = confirm_rows(tmp_path / "few", {10: 0.04, 20: 0.005, 100: 0.0}, seeds=CONFIRM_L256.seeds[:4])
    waiting = section([(tmp_path / "few" / "perplexity_confirm", few)])
    assert not waiting.lead and "Not measured yet: 4 of the 11 registered seeds" in waiting.paragraphs[0]
