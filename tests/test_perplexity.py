"""poslsh perplexity: bits per byte of trained checkpoints equal transformers' own forward, swapped
attention, bad input, and the downstream claims judged on synthetic runs (reaching ALiBi,
fine-tuning, extrapolation, the paper's baselines)."""
import math

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import TINY, one_line, poslsh, status_of, verdicts
from poslsh_cli.app import registry
from poslsh_cli.lm.data import load_corpus
from poslsh_cli.lm.windows import eval_windows
from poslsh_cli.verdicts.claims import Status

# ---------------------------------------------------------------------------------------------
# perplexity: the downstream claims


def ppl_run(tmp_path, scratch=None, tuned=None, seeds=(0, 1, 2), seed_sd=0.002, window_sd=0.01, W=64, draws=3,
            degrade=None, name="run", far=1024, steps=0, trained_len=256, train_run=""):
    """A perplexity run directory with results.csv rows and windows.csv (per-window bits) drawn from
    stated effects: ``scratch`` / ``tuned`` map (position, s, dropout) -> bits per byte at L; each
    training seed shifts a scheme by N(0, seed_sd), each mask draw by N(0, seed_sd / 4), each window
    by N(0, window_sd); ``degrade`` maps a scheme to its bits per byte at 4L minus at L."""
    import numpy as np

    g = np.random.default_rng(0)
    rows, wins = [], []
    degrade = degrade or {}

    def add(scheme, value, finetuned, lengths):
        pos, s, drop = scheme
        for seed in seeds if finetuned == "no" or len(seeds) > 1 else seeds[:1]:
            shift = g.normal(0, seed_sd)
            ck = f"{pos}{s}-{drop}-{seed}-{finetuned}-{steps}-{trained_len}"
            for length in lengths:
                base = value + shift + (degrade.get(scheme, 0.0) if length > trained_len else 0.0)
                for trial in range(draws if pos == "poslsh" else 1):
                    bpb_w = base + g.normal(0, seed_sd / 4 if pos == "poslsh" else 0) + g.normal(0, window_sd, W)
                    bpb = float(bpb_w.mean())
                    rows.append(dict(checkpoint=ck, position=pos, attention="own", s=s, length=length, trial=trial,
                                     seed=-1, tokens=W * 255, loss=bpb * np.log(2), bits_per_byte=bpb, ppl=1.0,
                                     seconds=0.1, trained_len=trained_len, trained_s=s, finetuned=finetuned,
                                     run_seed=seed, bits_per_token=bpb, kl=0.0, bytes=W * 256, attn_dropout=drop,
                                     trained_steps=steps, trained_run=train_run))
                    wins.extend(dict(checkpoint=ck, attention="own", s=s, length=length, trial=trial, window=i,
                                     bits=float(b) * 256, bytes=256) for i, b in enumerate(bpb_w))

    for scheme, value in (scratch or {}).items():
        add(scheme, value, "no", (trained_len, far))
    for scheme, value in (tuned or {}).items():
        add(scheme, value, "yes", (256,))
    run = tmp_path / name
    run.mkdir(parents=True, exist_ok=True)
    wins = pd.DataFrame(wins)
    if (run / "windows.csv").exists():  # a second call adds another group of models to the same run
        wins = pd.concat([pd.read_csv(run / "windows.csv"), wins], ignore_index=True)
    wins.to_csv(run / "windows.csv", index=False)
    from poslsh_cli.experiments.perplexity.groups import migrate

    return run, migrate(pd.DataFrame(rows))  # as the command's functions receive rows (Experiment.migrate)


def ppl_report(tmp_path, **kw):
    run, df = ppl_run(tmp_path, **kw)
    return registry.get("perplexity").report(run, df)


A, P10, P20, NONE, ROPE, AD = ("alibi", 0, 0.0), ("poslsh", 10, 0.0), ("poslsh", 20, 0.0), ("none", 0, 0.0), \
    ("rope", 0, 0.0), ("alibi", 0, 0.1)


def test_reaches_alibi_is_an_equivalence_test(tmp_path):
    sec = ppl_report(tmp_path / "a", scratch={A: 1.8, P10: 1.801})
    assert status_of(sec, "s=10 reaches") is Status.SUPPORTED
    sec = ppl_report(tmp_path / "b", scratch={A: 1.8, P10: 1.9})
    assert status_of(sec, "s=10 reaches") is Status.NOT_SUPPORTED
    sec = ppl_report(tmp_path / "c", scratch={A: 1.8, P10: 1.81}, seeds=(0,), window_sd=0.3)
    v = [v for v in sec.verdicts if "s=10 reaches" in v.claim][0]
    assert v.status is Status.INCONCLUSIVE and "evaluation noise only" in v.evidence
    sec = ppl_report(tmp_path / "d", scratch={P10: 1.8})
    assert status_of(sec, "s=10 reaches") is Status.NOT_MEASURED


def test_a_claim_not_measured_names_only_the_models_missing(tmp_path):
    """The no-position contrast of a run without a no-position model names that model alone (it read
    "no none or poslsh s=10 models evaluated" on a run whose s=10 models were evaluated)."""
    sec = ppl_report(tmp_path, scratch={A: 1.8, P10: 1.81})
    v = [v for v in sec.verdicts if "without positional information" in v.claim][0]
    assert v.status is Status.NOT_MEASURED and v.evidence.startswith("no none models evaluated at L="), v.evidence


@pytest.mark.parametrize("lo,hi,expected", [
    (-0.015, 0.015, Status.SUPPORTED), (-0.03, 0.005, Status.SUPPORTED),   # a better scheme reaches it too
    (-0.08, -0.03, Status.SUPPORTED), (-0.01, 0.0199, Status.SUPPORTED),
    (-0.01, 0.02, Status.INCONCLUSIVE), (0.0, 0.05, Status.INCONCLUSIVE),  # the upper end at or past the margin
    (0.02, 0.05, Status.NOT_SUPPORTED), (0.03, 0.04, Status.NOT_SUPPORTED),
    (-0.1, 0.1, Status.INCONCLUSIVE),
])
def test_reaches_is_non_inferiority_at_its_edges(lo, hi, expected):
    from poslsh_cli.verdicts.stats import Interval, equivalence

    assert equivalence(Interval((lo + hi) / 2, lo, hi, 3, 0.9, "seeds"), 0.02)[0] is expected


def test_a_better_scheme_reaches_alibi(tmp_path):
    """Positional LSH clearly better than ALiBi (by 0.01 with a 90% interval reaching below -0.02):
    under the old two-sided rule this was INCONCLUSIVE, stricter than for an equal scheme."""
    sec = ppl_report(tmp_path, scratch={A: 1.8, P10: 1.79}, seed_sd=0.01)
    v = [v for v in sec.verdicts if "s=10 reaches" in v.claim][0]
    assert v.status is Status.SUPPORTED, v.evidence


def test_better_rules_need_the_interval_to_exclude_zero(tmp_path):
    sec = ppl_report(tmp_path / "a", scratch={A: 1.85, P10: 1.80, NONE: 2.8, AD: 1.83})
    assert status_of(sec, "without positional information") is Status.SUPPORTED
    assert status_of(sec, "is better than exact ALiBi trained with attention dropout") is Status.SUPPORTED
    assert verdicts(sec)["from scratch, Positional LSH s=10 is better than exact ALiBi"] is Status.SUPPORTED
    sec = ppl_report(tmp_path / "b", scratch={A: 1.8, P10: 1.85, NONE: 1.7, AD: 1.75})
    assert status_of(sec, "without positional information") is Status.NOT_SUPPORTED
    assert status_of(sec, "trained with attention dropout") is Status.NOT_SUPPORTED
    sec = ppl_report(tmp_path / "c", scratch={A: 1.8, P10: 1.799, NONE: 1.801, AD: 1.8}, seeds=(0,), window_sd=0.3)
    for claim in ("without positional information", "trained with attention dropout"):
        v = [v for v in sec.verdicts if claim in v.claim][0]
        assert v.status is Status.INCONCLUSIVE and "evaluation noise only" in v.evidence
    sec = ppl_report(tmp_path / "d", scratch={A: 1.8, P10: 1.8})
    assert status_of(sec, "without positional information") is Status.NOT_MEASURED
    assert status_of(sec, "trained with attention dropout") is Status.NOT_MEASURED


def test_fine_tuning_needs_a_negative_slope_and_closeness(tmp_path):
    ft = lambda gaps: {A: 2.0, ("fixed_block", 0, 0.0): 2.4, **{("poslsh", s, 0.0): 2.0 + g  # noqa: E731
                                                                for s, g in zip((1, 2, 5, 10, 20), gaps)}}
    sec = ppl_report(tmp_path / "a", tuned=ft((0.3, 0.2, 0.1, 0.05, 0.005)))
    assert status_of(sec, "falls as s grows") is Status.SUPPORTED
    assert status_of(sec, "largest s (s=20) reaches") is Status.SUPPORTED
    assert status_of(sec, "better than fixed blocks") is Status.SUPPORTED
    sec = ppl_report(tmp_path / "b", tuned=ft((0.01, 0.05, 0.1, 0.2, 0.5)))
    assert status_of(sec, "falls as s grows") is Status.NOT_SUPPORTED
    assert status_of(sec, "largest s (s=20) reaches") is Status.NOT_SUPPORTED
    assert status_of(sec, "better than fixed blocks") is Status.NOT_SUPPORTED
    sec = ppl_report(tmp_path / "c", tuned=ft((0.1, 0.1, 0.1, 0.1, 0.1)), seeds=(0,), seed_sd=0.0, window_sd=0.05)
    assert status_of(sec, "falls as s grows") is Status.INCONCLUSIVE
    sec = ppl_report(tmp_path / "d", scratch={A: 1.8, P10: 1.8})
    assert status_of(sec, "falls as s grows") is Status.NOT_MEASURED
    assert status_of(sec, "better than fixed blocks") is Status.NOT_MEASURED


def test_fine_tuning_slope_is_one_slope_per_seed_over_the_seeds(tmp_path):
    """Every gap of a seed shares that seed's ALiBi value: with seed-to-seed shifts of ALiBi alone,
    15 (s, seed) points fitted as independent give a tight slope; one slope per seed (each exactly
    the same here) gives the interval over 3 seeds, and the evidence lists the per-seed slopes."""
    from poslsh_cli.experiments.perplexity.claims import Data, Arm
    from poslsh_cli.experiments.perplexity.finetune import claim_finetune_approaches_alibi
    from poslsh_cli.verdicts.stats import t_interval

    gaps = {1: 0.3, 2: 0.2, 5: 0.1, 10: 0.05, 20: 0.01}
    ft = {A: 2.0, **{("poslsh", s, 0.0): 2.0 + g for s, g in gaps.items()}}
    run, df = ppl_run(tmp_path, tuned=ft, seed_sd=0.05, window_sd=0.001, draws=1)
    d = Data(df[df.attention == "own"], pd.read_csv(run / "windows.csv"), 256)
    v = claim_finetune_approaches_alibi(d)[0]
    assert "one slope per seed" in v.evidence and "seed 2:" in v.evidence, v.evidence
    a = d.per_seed(Arm("alibi"), 256)
    slopes = []
    for seed in (0, 1, 2):
        x = [np.log(s) for s in gaps]
        y = [d.per_seed(Arm("poslsh", s), 256)[seed] - a[seed] for s in gaps]
        slopes.append(np.polyfit(x, y, 1)[0])
    iv = t_interval(slopes)
    assert f"{iv.estimate:+.4f} [{iv.low:+.4f}, {iv.high:+.4f}] (95%, 3 seeds)" in v.evidence, v.evidence
    assert v.status is (Status.SUPPORTED if iv.high < 0 else Status.INCONCLUSIVE)
    one = claim_finetune_approaches_alibi(Data(d.rows[d.rows.run_seed == 0], d.windows, 256))[0]
    assert "evaluation noise only" in one.evidence and "1 seed:" in one.evidence, one.evidence


def test_extrapolation_with_two_seeds_shows_evaluation_noise_and_decides_nothing(tmp_path):
    """Two seeds give a t-interval with one degree of freedom; like every other rule, the robustness
    claim needs three: it shows the interval over the evaluation windows and stays INCONCLUSIVE."""
    base = {A: 1.8, P10: 1.8, ROPE: 1.8, NONE: 2.8}
    sec = ppl_report(tmp_path, scratch=base, degrade={P10: -0.02, ROPE: 0.4, NONE: 0.2}, seeds=(0, 1))
    for claim in ("robust at 4x", "rope degrades more"):
        v = [v for v in sec.verdicts if claim in v.claim][0]
        assert "2 training seeds: evaluation noise only (undecided: a verdict needs 3 training seeds)" in v.evidence, \
            v.evidence
        assert v.status is Status.INCONCLUSIVE  # the windows' interval (-0.02, sd 0.01) would have said SUPPORTED


def test_a_comparison_of_trained_models_is_decided_over_three_seeds_not_over_windows(tmp_path):
    """One or two training seeds: however far the interval over the evaluation windows lies from the
    boundary (Positional LSH 0.3 bits per byte better here), the verdict is INCONCLUSIVE and says why;
    the same models over three seeds are decided."""
    base = {A: 1.8, P10: 1.5, ROPE: 1.9, NONE: 2.8}
    claims = [f"from scratch, Positional LSH s=10 {c}" for c in ("reaches the bits per byte of exact ALiBi",
                                                                  "is better than exact ALiBi",
                                                                  "is better than the original RoPE model")]
    for seeds in ((0,), (0, 1)):
        sec = ppl_report(tmp_path / str(len(seeds)), scratch=base, seeds=seeds)
        for claim in claims:
            v = [v for v in sec.verdicts if v.claim == claim][0]
            assert v.status is Status.INCONCLUSIVE, (seeds, claim, v.evidence)
            assert "evaluation noise only" in v.evidence and "a verdict needs 3 training seeds" in v.evidence
    sec = ppl_report(tmp_path / "3", scratch=base, seeds=(0, 1, 2))
    assert [v.status for c in claims for v in sec.verdicts if v.claim == c] == [Status.SUPPORTED] * 3


def test_extrapolation_needs_its_contrast_and_intervals(tmp_path):
    base = {A: 1.8, P10: 1.8, ROPE: 1.8, NONE: 2.8}
    sec = ppl_report(tmp_path / "a", scratch=base, degrade={P10: -0.02, ROPE: 0.4, NONE: 0.2})
    assert status_of(sec, "robust at 4x") is Status.SUPPORTED
    assert status_of(sec, "rope degrades more") is Status.SUPPORTED
    sec = ppl_report(tmp_path / "b", scratch=base, degrade={P10: 0.3, ROPE: 0.0, NONE: 0.0})
    assert status_of(sec, "robust at 4x") is Status.NOT_SUPPORTED
    assert status_of(sec, "rope degrades more") is Status.NOT_SUPPORTED
    sec = ppl_report(tmp_path / "c", scratch=base, degrade={P10: 0.0, ROPE: 0.0}, seeds=(0,), window_sd=0.3)
    assert status_of(sec, "robust at 4x") is Status.INCONCLUSIVE
    assert status_of(sec, "rope degrades more") is Status.INCONCLUSIVE
    # without a RoPE or no-position model, robustness is still judged on Positional LSH's own change
    # (it read NOT MEASURED beside a measured difference), and says there is nothing to set beside it
    sec = ppl_report(tmp_path / "d", scratch={A: 1.8, P10: 1.8}, degrade={P10: 0.0})
    v = [v for v in sec.verdicts if "robust at 4x" in v.claim][0]
    assert v.status is Status.SUPPORTED and "no rope or none model evaluated at L and 4L to set beside it" in v.evidence


def test_swapped_table_pairs_each_seed_with_its_own_attention(tmp_path):
    """Swapped rows at the training length: the mean over seeds of each seed's mean over draws, and the
    seed-paired difference from the same models' own attention, recomputed here from the rows."""
    from poslsh_cli.experiments.perplexity.report import swapped_table
    from poslsh_cli.verdicts.stats import t_interval

    _, df = ppl_run(tmp_path, scratch={A: 1.8, P10: 1.9})
    g = np.random.default_rng(1)
    extra = []
    for _, r in df[(df.position == "poslsh") & (df.length == 256)].drop_duplicates("run_seed").iterrows():
        extra.append({**r.to_dict(), "attention": "alibi", "s": 0, "trial": 0, "seed": -1,
                      "bits_per_byte": 1.85 + g.normal(0, 0.01), "kl": 0.05})
    for _, r in df[(df.position == "alibi") & (df.length == 256)].iterrows():
        for trial in range(3):
            extra.append({**r.to_dict(), "attention": "poslsh", "s": 10, "trial": trial, "seed": trial,
                          "bits_per_byte": 2.0 + g.normal(0, 0.01), "kl": 0.1})
    extra.append({**extra[0], "length": 1024})  # not at the training length: left out
    df = pd.concat([df, pd.DataFrame(extra)], ignore_index=True)
    t = swapped_table(df).set_index(["trained", "attention"])
    assert list(t.index) == [("alibi", "poslsh s=10"), ("poslsh s=10", "alibi")]
    for (trained, att), pos, swap in ((("poslsh s=10", "alibi"), "poslsh", "alibi"),
                                      (("alibi", "poslsh s=10"), "alibi", "poslsh")):
        rows = df[(df.position == pos) & (df.length == 256)]
        sw = rows[rows.attention == swap].groupby("run_seed").bits_per_byte.mean()
        own = rows[rows.attention == "own"].groupby("run_seed").bits_per_byte.mean()
        row = t.loc[(trained, att)]
        assert row["seeds"] == 3 and row["bits/byte"] == round(sw.mean(), 4)
        assert row["own"] == round(own.mean(), 4)
        iv = t_interval((sw - own).values)
        assert row["swapped - own"] == round(iv.estimate, 4)
        assert row["difference 95%"] == f"[{iv.low:.4f}, {iv.high:.4f}]"
    assert t.loc[("alibi", "poslsh s=10")]["draws/seed"] == 3 and t.loc[("alibi", "poslsh s=10")]["KL"] == 0.1


def captured_figures(monkeypatch):
    """Figures handed to plotting.save, kept open for inspection instead of written."""
    import poslsh_cli.verdicts.plotting as plotting

    figs = {}
    monkeypatch.setattr(plotting, "save", lambda fig, run, name: figs.setdefault(name, fig) and [])
    return figs


def test_alibi_with_and_without_dropout_are_two_models_everywhere(tmp_path, monkeypatch):
    """Exact ALiBi and exact ALiBi trained with attention dropout (and a model with one sigma for
    every head) are different models: their own rows in the console table, their own curves in
    bits per byte against length, their own legend entries and colours in the learning curves."""
    from poslsh_cli.experiments.perplexity import plots as perplexity_plots
    from poslsh_cli.experiments.perplexity import report as perplexity_report
    from poslsh_cli.experiments.train import report as train_report

    run, df = ppl_run(tmp_path / "p", scratch={A: 1.8, AD: 1.9})
    df = pd.concat([df, df[(df.position == "alibi") & (df.attn_dropout == 0)].assign(
        sigmas="sigma=256 every head", bits_per_byte=lambda x: x.bits_per_byte + 0.5,
        checkpoint=lambda x: x.checkpoint + "-256")])
    df["sigmas"] = df.sigmas.fillna("")
    head, rows = perplexity_report.summary(df)
    by = {r[0]: r for r in rows}
    assert set(by) == {"alibi", "alibi +dropout 0.1", "alibi (sigma=256 every head)"}, rows
    col = head.index("bpb L=256")
    for label, sel in (("alibi", (df.attn_dropout == 0) & (df.sigmas == "")), ("alibi +dropout 0.1", df.attn_dropout > 0)):
        assert by[label][col] == f"{df[sel & (df.length == 256)].bits_per_byte.mean():.4f}"
        assert by[label][head.index("seeds")] == "3"
    figs = captured_figures(monkeypatch)
    perplexity_plots.plot(run, df)
    ax = figs["bpb_vs_length"].axes[0]
    curves = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    assert set(curves) == {"alibi", "alibi +dropout 0.1", "alibi (sigma=256 every head)"}
    assert abs(curves["alibi +dropout 0.1"].get_ydata()[0]
               - df[(df.attn_dropout > 0) & (df.length == 256)].bits_per_byte.mean()) < 1e-12

    runs = []
    for drop in (0.0, 0.1):
        work = tmp_path / "t" / f"work/alibi-{drop}"
        (work / "final").mkdir(parents=True)
        pd.DataFrame({"step": [1, 2], "loss": [3.0, 2.0 + drop], "val_bpb": [4.0, 3.0 + drop]}).to_csv(
            work / "metrics.csv", index=False)
        runs.append(dict(position="alibi", s=0, seed=0, seq_len=256, attn_dropout=drop, sigmas="standard",
                         checkpoint=f"work/alibi-{drop}/final", params=1, train_loss=2.0, val_bpb=3.0 + drop,
                         val_ppl=1.0, tokens_per_s=1.0, seconds=1.0))
    tdf = pd.DataFrame(runs)
    assert [r[0] for r in train_report.summary(tdf)[1]] == ["alibi", "alibi +dropout 0.1"]
    train_report.plot_learning_curves(tmp_path / "t", tdf)
    lines = [ln for ln in figs["learning_curves"].axes[1].get_lines()]
    assert [ln.get_label() for ln in lines] == ["alibi seed=0", "alibi +dropout 0.1 seed=0"]
    assert lines[0].get_color() != lines[1].get_color()


def test_the_swapped_figure_lists_what_was_run_with_in_one_order(tmp_path, monkeypatch):
    """The legend of 'attention swapped at inference' is in the scheme order, Positional LSH by s
    (its labels come from a set: without a total order they came out in a different order per process,
    and the published figure could not be regenerated byte for byte)."""
    from poslsh_cli.experiments.perplexity import plots as perplexity_plots

    run, df = ppl_run(tmp_path, scratch={A: 1.8, P10: 1.9}, seeds=(0,), draws=1)
    at_L = df[(df.position == "alibi") & (df.length == 256)]
    swaps = [at_L.assign(attention="poslsh", s=s) for s in (1000, 10, 100)] + [
        df[(df.position == "poslsh") & (df.length == 256)].assign(attention="alibi", s=0)]
    figs = captured_figures(monkeypatch)
    perplexity_plots.plot(run, pd.concat([df, *swaps], ignore_index=True))
    labels = [t.get_text() for t in figs["bpb_swapped"].legends[0].get_texts()]
    assert [t.split(" (")[0] for t in labels] == ["own", "alibi", "poslsh s=10", "poslsh s=100", "poslsh s=1000"], labels


def test_papers_baselines_the_2L_multiple_and_the_side_by_side_table(tmp_path):
    from poslsh_cli.app.report import side_by_side

    FB = ("fixed_block", 0, 0.0)
    scheme = {A: 1.8, P10: 1.8, ROPE: 1.9, FB: 1.95, NONE: 2.8}
    run_a, df_a = ppl_run(tmp_path, scratch=scheme, degrade={P10: -0.02, ROPE: 0.4}, name="perplexity")
    sec_a = registry.get("perplexity").report(run_a, df_a)
    assert status_of(sec_a, "better than the original RoPE model") is Status.SUPPORTED
    assert status_of(sec_a, "s=10 is better than fixed blocks") is Status.SUPPORTED
    assert status_of(sec_a, "robust at 4x") is Status.SUPPORTED
    # evaluated at L and 2L only (the paper's longest multiple here): the claims say 2x / 2L
    run_b, df_b = ppl_run(tmp_path, scratch={**scheme, ROPE: 1.7}, degrade={P10: 0.3, ROPE: 0.4},
                          name="perplexity_official", far=512)
    sec_b = registry.get("perplexity").report(run_b, df_b)
    assert status_of(sec_b, "robust at 2x") is Status.NOT_SUPPORTED
    assert any("rope degrades more at 2L" in v.claim for v in sec_b.verdicts)
    assert status_of(sec_b, "better than the original RoPE model") is Status.NOT_SUPPORTED
    table = side_by_side([sec_a, sec_b]).tables[0]
    # each column is a run named with its bandwidths (these rows record none)
    assert list(table.columns) == ["claim", "perplexity: no bandwidth", "perplexity_official: no bandwidth"]
    table.columns = ["claim", "perplexity", "perplexity_official"]
    # the claims join on their names: "robust at 4x" of one run and "robust at 2x" of the other are one row
    row = table[table.claim.str.startswith("Positional LSH stays robust at 4x")].iloc[0]
    assert row.perplexity.startswith("SUPPORTED") and row.perplexity_official.startswith("NOT SUPPORTED")
    row = table[table.claim.str.contains("better than the original RoPE")].iloc[0]
    assert row.perplexity.startswith("SUPPORTED") and row.perplexity_official.startswith("NOT SUPPORTED")


def test_the_side_by_side_table_joins_claims_on_their_names_not_their_wording(tmp_path):
    """Rewording a claim in one run (its sentence) keeps it on the same row: the reader joins on names."""
    import dataclasses

    from poslsh_cli.app.report import side_by_side

    scheme = {A: 1.8, P10: 1.8, ROPE: 1.9, NONE: 2.8}
    run_a, df_a = ppl_run(tmp_path, scratch=scheme, name="a")
    run_b, df_b = ppl_run(tmp_path, scratch=scheme, name="b")
    sec_a = registry.get("perplexity").report(run_a, df_a)
    sec_b = registry.get("perplexity").report(run_b, df_b)
    sec_b.verdicts = [dataclasses.replace(v, claim="reworded: " + v.claim) for v in sec_b.verdicts]
    table = side_by_side([sec_a, sec_b]).tables[0]
    assert len(table) == len({v.name for v in sec_a.verdicts})
    assert not table.apply(lambda r: "not judged in this run" in r.values, axis=1).any()


def test_the_margin_is_one_percent_of_exact_alibis_own_value(tmp_path):
    """The non-inferiority margin scales with the baseline: 1% of exact ALiBi's bits per byte. A gap
    of 0.012 reaches ALiBi at 1.8 bpb (margin 0.018) and not at 0.8 bpb (margin 0.008)."""
    sec = ppl_report(tmp_path / "a", scratch={A: 1.8, P10: 1.812}, seed_sd=0.0005)
    v = [v for v in sec.verdicts if "s=10 reaches the bits" in v.claim][0]
    assert v.status is Status.SUPPORTED and "margin 0.0180 (1% of alibi's)" in v.evidence, v.evidence
    assert v.numbers["margin"] == pytest.approx(0.018, rel=0.01)
    sec = ppl_report(tmp_path / "b", scratch={A: 0.8, P10: 0.812}, seed_sd=0.0005)
    v = [v for v in sec.verdicts if "s=10 reaches the bits" in v.claim][0]
    assert v.status is Status.NOT_SUPPORTED and "margin 0.0080" in v.evidence, v.evidence
    assert any("margin is 1% of exact ALiBi's own value" in p for p in sec.paragraphs)


def test_a_verdict_stands_only_where_the_gap_settled_between_half_and_full_training(tmp_path):
    """One train run at T/2 and T: the verdict at T is judged as before, then kept only when the
    seed-paired gap moved by less than half the margin between the two trainings."""
    def report(name, gap_half, gap_full):
        run, half = ppl_run(tmp_path, scratch={A: 2.0, P10: 2.0 + gap_half, NONE: 3.0}, steps=500, name=name,
                            seed_sd=0.0005, train_run="train_official")
        _, full = ppl_run(tmp_path, scratch={A: 1.8, P10: 1.8 + gap_full, NONE: 2.8}, steps=1000, name=name,
                          seed_sd=0.0005, train_run="train_official")
        return registry.get("perplexity").report(run, pd.concat([half, full], ignore_index=True))

    settled = [v for v in report("a", 0.004, 0.006).verdicts if "s=10 reaches the bits" in v.claim]
    assert len(settled) == 1, [v.claim for v in report("a", 0.004, 0.006).verdicts]  # judged at T only
    assert settled[0].status is Status.SUPPORTED and "the gap settled: +0.00" in settled[0].evidence
    assert "at 500 steps" in settled[0].evidence and "at 1000" in settled[0].evidence
    moving = [v for v in report("b", -0.01, 0.006).verdicts if "s=10 reaches the bits" in v.claim][0]
    # at T alone this is SUPPORTED (0.006 < 0.018); it moved 0.016, more than half the margin (0.009)
    assert "seeds would decide" not in moving.evidence
    assert moving.status is Status.INCONCLUSIVE and "the gap still moves with training: -0.0" in moving.evidence, \
        moving.evidence
    better = [v for v in report("c", 0.5, 0.5).verdicts if "beats the model without positional" in v.claim][0]
    assert better.status is Status.SUPPORTED and "settled" in better.evidence  # none - poslsh moved 0.0


def test_tables_and_figures_keep_the_half_and_full_training_of_a_run_apart(tmp_path, monkeypatch):
    """A run's models trained for T/2 and for T are different models in every table (a steps column)
    and the figures draw the longest training only: no row or curve averages the two as if they were
    one model's mask draws (alibi 2.0 at T/2, 1.8 at T; only the T models have swapped rows and 4L)."""
    from poslsh_cli.experiments.perplexity import plots as perplexity_plots
    from poslsh_cli.experiments.perplexity.report import accuracy_table, interval_table, swapped_table

    run, half = ppl_run(tmp_path, scratch={A: 2.0, P10: 2.05}, steps=600, name="r", seed_sd=0.0005,
                        train_run="train_official", far=256)
    _, full = ppl_run(tmp_path, scratch={A: 1.8, P10: 1.85}, steps=1200, name="r", seed_sd=0.0005,
                      train_run="train_official")
    swap = full[(full.position == "alibi") & (full.length == 256)].assign(attention="poslsh", s=100, kl=0.01,
                                                                        bits_per_byte=lambda x: x.bits_per_byte + 0.01)
    df = pd.concat([half.drop_duplicates(["checkpoint", "length", "trial"]), full, swap], ignore_index=True)
    df = df.assign(top1=0.5, top10=0.9, top100=1.0, mrr=0.6, entropy=1.0)
    own = df[df.attention == "own"]
    t = interval_table(own)
    assert set(t.steps) == {600, 1200}, t
    at = t[(t.scheme == "alibi") & (t.length == 256)].set_index("steps")["bits/byte"]
    assert at[600] == pytest.approx(2.0, abs=0.003) and at[1200] == pytest.approx(1.8, abs=0.003)
    assert (t[t.scheme == "alibi"]["draws/seed"] == 1).all()
    sw = swapped_table(df).iloc[0]
    assert sw.steps == 1200 and sw["own"] == pytest.approx(1.8, abs=0.003) and sw["swapped - own"] == pytest.approx(0.01)
    acc = accuracy_table(own)
    assert set(acc.steps) == {600, 1200} and len(acc) == 6, acc
    figs = captured_figures(monkeypatch)
    perplexity_plots.plot(run, df)
    ax = figs["bpb_vs_length"].axes[0]
    alibi = [ln for ln in ax.get_lines() if ln.get_label() == "alibi"][0]
    assert alibi.get_ydata()[0] == pytest.approx(1.8, abs=0.003)  # the T models', not the mean with T/2's


def test_finetuned_claims_keep_training_lengths_apart(tmp_path):
    """Fine-tuned models trained at L=128 and at L=256 and both scored at 256 are two groups: the
    claims at L=256 read the models trained at 256 (alibi 2.00), not a mix with those of 128."""
    tuned = {A: 2.0, ("fixed_block", 0, 0.0): 2.4, **{("poslsh", s, 0.0): 2.0 + g
                                                      for s, g in zip((1, 2, 5, 10, 20), (0.3, 0.2, 0.1, 0.05, 0.01))}}
    run, at256 = ppl_run(tmp_path, tuned=tuned, seed_sd=0.001)
    _, at128 = ppl_run(tmp_path, tuned={k: v + 1.0 for k, v in tuned.items()}, seed_sd=0.001, trained_len=128)
    df = pd.concat([at256, at128], ignore_index=True)
    sec = registry.get("perplexity").report(run, df)
    v = [v for v in sec.verdicts if "largest s (s=20) reaches" in v.claim and "L=256" in v.evidence]
    assert v and "alibi 2.00" in v[0].evidence, [x.evidence for x in sec.verdicts if "largest s" in x.claim]


def test_the_gap_is_the_training_kernel_crossed_with_the_inference_kernel(tmp_path):
    """The 2 x 2 table (weights trained with exact ALiBi or Positional LSH, run with either): its four
    cells, the effects and their interaction, seed-paired; the weights comparison is an estimate, never a
    verdict (the training kernel's effect depends on the inference kernel)."""
    from poslsh_cli.experiments.perplexity.groups import decomposition

    def run(name, weights_gap, alibi_with_masks):
        r, df = ppl_run(tmp_path, scratch={A: 1.8, P10: 1.9}, seed_sd=0.0005, name=name)
        extra = []
        for _, row in df[(df.position == "poslsh") & (df.length == 256)].drop_duplicates("run_seed").iterrows():
            extra.append({**row.to_dict(), "attention": "alibi", "s": 0, "trial": 0,
                          "bits_per_byte": 1.8 + weights_gap + 0.0005 * row.run_seed})
            for s_inf, v in ((10, 1.9), (100, 1.83), (1000, 1.81)):
                extra.append({**row.to_dict(), "attention": "poslsh", "s": s_inf, "trial": 0, "bits_per_byte": v})
        for _, row in df[(df.position == "alibi") & (df.length == 256)].drop_duplicates("run_seed").iterrows():
            extra.append({**row.to_dict(), "attention": "poslsh", "s": 10, "trial": 0, "bits_per_byte": alibi_with_masks})
        df = pd.concat([df, pd.DataFrame(extra)], ignore_index=True)
        return registry.get("perplexity").report(r, df), df

    sec, df = run("a", 0.002, 1.86)
    t = decomposition(df).iloc[0]
    assert t.trained == "poslsh s=10" and t.seeds == 3
    assert (t.AA, t.AP, t.PA, t.PP) == pytest.approx((1.8, 1.86, 1.8025, 1.9), abs=3e-3)
    est = {k: float(t[k].split()[0]) for k in ("total PP-AA", "inference on own weights PP-PA",
                                                 "inference on ALiBi weights AP-AA", "interaction")}
    # the interaction is the difference of the inference kernel's effects on the two sets of weights
    assert est["interaction"] == pytest.approx(est["inference on own weights PP-PA"]
                                               - est["inference on ALiBi weights AP-AA"], abs=1e-4)
    assert est["interaction"] == pytest.approx(0.0375, abs=3e-3) and "[" in t["interaction"]
    assert t["s=1000 at inference - AA"] == pytest.approx(0.01, abs=2e-3)
    for gap in (0.002, 0.08):  # whatever the weights' difference: an estimate, not a verdict
        sec, _ = run(f"g{gap}", gap, 1.86)
        assert status_of(sec, "trained weights run with exact ALiBi") is Status.ESTIMATE


def test_inconclusive_verdicts_say_how_many_seeds_would_decide_and_the_family_is_counted(tmp_path):
    sec = ppl_report(tmp_path, scratch={A: 1.8, P10: 1.815, NONE: 2.8}, seed_sd=0.004)
    v = [v for v in sec.verdicts if "s=10 reaches the bits" in v.claim][0]
    assert v.status is Status.INCONCLUSIVE and "seeds would decide it" in v.evidence, v.evidence
    power = [t for t in sec.tables if "seeds for half-width <= margin/2" in t.columns][0]
    assert v.claim in set(power.claim)
    family = [p for p in sec.paragraphs if "no multiplicity correction" in p][0]
    judged = sum(1 for x in sec.verdicts if x.status is not Status.NOT_MEASURED)
    assert f"These {judged} language-model verdicts" in family and "Bonferroni" in family


def test_the_family_paragraph_counts_every_verdict_decided_over_seeds_the_extrapolation_ones_too(tmp_path):
    """Verdicts decided over seeds far from their boundaries (RoPE degrading 0.4 more at 4L, seed SD
    0.002) still hold under Bonferroni's correction, and the paragraph names them; each carries the
    interval it was decided on."""
    sec = ppl_report(tmp_path, scratch={A: 1.8, P10: 1.8, ROPE: 1.8, NONE: 2.8}, seed_sd=0.002,
                     degrade={P10: -0.02, ROPE: 0.4, NONE: 0.2})
    family = [p for p in sec.paragraphs if "no multiplicity correction" in p][0]
    for claim in ("rope degrades more at 4L", "none degrades more at 4L", "robust at 4x"):
        v = [v for v in sec.verdicts if claim in v.claim][0]
        assert v.status is Status.SUPPORTED and v.numbers["diff"]["source"] == "seeds", v.numbers
        assert v.claim in family, family


def test_byte_models_show_no_top_100_column():
    """A byte-level model predicts one of about 256 bytes: its top 100 hold the true byte almost always
    (every trained byte model scored 100%), so its reports show top-1 and top-10 but not top-100; a
    model with a subword tokenizer (fewer tokens than bytes) keeps it."""
    from poslsh_cli.experiments.perplexity.report import shown_metrics

    byte_rows = pd.DataFrame({"bytes": [4096, 8192], "tokens": [4096, 8192]})
    word_rows = pd.DataFrame({"bytes": [4096, 8192], "tokens": [1024, 2050]})
    assert [m.name for m in shown_metrics(byte_rows)] == ["top1", "top10", "mrr", "entropy"]
    assert [m.name for m in shown_metrics(word_rows)] == ["top1", "top10", "top100", "mrr", "entropy"]


def test_stats_power_helpers_follow_the_t_distribution():
    from scipy import stats

    from poslsh_cli.verdicts.stats import (family_wise, half_width, seeds_for_half_width, seeds_to_decide, spread,
                                          t_interval)

    x = [0.010, 0.013, 0.011, 0.016]
    iv = t_interval(x, 0.90)
    assert spread(iv) == pytest.approx(np.std(x, ddof=1))
    assert half_width(np.std(x, ddof=1), 4, 0.90) == pytest.approx((iv.high - iv.low) / 2)
    n = seeds_for_half_width(0.002, 0.0075)
    assert half_width(0.002, n, 0.9) <= 0.0075 < half_width(0.002, n - 1, 0.9)
    need = seeds_to_decide(iv, 0.018)
    assert half_width(spread(iv), need, 0.9) < 0.018 - iv.estimate <= half_width(spread(iv), need - 1, 0.9) or need == 2
    wide = family_wise(iv, 6)
    assert wide.level == pytest.approx(1 - 0.1 / 6)
    assert (wide.high - wide.low) / 2 == pytest.approx(stats.t.ppf(1 - 0.05 / 6, 3) * np.std(x, ddof=1) / 2)


# ---------------------------------------------------------------------------------------------
# poslsh perplexity end to end, on the checkpoints of a training run


def test_perplexity_of_a_rope_checkpoint_equals_transformers_own_forward(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    df = pd.read_csv(trained / "results.csv")
    ck = trained / df[df.position == "rope"].checkpoint.iloc[0]
    out = tmp_path / "ppl"
    r = poslsh("perplexity", ck, "lengths=[32,64]", "max_tokens=2048", f"out={out}")
    assert r.exit_code == 0, r.output
    res = pd.read_csv(out / "results.csv")
    model = AutoModelForCausalLM.from_pretrained(ck, local_files_only=True).eval()
    val = load_corpus("builtin", 0.1).val
    for length in (32, 64):
        total, count = 0.0, 0
        with torch.no_grad():
            for w in eval_windows(val, length, max_tokens=2048):
                x = torch.as_tensor(w.tokens)[None]
                logits = model(input_ids=x).logits[0, :-1]
                total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
                count += length - 1
        row = res[res.length == length].iloc[0]
        assert row.tokens == count
        assert row.loss == pytest.approx(total / count, rel=1e-5)
        assert row.bits_per_byte == pytest.approx(total / count / math.log(2), rel=1e-5)


@pytest.mark.slow
def test_perplexity_swaps_attention_and_defaults_to_L_to_8L(trained, tmp_path):
    out = tmp_path / "ppl"
    r = poslsh("perplexity", trained, "attention=[own,alibi,poslsh]", "s=[2,4]", "max_tokens=2048", f"out={out}")
    assert r.exit_code == 0, r.output
    res = pd.read_csv(out / "results.csv")
    assert sorted(res.length.unique()) == [32, 64, 128, 256]
    assert set(res.attention) == {"own", "alibi", "poslsh"} and set(res[res.attention == "poslsh"].s) == {2, 4}
    own = res[(res.attention == "own")]
    # five deterministic schemes once per length; the Positional-LSH model over 3 mask draws (the default)
    assert len(own) == (5 + 3) * 4 and (own.bits_per_byte > 0).all()
    drawn = own[own.position == "poslsh"]
    assert sorted(drawn.trial.unique()) == [0, 1, 2] and drawn.groupby("length").seed.nunique().eq(3).all()
    assert (own[own.position != "poslsh"].seed == -1).all()
    # swapped in at the training length only (swapped_at=trained), and not where it is the model's own
    swapped = res[res.attention != "own"]
    assert set(swapped.length) == {32}
    assert not ((swapped.position == "alibi") & (swapped.attention == "alibi")).any()
    trained_s = int(res[res.position == "poslsh"].trained_s.iloc[0])
    assert not ((swapped.position == "poslsh") & (swapped.attention == "poslsh") & (swapped.s == trained_s)).any()
    # six models: alibi swapped into five (not the ALiBi model), poslsh s=2 and s=4 into six (one of them is
    # the Positional-LSH model's own s when it was trained with 2 or 4), three draws each
    per_s = {s: 6 - int(s == trained_s) for s in (2, 4)}
    assert len(swapped[swapped.attention == "alibi"]) == 5
    assert len(swapped[swapped.attention == "poslsh"]) == 3 * sum(per_s.values())
    # the swap skipped on the ALiBi model is the same computation as its own forward
    from poslsh_cli.core.config import build_spec
    from poslsh_cli.experiments.perplexity import command as ppl
    from poslsh_cli.lm.evaluate import evaluate

    spec = build_spec(ppl.PerplexitySpec, {"checkpoints": [str(trained)], "attention": ["own", "alibi"]})
    ctx = ppl.prepare(spec)
    (name,) = [n for n, ck in ctx.checkpoints.items() if ck.position == "alibi"]
    ck = ctx.checkpoints[name]
    assert ppl.same_as_own(ppl.Attention.ALIBI, 0, ck) and not ppl.same_as_own(ppl.Attention.POSLSH, 2, ck)
    model, own = ppl._model(ctx, ck)
    swap = ppl.scheme_for(spec, ppl.Attention.ALIBI, 0, own, 0)
    a, b = (evaluate(model, st, ck.tokens, 64, None, 2048, 4, key="perplexity", own=own, token_bytes=ck.token_bytes)
            for st in (own, swap))
    assert a.loss == b.loss and a.predicted == b.predicted and b.kl == 0.0
    assert poslsh("plot", out).exit_code == 0
    assert {"bpb_vs_length.png", "bpb_swapped.png", "bpb_vs_s.png"} <= {p.name for p in (out / "figures").iterdir()}
    r = poslsh("report", out)
    assert r.exit_code == 0 and "Language modelling" in (out / "report.md").read_text()


def test_whole_split_side_text_and_the_longest_trained_models(tmp_path):
    """max_tokens=null scores each model's whole validation split at its training length; side_tokens
    a smaller text for everything else (and the own attention at L again, so comparisons share a
    text); extrapolate=longest evaluates beyond L and with attention swapped only the models trained
    for the most steps of their run; rows carry the run, its steps and the last-20% fall."""
    words = " ".join(f"w{i % 97}" for i in range(6000))
    data = tmp_path / "text.txt"
    data.write_text(words)
    run = tmp_path / "train_x"
    r = poslsh("train", *TINY, "seq_len=32", "batch=4", "eval_tokens=256", "warmup=1", f"data={data}",
               "position=[alibi,poslsh]", "s=[3]", "steps=[2,4]", "eval_every=1", "checkpoint_every=100",
               f"out={run}")
    assert r.exit_code == 0, r.output
    out = tmp_path / "ppl"
    r = poslsh("perplexity", str(run), "lengths=[32,64]", "attention=[own,alibi]", "trials=1", "max_tokens=null",
               "side_tokens=256", "extrapolate=longest", "batch=8", f"out={out}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "results.csv")
    val = load_corpus(str(data)).val
    assert set(df.trained_run) == {"train_x"} and set(df.trained_steps) == {2, 4}
    main = df[df.text_tokens == len(val)]
    assert len(main) == 4 and set(main.length) == {32} and set(main.attention) == {"own"}  # every model, at L
    side = df[df.text_tokens == 256]
    short, long = side[side.trained_steps == 2], side[side.trained_steps == 4]
    assert set(short.length) == {32} and set(short.attention) == {"own"}  # T/2: only at L, own attention
    assert set(long.length) == {32, 64} and "alibi" in set(long.attention)
    assert df[df.trained_steps == 4].trained_fall.notna().all()  # two steps have no evaluation at 80% of them
    sec = registry.get("perplexity").report(out, df)
    assert any("1 of the" not in p and "tokens from the start" in p for p in sec.paragraphs)


def test_perplexity_bad_input(tmp_path):
    r = poslsh("perplexity", tmp_path / "nope", f"out={tmp_path / 'o'}")
    assert r.exit_code == 2 and r.stderr.strip().endswith("nope does not exist") and not (tmp_path / "o").exists()
    (tmp_path / "plain").mkdir()
    r = poslsh("perplexity", tmp_path / "plain", f"out={tmp_path / 'o'}")
    assert r.exit_code == 2 and "neither a checkpoint directory" in r.stderr
    r = poslsh("perplexity", f"out={tmp_path / 'o'}")
    assert r.exit_code == 2 and "give at least one train run" in r.stderr


def test_perplexity_on_a_checkpoint_with_a_broken_config_is_one_line(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{broken")
    (ck / "model.safetensors").write_bytes(b"\0" * 16)
    r = poslsh("perplexity", ck, f"out={tmp_path / 'p'}")
    assert one_line(r) and "config.json is not valid JSON" in r.stderr, r.output
    assert not (tmp_path / "p").exists()


def test_perplexity_of_a_foreign_rope_checkpoint_runs_its_own_attention_once_and_draws_only_swapped_masks(tmp_path):
    """A checkpoint this project did not train and without ALiBi (a tiny Llama) runs its own
    attention in one cell (no mask draws: s 0, seed -1); Positional LSH swapped in gets a cell per s
    and trial, each with its seed."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama", safe_serialization=True)
    r = poslsh("perplexity", tmp_path / "llama", "lengths=[64]", "attention=[own,poslsh]", "s=[2,4]", "trials=2",
               "device=cpu", "memory_check=false", "max_tokens=4096", f"out={tmp_path / 'p'}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "p" / "results.csv")
    own, swapped = df[df.attention == "own"], df[df.attention == "poslsh"]
    assert len(own) == 1 and own.s.iloc[0] == 0 and own.seed.iloc[0] == -1 and (df.position == "own").all()
    assert sorted(zip(swapped.s, swapped.trial)) == [(2, 0), (2, 1), (4, 0), (4, 1)]
    assert (swapped.seed >= 0).all() and swapped.seed.nunique() == 4
    assert np.isfinite(df.bits_per_byte).all()
