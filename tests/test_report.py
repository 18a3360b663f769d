"""poslsh report: every verdict computed from data. Synthetic result tables that must be
SUPPORTED, must be NOT SUPPORTED, and carry no data; real (small) runs end to end; reproduce
keeps its skipped list in the run directories."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from poslsh_cli.app import registry
from poslsh_cli.verdicts.claims import Status
from poslsh_cli.app.cli import app

runner = CliRunner()
RUN = Path("synthetic")


def verdicts(section):
    return {v.claim: v.status for v in section.verdicts}


def status_of(section, needle):
    hits = [v.status for v in section.verdicts if needle in v.claim]
    assert len(hits) == 1, (needle, [v.claim for v in section.verdicts])
    return hits[0]


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


# ---------------------------------------------------------------------------------------------
# output-error: decay, and the baselines


def output_table(poslsh_at_64, baselines=("no_bias", "fixed_block"), exponent=-0.5):
    rows = []
    for layer in (0, 1):
        for head in range(4):
            for s in (1, 8, 16, 32, 64):
                for t in range(2):
                    rows.append(dict(model="m", layer=layer, head=head, sigma=2.0, causal=False, n=64, s=s, trial=t,
                                     seed=t, method="poslsh", rel_fro=poslsh_at_64 * (s / 64) ** exponent * (1 + 0.01 * t),
                                     max_row_rel=1.0, seconds=0.1, window=-1))
            for b in baselines:
                rows.append(dict(model="m", layer=layer, head=head, sigma=2.0, causal=False, n=64, s=0, trial=0,
                                 seed=-1, method=b, rel_fro=0.2, max_row_rel=1.0, seconds=0.1, window=-1))
    return pd.DataFrame(rows)


def test_baseline_verdicts_need_their_baseline():
    sec = registry.get('output-error').report(RUN, output_table(0.05))
    assert status_of(sec, "no_bias baseline") is Status.SUPPORTED and status_of(sec, "fixed_block baseline") is Status.SUPPORTED
    assert status_of(sec, "falls like") is Status.SUPPORTED
    sec = registry.get('output-error').report(RUN, output_table(0.5))
    assert status_of(sec, "no_bias baseline") is Status.NOT_SUPPORTED
    sec = registry.get('output-error').report(RUN, output_table(0.05, baselines=()))  # baselines=[]
    assert status_of(sec, "no_bias baseline") is Status.NOT_MEASURED and status_of(sec, "fixed_block baseline") is Status.NOT_MEASURED
    sec = registry.get('output-error').report(RUN, output_table(0.05, baselines=("no_bias",)))
    assert status_of(sec, "no_bias baseline") is Status.SUPPORTED and status_of(sec, "fixed_block baseline") is Status.NOT_MEASURED


def test_windowed_sentence_follows_the_numbers():
    df = output_table(0.05)
    win = df[df.method == "no_bias"].assign(method="windowed", window=8)
    sec = registry.get('output-error').report(RUN, pd.concat([df, win.assign(rel_fro=0.01)]))
    assert any("is more accurate than Positional LSH" in p for p in sec.paragraphs)
    sec = registry.get('output-error').report(RUN, pd.concat([df, win.assign(rel_fro=0.5)]))
    assert any("is less accurate than Positional LSH" in p for p in sec.paragraphs)


# ---------------------------------------------------------------------------------------------
# bench: near-linear time


def bench_table(power, base=0.0, causal=(False,)):
    rows = []
    for c in causal:
        for n in (1024, 2048, 4096, 8192, 16384, 32768):
            rows.append(dict(method="exact", n=n, s=0, causal=c, seconds=1e-9 * n**2, rel_fro=np.nan, window_sigmas=np.nan,
                             device="cpu", backend="chunked-sdpa", heads=8, head_dim=64, dtype="float32",
                             sample_seconds=0.0))
            for s in (2, 8):
                t = base + 1e-6 * s * n**power
                rows.append(dict(method="poslsh", n=n, s=s, causal=c, seconds=t, rel_fro=0.3 / np.sqrt(s),
                                 window_sigmas=np.nan, device="cpu", backend="block-flash-cpu", heads=8, head_dim=64,
                                 dtype="float32", sample_seconds=0.1 * t))
            rows.append(dict(method="windowed", n=n, s=0, causal=c, seconds=2e-6 * n, rel_fro=0.05, window_sigmas=2.0,
                             device="cpu", backend="chunked-sdpa", heads=8, head_dim=64, dtype="float32", sample_seconds=0.0))
    return pd.DataFrame(rows)


def test_time_verdict_supported_not_supported_and_overhead_dominated():
    assert status_of(registry.get('bench').report(RUN, bench_table(1.0)), "near-linearly") is Status.SUPPORTED
    assert status_of(registry.get('bench').report(RUN, bench_table(2.0)), "near-linearly") is Status.NOT_SUPPORTED
    # a fixed cost of 10 s swamps the growth: a slope near 0 is not evidence of linear time
    flat = registry.get('bench').report(RUN, bench_table(1.0, base=10.0))
    assert status_of(flat, "near-linearly") is Status.INCONCLUSIVE


def test_bench_report_groups_by_causal():
    sec = registry.get('bench').report(RUN, bench_table(1.0, causal=(False, True)))
    assert status_of(sec, "near-linearly") is Status.SUPPORTED
    assert any(p.startswith("causal:") for p in sec.paragraphs) and any(p.startswith("bidirectional:") for p in sec.paragraphs)
    assert any("of the end-to-end" in p for p in sec.paragraphs)
    assert any("matched by a windowed exact ALiBi point" in p for p in sec.paragraphs)


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
# end to end


def test_report_from_runs(tmp_path):
    runs = tmp_path / "runs"
    for args in (["matrix-error", "n=[512]", "sigma=4", "s=[2,8,16,32]", "trials=3", f"out={runs / 'm'}"],
                 ["matrix-error", "n=[128]", "sigma=4", "s=[1,8]", "trials=1", "method=both", f"out={runs / 'd'}"],
                 ["block-stats", "n=[1024,8192]", "sigma=4", "s=8", "trials=10", f"out={runs / 'b'}"],
                 ["output-error", "n=64", "layers=[0]", "s=[1,16]", "trials=1", "baselines=[]", f"out={runs / 'o'}"],
                 ["bench", "n=[256,512]", "heads=2", "head_dim=8", "s=[2]", "window_sigmas=[2]", "repeats=1",
                  "warmup=0", "causal=[false,true]", f"out={runs / 'x'}"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, (args, r.output)
    r = runner.invoke(app, ["report", str(runs)])
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
    r = runner.invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "no poslsh run" in r.stderr


@pytest.mark.slow
def test_reproduce_quick_subset_resumes_and_keeps_skipped_in_the_runs(tmp_path):
    """The driver on a shortened experiment list: skips what it must (and says so in the run
    directory), resumes, and a later `poslsh report` on the same root still lists the skip."""
    code = (
        "import sys; import poslsh_cli.app.reproduce as r;"
        "r.plan = lambda scale: [('block_stats','block-stats','block_stats_quick'),"
        "('output_error_qwen3_0_6b','output-error','output_error_qwen3_0_6b_quick')];"
        f"sys.exit(r.main('quick', {str(tmp_path)!r}))"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "POSLSH_MODELS"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "skipped output_error_qwen3_0_6b: POSLSH_MODELS is not set" in res.stdout
    root = tmp_path / "quick"
    marker = json.loads((root / "output_error_qwen3_0_6b" / "skipped.json").read_text())
    assert marker["reason"].startswith("POSLSH_MODELS is not set")
    assert "skipped output_error_qwen3_0_6b" in (root / "report.html").read_text()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "resuming" in res.stderr and "60/60 cells already done" in res.stderr
    # a report written later over the same root (the README's command) keeps the skip and the sessions
    r = runner.invoke(app, ["report", str(root)])
    assert r.exit_code == 0, r.output
    md = (root / "report.md").read_text()
    assert "skipped output_error_qwen3_0_6b: POSLSH_MODELS is not set" in md
    assert md.count("reproduce --scale quick: session started") == 2
    # the budget: each experiment's wall time over both sessions, from its meta.json
    wall = json.loads((root / "block_stats" / "meta.json").read_text())["wall_seconds"]
    assert wall > 0 and f"wall time per experiment (meta.json, all sessions): block_stats {wall:.0f} s" in md
    assert f"total {wall:.0f} s" in md


def test_reproduce_runs_presets_side_by_side_each_with_its_log_and_core_share(tmp_path):
    """--jobs 2 with the local launcher: two presets at once, each child with half the cores and
    its output in logs/<preset>.log; a preset that fails is named with the end of its log, the
    others finish and the report is written."""
    import os

    code = (
        "import sys; import poslsh_cli.app.reproduce as r;"
        "r.plan = lambda scale: [('output_error_official_minilm','output-error','output_error_official_minilm_quick'),"
        "('broken','block-stats','no_such_preset_quick')];"
        "r.skip_reason = lambda *a, **k: None;"
        f"sys.exit(r.main('quick', {str(tmp_path)!r}, jobs=2))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    root = tmp_path / "quick"
    assert "== finished output_error_official_minilm" in res.stdout
    assert re.search(r"== FAILED broken \(exit 2\); the end of \S+broken\.log:", res.stdout)
    assert "no_such_preset_quick" in res.stdout.split("== FAILED broken", 1)[1]  # the log's error line, shown
    assert "[22/22] layer=" in (root / "logs" / "output_error_official_minilm.log").read_text()
    meta = json.loads((root / "output_error_official_minilm" / "meta.json").read_text())
    assert meta["status"] == "complete"
    assert meta["device"]["torch_threads"] == max(1, (os.cpu_count() or 1) // 2)
    assert (root / "report.md").exists()
    r = runner.invoke(app, ["reproduce", "--scale", "quick", "--runs", str(tmp_path), "--jobs", "0"])
    assert r.exit_code == 2 and "--jobs must be at least 1" in r.stderr


# ---------------------------------------------------------------------------------------------
# perplexity: the downstream claims


def ppl_run(tmp_path, scratch=None, tuned=None, seeds=(0, 1, 2), seed_sd=0.002, window_sd=0.01, W=64, draws=3,
            degrade=None, name="run", far=1024):
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
            ck = f"{pos}{s}-{drop}-{seed}-{finetuned}"
            for length in lengths:
                base = value + shift + (degrade.get(scheme, 0.0) if length > 256 else 0.0)
                for trial in range(draws if pos == "poslsh" else 1):
                    bpb_w = base + g.normal(0, seed_sd / 4 if pos == "poslsh" else 0) + g.normal(0, window_sd, W)
                    bpb = float(bpb_w.mean())
                    rows.append(dict(checkpoint=ck, position=pos, attention="own", s=s, length=length, trial=trial,
                                     seed=-1, tokens=W * 255, loss=bpb * np.log(2), bits_per_byte=bpb, ppl=1.0,
                                     seconds=0.1, trained_len=256, trained_s=s, finetuned=finetuned, run_seed=seed,
                                     bits_per_token=bpb, kl=0.0, bytes=W * 256, attn_dropout=drop))
                    wins.extend(dict(checkpoint=ck, attention="own", s=s, length=length, trial=trial, window=i,
                                     bits=float(b) * 256, bytes=256) for i, b in enumerate(bpb_w))

    for scheme, value in (scratch or {}).items():
        add(scheme, value, "no", (256, far))
    for scheme, value in (tuned or {}).items():
        add(scheme, value, "yes", (256,))
    run = tmp_path / name
    run.mkdir(parents=True)
    pd.DataFrame(wins).to_csv(run / "windows.csv", index=False)
    return run, pd.DataFrame(rows)


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


@pytest.mark.parametrize("lo,hi,expected", [
    (-0.015, 0.015, Status.SUPPORTED), (-0.03, 0.005, Status.SUPPORTED),   # a better scheme reaches it too
    (-0.08, -0.03, Status.SUPPORTED), (-0.01, 0.0199, Status.SUPPORTED),
    (-0.01, 0.02, Status.INCONCLUSIVE), (0.0, 0.05, Status.INCONCLUSIVE),  # the upper end at or past the margin
    (0.02, 0.05, Status.NOT_SUPPORTED), (0.03, 0.04, Status.NOT_SUPPORTED),
    (-0.1, 0.1, Status.INCONCLUSIVE),
])
def test_reaches_is_non_inferiority_at_its_edges(lo, hi, expected):
    from poslsh_cli.verdicts.stats import Interval, equivalence

    assert equivalence(Interval((lo + hi) / 2, lo, hi, 3, 0.9, "seeds"))[0] is expected


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
    from poslsh_cli.experiments.perplexity_claims import Data, Scheme, claim_finetune_approaches_alibi
    from poslsh_cli.verdicts.stats import t_interval

    gaps = {1: 0.3, 2: 0.2, 5: 0.1, 10: 0.05, 20: 0.01}
    ft = {A: 2.0, **{("poslsh", s, 0.0): 2.0 + g for s, g in gaps.items()}}
    run, df = ppl_run(tmp_path, tuned=ft, seed_sd=0.05, window_sd=0.001, draws=1)
    d = Data(df[df.attention == "own"], pd.read_csv(run / "windows.csv"), 256)
    v = claim_finetune_approaches_alibi(d)[0]
    assert "one slope per seed" in v.evidence and "seed 2:" in v.evidence, v.evidence
    a = d.per_seed(Scheme("alibi"), 256)
    slopes = []
    for seed in (0, 1, 2):
        x = [np.log(s) for s in gaps]
        y = [d.per_seed(Scheme("poslsh", s), 256)[seed] - a[seed] for s in gaps]
        slopes.append(np.polyfit(x, y, 1)[0])
    iv = t_interval(slopes)
    assert f"{iv.estimate:+.4f} [{iv.low:+.4f}, {iv.high:+.4f}] (95%, 3 seeds)" in v.evidence, v.evidence
    assert v.status is (Status.SUPPORTED if iv.high < 0 else Status.INCONCLUSIVE)
    one = claim_finetune_approaches_alibi(Data(d.rows[d.rows.run_seed == 0], d.windows, 256))[0]
    assert "evaluation noise only" in one.evidence and "1 seed:" in one.evidence, one.evidence


def test_extrapolation_with_two_seeds_uses_evaluation_noise(tmp_path):
    """Two seeds give a t-interval with one degree of freedom; like every other rule, the robustness
    claim needs three and otherwise says it rests on evaluation noise."""
    base = {A: 1.8, P10: 1.8, ROPE: 1.8, NONE: 2.8}
    sec = ppl_report(tmp_path, scratch=base, degrade={P10: -0.02, ROPE: 0.4, NONE: 0.2}, seeds=(0, 1))
    v = [v for v in sec.verdicts if "robust at 4x" in v.claim][0]
    assert "evaluation noise only" in v.evidence and "2 training seeds: evaluation noise only" in v.evidence, v.evidence
    assert v.status is Status.SUPPORTED  # -0.02 with windows of sd 0.01: the interval ends below 0.05


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
    sec = ppl_report(tmp_path / "d", scratch={A: 1.8, P10: 1.8}, degrade={P10: 0.0})
    assert status_of(sec, "robust at 4x") is Status.NOT_MEASURED  # nothing to contrast it with


# ---------------------------------------------------------------------------------------------
# step-bench: long-context training goals


def step_table(poslsh_ratio, mem_ratio, lengths=(2048, 8192, 16384)):
    rows = []
    for L in lengths:
        a = 1e-9 * L * L
        for position, s, t, m in (("rope", 0, a, 100.0), ("alibi", 0, a, 100.0),
                                  ("poslsh", 10, a * poslsh_ratio[L], 100.0 * mem_ratio)):
            rows.append({"seq_len": L, "position": position, "s": s, "backend": "auto", "attention_path": "x",
                         "batch": 1, "step_seconds": t, "tokens_per_s": L / t, "peak_mem_mb": m, "params": 1,
                         "device": "cpu", "steps": 3})
    return pd.DataFrame(rows)


def test_long_context_goals_and_crossover():
    from poslsh_cli.experiments import step_bench

    good = step_bench.report(RUN, step_table({2048: 1.3, 8192: 0.8, 16384: 0.4}, 1.2))
    assert status_of(good, "at long context") is Status.SUPPORTED
    assert status_of(good, "peak memory") is Status.SUPPORTED
    assert any("faster than exact ALiBi from L=8192 on" in p for p in good.paragraphs)
    slow = step_bench.report(RUN, step_table({2048: 1.3, 8192: 1.1, 16384: 0.4}, 1.6))
    assert status_of(slow, "at long context") is Status.NOT_SUPPORTED
    assert status_of(slow, "peak memory") is Status.NOT_SUPPORTED
    assert any("from L=16384 on" in p for p in slow.paragraphs)
    short = step_bench.report(RUN, step_table({1024: 0.9, 2048: 0.9}, 1.0, lengths=(1024, 2048)))
    assert status_of(short, "at long context") is Status.NOT_MEASURED


def test_the_paper_setting_claim_reads_the_rows_at_its_setting_only():
    """L=8192, one sigma = 256 for every head, s=100: SUPPORTED when the step time and the memory are
    both within 1.5x exact ALiBi's, NOT SUPPORTED when one is not, NOT MEASURED at another setting or
    in a table without the sigmas column."""
    from poslsh_cli.experiments import step_bench

    def table(t_ratio, m_ratio, sigmas="sigma=256 every head", s=100):
        rows = [{"seq_len": 8192, "position": p, "s": k, "backend": "auto", "attention_path": "x", "batch": 2,
                 "step_seconds": t, "tokens_per_s": 1.0, "peak_mem_mb": m, "params": 1, "device": "cuda", "steps": 3,
                 "sigmas": sigmas} for p, k, t, m in (("alibi", 0, 0.04, 2600.0),
                                                      ("poslsh", s, 0.04 * t_ratio, 2600.0 * m_ratio))]
        return pd.DataFrame(rows)

    claim = "at the paper's setting"
    assert status_of(step_bench.report(RUN, table(1.4, 1.1)), claim) is Status.SUPPORTED
    assert status_of(step_bench.report(RUN, table(1.7, 1.1)), claim) is Status.NOT_SUPPORTED
    assert status_of(step_bench.report(RUN, table(1.1, 1.6)), claim) is Status.NOT_SUPPORTED
    assert status_of(step_bench.report(RUN, table(1.1, 1.1, sigmas="standard")), claim) is Status.NOT_MEASURED
    assert status_of(step_bench.report(RUN, table(1.1, 1.1, s=10)), claim) is Status.NOT_MEASURED
    assert status_of(step_bench.report(RUN, table(1.1, 1.1).drop(columns="sigmas")), claim) is Status.NOT_MEASURED


def test_swapped_table_pairs_each_seed_with_its_own_attention(tmp_path):
    """Swapped rows at the training length: the mean over seeds of each seed's mean over draws, and the
    seed-paired difference from the same models' own attention, recomputed here from the rows."""
    from poslsh_cli.experiments.perplexity_report import swapped_table
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


# ---------------------------------------------------------------------------------------------
# a model is keyed by all that defines it


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
    from poslsh_cli.experiments import perplexity_report, train_report

    run, df = ppl_run(tmp_path / "p", scratch={A: 1.8, AD: 1.9})
    df = pd.concat([df, df[(df.position == "alibi") & (df.attn_dropout == 0)].assign(
        sigmas="sigma=256 every head", bits_per_byte=lambda x: x.bits_per_byte + 0.5,
        checkpoint=lambda x: x.checkpoint + "-256")])
    df["sigmas"] = df.sigmas.fillna("")
    head, rows = perplexity_report.summary(df)
    by = {r[0]: r for r in rows}
    assert set(by) == {"alibi", "alibi +dropout 0.1", "alibi (sigma=256 every head)"}, rows
    col = head.index("L=256")
    for label, sel in (("alibi", (df.attn_dropout == 0) & (df.sigmas == "")), ("alibi +dropout 0.1", df.attn_dropout > 0)):
        assert by[label][col] == f"{df[sel & (df.length == 256)].bits_per_byte.mean():.4f}"
        assert by[label][head.index("seeds")] == "3"
    figs = captured_figures(monkeypatch)
    perplexity_report.plot(run, df)
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


def _train_run(tmp_path, gap_of_step, seeds=(0, 1, 2), noise=0.002):
    """A train run on disk with only what the gap claim reads: results rows and each cell's metrics."""
    g = np.random.default_rng(0)
    rows = []
    for seed in seeds:
        for pos, s in (("alibi", 0), ("poslsh", 10)):
            cell = tmp_path / "work" / f"{pos}-{seed}"
            (cell / "final").mkdir(parents=True)
            steps = np.arange(100, 1100, 100)
            base = 3.0 - 0.5 * np.log(steps / 100)
            bpb = base + (gap_of_step(steps) + noise * g.standard_normal(len(steps)) if pos == "poslsh" else 0)
            pd.DataFrame({"step": steps, "tokens": steps * 4096, "loss": bpb, "val_loss": bpb, "val_bpb": bpb}
                         ).to_csv(cell / "metrics.csv", index=False)
            rows.append(dict(position=pos, s=s, seed=seed, seq_len=256, steps=1000, tokens=4096000, params=1,
                             train_loss=1.0, val_loss=1.0, val_bpb=float(bpb[-1]), val_ppl=2.7, seconds=1.0,
                             tokens_per_s=1.0, pretrain="", init="", checkpoint=f"work/{pos}-{seed}/final",
                             step_seconds=0.1, attn_dropout=0.0, passes=1.0, sigmas="standard"))
    return pd.DataFrame(rows)


def test_gap_to_alibi_against_tokens_shrinks_grows_or_says_it_cannot_tell(tmp_path):
    from poslsh_cli.experiments import train_report as tr

    shrinking = _train_run(tmp_path / "a", lambda st: 0.3 / np.sqrt(st / 100))
    sec = registry.get("train").report(tmp_path / "a", shrinking)
    v = [v for v in sec.verdicts if "shrinks" in v.claim]
    assert len(v) == 1 and v[0].status is Status.SUPPORTED and "3 seeds, one slope each" in v[0].evidence
    assert "poslsh s=10" in v[0].claim and "first evaluation +0.2996" in v[0].evidence
    growing = _train_run(tmp_path / "b", lambda st: 0.01 * np.log(st))
    assert status_of(registry.get("train").report(tmp_path / "b", growing), "shrinks") is Status.NOT_SUPPORTED
    flat = _train_run(tmp_path / "c", lambda st: 0.1 + 0 * st, noise=0.05)
    assert status_of(registry.get("train").report(tmp_path / "c", flat), "shrinks") is Status.INCONCLUSIVE
    paths = tr.plot_gap(tmp_path / "a", shrinking)
    assert [p.name for p in paths if p.suffix == ".png"] == ["gap_vs_tokens.png"]


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
    table = side_by_side([(sec_a, df_a), (sec_b, df_b)]).tables[0]
    assert list(table.columns) == ["claim", "perplexity", "perplexity_official"]
    # both runs scored one protocol: the extrapolation claims carry its tag, so they line up with a run scoring both
    row = table[table.claim == "Positional LSH stays robust at kx the training length [nonoverlapping]"].iloc[0]
    assert row.perplexity.startswith("SUPPORTED") and row.perplexity_official.startswith("NOT SUPPORTED")
    row = table[table.claim.str.contains("better than the original RoPE")].iloc[0]
    assert row.perplexity.startswith("SUPPORTED") and row.perplexity_official.startswith("NOT SUPPORTED")
