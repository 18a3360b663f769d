"""poslsh report: every verdict computed from data. Synthetic result tables that must be
SUPPORTED, must be NOT SUPPORTED, and carry no data; real (small) runs end to end; reproduce
keeps its skipped list in the run directories."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from poslsh_cli import registry
from poslsh_cli.claims import Status
from poslsh_cli.cli import app

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
    # flat and noisy: the interval holds -0.5 but also 0, so it says nothing
    sec = registry.get('matrix-error').report(RUN, matrix_table(0.0, 1.5, s=(8, 16, 32)))
    assert status_of(sec, "spectral error decays") is Status.INCONCLUSIVE
    sec = registry.get('matrix-error').report(RUN, matrix_table(-0.5, 0.03, s=(1, 2, 4)))
    assert status_of(sec, "spectral error decays") is Status.NOT_MEASURED


def test_unconverged_rows_are_flagged_and_left_out_of_fits():
    good = matrix_table(-0.5, 0.03)
    bad = matrix_table(3.0, 0.0, converged=False)
    sec = registry.get('matrix-error').report(RUN, pd.concat([good, bad]))
    assert status_of(sec, "spectral error decays") is Status.SUPPORTED
    assert any("did not meet the Lanczos tolerance" in p and str(len(bad)) in p for p in sec.paragraphs)


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
    from poslsh_cli.sampling import block_max_quantile, width_max_quantile

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
        "import sys; import poslsh_cli.reproduce as r;"
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


# ---------------------------------------------------------------------------------------------
# perplexity: the downstream claims


def ppl_table(poslsh_gap=-0.02, none_gap=1.0, rope_degrades=0.3, finetune_gaps=(0.2, 0.1, 0.05, 0.02),
              fixed_block=0.4, seeds=(0, 1)):
    """Bits per byte: alibi 1.8; poslsh = alibi + poslsh_gap; none = alibi + none_gap; rope degrades
    by rope_degrades at 4L; fine-tuned: alibi 2.0, poslsh s = 1, 2, 5, 20 with the given gaps."""
    rows = []

    def add(position, s, seed, bpb, length=256, finetuned="no", attention="own"):
        rows.append(dict(checkpoint=f"{position}{s}-{seed}-{finetuned}", position=position, attention=attention,
                         s=s, length=length, trial=0, seed=-1, tokens=1000, loss=bpb * np.log(2), bits_per_byte=bpb,
                         ppl=1.0, seconds=0.1, trained_len=256, trained_s=s, finetuned=finetuned, run_seed=seed,
                         bits_per_token=bpb, kl=0.0))

    for seed in seeds:
        jitter = 0.002 * seed
        for L, extra in ((256, 0.0), (1024, 0.0)):
            add("alibi", 0, seed, 1.8 + jitter + extra, L)
            add("poslsh", 10, seed, 1.8 + poslsh_gap + jitter, L)
            add("none", 0, seed, 1.8 + none_gap + jitter + (0.05 if L > 256 else 0), L)
    add("rope", 0, 0, 1.83, 256)
    add("rope", 0, 0, 1.83 + rope_degrades, 1024)
    for s, g in zip((1, 2, 5, 20), finetune_gaps):
        add("poslsh", s, 0, 2.0 + g, finetuned="yes")
    add("alibi", 0, 0, 2.0, finetuned="yes")
    add("fixed_block", 0, 0, 2.0 + fixed_block, finetuned="yes")
    return pd.DataFrame(rows)


def test_perplexity_verdicts_pass_fail_and_no_data():
    sec = registry.get("perplexity").report(RUN, ppl_table())
    assert status_of(sec, "s=10 reaches") is Status.SUPPORTED  # better than alibi counts
    assert status_of(sec, "without positional bias") is Status.SUPPORTED
    assert status_of(sec, "approaches exact ALiBi") is Status.SUPPORTED
    assert status_of(sec, "better than fixed blocks") is Status.SUPPORTED
    assert status_of(sec, "robust at 4x") is Status.SUPPORTED
    assert status_of(sec, "degrade more") is Status.SUPPORTED

    sec = registry.get("perplexity").report(RUN, ppl_table(poslsh_gap=0.3, none_gap=0.2,
                                                           finetune_gaps=(0.02, 0.05, 0.1, 0.2), fixed_block=0.05,
                                                           rope_degrades=-0.1))
    assert status_of(sec, "s=10 reaches") is Status.NOT_SUPPORTED
    assert status_of(sec, "without positional bias") is Status.NOT_SUPPORTED
    assert status_of(sec, "approaches exact ALiBi") is Status.NOT_SUPPORTED
    assert status_of(sec, "better than fixed blocks") is Status.NOT_SUPPORTED
    assert status_of(sec, "degrade more") is Status.NOT_SUPPORTED

    one_seed = registry.get("perplexity").report(RUN, ppl_table(seeds=(0,)))
    assert status_of(one_seed, "s=10 reaches") is Status.INCONCLUSIVE
    no_tuning = ppl_table()
    no_tuning = no_tuning[no_tuning.finetuned == "no"]
    no_none = no_tuning[no_tuning.position != "none"]
    sec = registry.get("perplexity").report(RUN, no_none)
    assert status_of(sec, "approaches exact ALiBi") is Status.NOT_MEASURED
    assert status_of(sec, "without positional bias") is Status.NOT_MEASURED
    assert status_of(sec, "better than fixed blocks") is Status.NOT_MEASURED


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
