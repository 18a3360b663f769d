"""poslsh bench: the contract of its rows, its accuracy column and its plots (no timing asserts)."""
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd

from conftest import RUN, poslsh, status_of
from poslsh_cli.app import registry
from poslsh_cli.experiments.bench.references import band_pairs as _band_pairs
from poslsh_cli.experiments.bench.report import crossover
from poslsh_cli.verdicts.claims import Status


def test_bench_rows_and_plots(tmp_path):
    r = poslsh("bench", "n=[128,512]", "heads=4", "head_dim=16", "s=[1,4]", "window_sigmas=[1,64]",
               "causal=[false,true]", "repeats=1", "warmup=0", f"out={tmp_path}")
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
    r = poslsh("plot", str(tmp_path))
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
        r = poslsh("bench", "n=[64]", *args, f"out={tmp_path / 'x'}")
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


def test_measure_times_the_reference_interleaved(monkeypatch):
    """A compared path and its reference alternate, A B A B ..., after their warm-ups (the
    reference has no memory pass); the reference's median comes back beside the path's, with the
    load of the machine during the timed calls."""
    import torch

    from poslsh_cli.experiments import measure as m

    monkeypatch.setattr(m, "WARM_AFTER_S", float("inf"))
    calls = []
    x = torch.ones(4)
    t = m.measure(lambda: calls.append("A"), lambda _: x * 2, torch.device("cpu"), repeats=3, warmup=1,
                  backward=False, inputs=(x,), reference=(lambda: calls.append("B"), lambda _: x * 3))
    assert calls == ["A", "A", "B"] + ["A", "B"] * 3
    assert torch.equal(t.out, x * 2) and t.reference_seconds > 0 and t.load.threads == torch.get_num_threads()
    assert math.isnan(m.measure(lambda: None, lambda _: x, torch.device("cpu"), 1, 0, False, (x,)).reference_seconds)


def test_a_shared_reference_is_called_only_while_it_falls_behind_the_rows():
    """Exact ALiBi beside a group of rows: its own cell's calls first, then one more call after a row
    only while its timed seconds fall behind the rows' (never its full repeats again per row); each
    row gets the median of every reference call so far."""
    from poslsh_cli.experiments.measure import SharedReference

    calls = []

    def call():
        calls.append(1)
        return 0.0, 40.0, None  # an exact call of 40 s

    ref = SharedReference(call)
    ref.add([40.0, 41.0, 39.0], spent=160.0)  # its own cell: memory pass + 3 repeats
    medians = [ref.after_row(spent) for spent in [20.0] * 9]  # nine rows of 20 s each (180 s)
    assert len(calls) == 1  # one more call once the rows' 180 s passed the reference's 160 s
    assert medians[:-1] == [40.0] * 8 and ref.ref_spent >= ref.rows_spent
    assert ref.ref_spent <= ref.rows_spent + 40.0  # at most one call beyond the rows' time
    cold = SharedReference(call)  # a resumed run whose exact cell ran in an earlier session
    calls.clear()
    assert cold.after_row(5.0) == 40.0 and len(calls) == 2  # a warm-up call, then one timed


# ---------------------------------------------------------------------------------------------
# measuring on a loaded machine: the load in every row, the compared paths timed interleaved, and
# a claim whose rows were measured while other processes held the cores INCONCLUSIVE


def fake_proc(root, running, own_states):
    """A /proc with a loadavg of ``running`` runnable threads system-wide and this process's
    threads in the given states (a thread's name may hold spaces and parentheses)."""
    (root / "self" / "task").mkdir(parents=True)
    (root / "loadavg").write_text(f"2.50 1.00 0.50 {running}/300 4242\n")
    for i, st in enumerate(own_states):
        (root / "self" / "task" / str(100 + i)).mkdir()
        (root / "self" / "task" / str(100 + i) / "stat").write_text(f"{100 + i} (py (thr) {i}) {st} 1 2 3 4\n")


def test_the_probe_calls_a_row_overloaded_when_others_take_cores_the_threads_need(tmp_path, monkeypatch):
    """load_others = runnable threads system-wide less this process's own (state R); a row is
    overloaded when load_others + threads > cores (the others took cores the benchmark needed; with a
    slack of a quarter core for a daemon waking now and then); on
    CUDA the timed path needs one CPU thread (the one that launches the kernels)."""
    import torch

    from poslsh_cli.experiments import measure as m

    def probe(running, own, threads, cores=2.0, device="cpu"):
        root = tmp_path / f"proc{running}-{''.join(own)}-{threads}-{cores}-{device}"
        fake_proc(root, running, own)
        monkeypatch.setattr(m, "PROC", root)
        monkeypatch.setattr(m, "usable_cores", lambda: cores)
        monkeypatch.setattr(m, "torch_threads", lambda: threads)
        with m.LoadProbe(torch.device(device), every=0.01) as p:
            pass
        return p.load

    alone = probe(2, ["R", "R", "S"], threads=2)
    assert alone.load_others == 0 and alone.threads == 2 and alone.cores == 2 and alone.loadavg == 2.5
    assert not alone.overloaded
    loaded = probe(3, ["R", "R", "S"], threads=2)  # one other runnable thread: 1 + 2 > 2
    assert loaded.load_others == 1 and loaded.overloaded
    assert not probe(2, ["R", "S"], threads=1).overloaded  # one other thread, one core left free: 1 + 1 <= 2
    assert not probe(5, ["R", "S"], threads=2, cores=8).overloaded
    assert not probe(2, ["R", "S"], threads=2, device="cuda").overloaded  # one launching thread + 1 <= 2
    assert probe(4, ["R", "S"], threads=2, device="cuda").overloaded  # 1 + 3 others > 2
    row = loaded.columns()
    assert set(row) == set(m.LOAD_COLUMNS) and row["overloaded"] is True
    # no /proc (another OS): NaN, and never overloaded
    monkeypatch.setattr(m, "PROC", tmp_path / "nowhere")
    with m.LoadProbe(torch.device("cpu"), every=0.01) as p:
        pass
    assert math.isnan(p.load.load_others) and math.isnan(p.load.loadavg) and not p.load.overloaded


def test_usable_cores_follow_the_affinity_and_a_cgroup_quota(tmp_path, monkeypatch):
    from poslsh_cli.experiments import machine

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setattr(machine, "CGROUP", tmp_path)
    assert machine.usable_cores() == affinity  # no quota files
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert machine.usable_cores() == affinity  # cgroup v1, no limit
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    assert machine.usable_cores() == 0.5  # cgroup v1: half a core
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert machine.usable_cores() == affinity  # cgroup v2 (read first): no limit
    (tmp_path / "cpu.max").write_text("25000 100000\n")
    assert machine.usable_cores() == 0.25


def gpu_rows(exact=10.0, poslsh=1.0, paired=None, overloaded=False):
    """CUDA rows at the goal length, causal, forward: exact ALiBi and Positional LSH s=8."""
    from poslsh_cli.experiments.bench.claims import GPU_GOAL_N, GPU_GOAL_S

    base = dict(n=GPU_GOAL_N, causal=True, backward=False, device="cuda:0", heads=8, head_dim=64, dtype="float16",
                planned=True, peak_mem_mb=100.0, rel_fro=math.nan, window_sigmas=math.nan, threads=2, cores=2.0,
                load_others=1.5 if overloaded else 0.0, loadavg=3.0, overloaded=False)
    rows = [dict(base, method="exact", s=0, seconds=exact, backend="flex", sample_seconds=0.0,
                 exact_seconds=math.nan),
            dict(base, method="poslsh", s=GPU_GOAL_S, seconds=poslsh, backend="union", sample_seconds=0.01 * poslsh,
                 rel_fro=0.1, exact_seconds=math.nan if paired is None else paired, overloaded=overloaded)]
    return pd.DataFrame(rows)


def forward_goal(df):
    from poslsh_cli.experiments.bench.report import claims_gpu

    [v] = [v for v in claims_gpu(df) if "faster than exact ALiBi" in v.claim and "(forward," in v.claim]
    return v


def test_bench_speedups_use_the_exact_time_paired_with_each_row():
    """A row's exact_seconds (exact ALiBi timed interleaved with it) drives its speed-up, the
    crossover and the CUDA goals; runs written before the column use the exact row's time."""
    from poslsh_cli.experiments.bench.report import summary
    from poslsh_cli.verdicts.claims import Status

    assert forward_goal(gpu_rows(exact=10.0, poslsh=1.0)).status is Status.SUPPORTED  # no paired time: 10x
    v = forward_goal(gpu_rows(exact=10.0, poslsh=1.0, paired=5.0))
    assert v.status is Status.NOT_SUPPORTED and "5.00x" in v.evidence  # paired: 5x < 8x
    old = pd.DataFrame({"method": ["exact"] * 4 + ["poslsh"] * 4, "n": [1, 2, 4, 8] * 2,
                        "seconds": [1, 2, 4, 8, 0.5, 1, 3, 4]})
    assert crossover(old, "poslsh") == 1
    paired = old.assign(exact_seconds=[math.nan] * 4 + [1, 0.5, 4, 8])  # at n=2 exact was faster beside it
    assert crossover(paired, "poslsh") == 4
    _, rows = summary(gpu_rows(exact=10.0, poslsh=1.0, paired=5.0))
    assert rows[0][6] == "5.00x"


def test_a_speed_claim_measured_on_an_overloaded_machine_is_inconclusive():
    from poslsh_cli.app import registry
    from poslsh_cli.verdicts.claims import Status

    v = forward_goal(gpu_rows(exact=10.0, poslsh=1.0, overloaded=True))  # SUPPORTED when measured alone
    assert v.status is Status.INCONCLUSIVE
    assert "other processes held 1.5 of the 2 cores" in v.evidence and "rerun alone" in v.evidence
    assert "OMP_NUM_THREADS" in v.evidence
    rows = []
    for n in (1024, 2048, 4096, 8192, 16384, 32768):
        rows.append(dict(method="exact", n=n, s=0, seconds=1e-9 * n**2, rel_fro=math.nan, overloaded=False))
        rows.append(dict(method="poslsh", n=n, s=8, seconds=1e-6 * 8 * n, rel_fro=0.1, overloaded=n == 32768,
                         exact_seconds=1e-9 * n**2))
    df = pd.DataFrame(rows).assign(causal=False, device="cpu", backend="blocks", heads=8, head_dim=64,
                                   dtype="float32", sample_seconds=0.0, window_sigmas=math.nan, threads=2, cores=2.0,
                                   load_others=1.0, loadavg=3.0)
    sec = registry.get("bench").report(Path("synthetic"), df.assign(overloaded=False))
    [lin] = [v for v in sec.verdicts if "near-linearly" in v.claim]
    assert lin.status is Status.SUPPORTED
    sec = registry.get("bench").report(Path("synthetic"), df)
    [lin] = [v for v in sec.verdicts if "near-linearly" in v.claim]
    assert lin.status is Status.INCONCLUSIVE and "rerun alone" in lin.evidence
    # an overloaded row at an n the slope is not fitted on (the smaller half) does not touch the claim
    small = df.assign(overloaded=(df.n == 1024) & (df.method == "poslsh"))
    [lin] = [v for v in registry.get("bench").report(Path("synthetic"), small).verdicts if "near-linearly" in v.claim]
    assert lin.status is Status.SUPPORTED and "rerun alone" not in lin.evidence


def step_rows(ratio, alone_alibi=1.0, loaded_alibi=None, overloaded=False):
    """step-bench rows at L = 8192 and 16384: rope, alibi, poslsh s=10 on the plan's path, the
    Positional-LSH step ``ratio[L]`` times the exact-ALiBi step it was timed beside."""
    rows = []
    for L in (8192, 16384):
        a = alone_alibi * L / 8192
        shown = a if loaded_alibi is None else loaded_alibi * L / 8192  # the alibi row's own (other) measurement
        common = dict(seq_len=L, backend="auto", attention_path="x", batch=1, params=1, device="cpu", steps=3,
                      sigmas="standard", precision="fp32", peak_mem_mb=100.0, threads=2, cores=2.0,
                      load_others=1.0 if overloaded else 0.0, loadavg=2.0, overloaded=False)
        rows.append(dict(common, position="rope", s=0, step_seconds=a, ref_position="", ref_backend="", ref_path="",
                         ref_step_seconds=math.nan))
        rows.append(dict(common, position="alibi", s=0, step_seconds=shown, ref_position="rope", ref_backend="auto",
                         ref_path="sdpa+rope", ref_step_seconds=a))
        rows.append(dict(common, position="poslsh", s=10, step_seconds=a * ratio[L], ref_position="alibi",
                         ref_backend="auto", ref_path="x", ref_step_seconds=a, overloaded=overloaded))
    df = pd.DataFrame(rows)
    return df.assign(tokens_per_s=df.seq_len / df.step_seconds)


def test_step_bench_claims_use_the_interleaved_reference_and_the_load():
    from poslsh_cli.experiments.step_bench import command as step_bench
    from poslsh_cli.verdicts.claims import Status

    def long(df):
        [v] = [v for v in step_bench.report(Path("synthetic"), df).verdicts if "at long context" in v.claim]
        return v

    ratio = {8192: 0.8, 16384: 0.4}
    assert long(step_rows(ratio)).status is Status.SUPPORTED
    # the alibi row itself was timed while slowed down 8x: the poslsh row's paired reference decides
    assert long(step_rows({8192: 3.0, 16384: 3.11}, loaded_alibi=8.0)).status is Status.NOT_SUPPORTED
    v = long(step_rows(ratio, overloaded=True))
    assert v.status is Status.INCONCLUSIVE and "rerun alone" in v.evidence


def test_decode_bench_speed_uses_the_interleaved_reference_and_the_load():
    from poslsh_cli.experiments.decode_bench import command as decode_bench
    from poslsh_cli.verdicts.claims import Status

    def table(speed, alibi_row=10.0, overloaded=False):
        common = dict(context=65536, threads=2, cores=2.0, load_others=1.0 if overloaded else 0.0, loadavg=2.0)
        return pd.DataFrame([dict(common, position="alibi", s=0, tokens_per_s=alibi_row, token_seconds=1 / alibi_row,
                                  kv_bytes=800.0, ref_token_seconds=math.nan, overloaded=False),
                             dict(common, position="poslsh", s=8, tokens_per_s=10.0 * speed,
                                  token_seconds=0.1 / speed, kv_bytes=80.0, ref_token_seconds=0.1,
                                  overloaded=overloaded)])

    kv, speed = decode_bench.claims(table(5.0))
    assert kv.status is Status.SUPPORTED and speed.status is Status.SUPPORTED
    # the alibi row alone decoded 162.6 tokens/s; beside the poslsh model it decoded 10: the pair decides
    assert decode_bench.claims(table(5.0, alibi_row=162.6))[1].status is Status.SUPPORTED
    kv, speed = decode_bench.claims(table(5.0, overloaded=True))
    assert kv.status is Status.SUPPORTED  # memory does not depend on the load
    assert speed.status is Status.INCONCLUSIVE and "rerun alone" in speed.evidence


LOAD = ["threads", "cores", "load_others", "loadavg", "overloaded"]


def test_bench_cli_times_each_row_beside_exact_and_records_the_load(tmp_path):
    r = poslsh("bench", "n=[128]", "heads=2", "head_dim=8", "s=[2]", "window_sigmas=[1]",
               "methods=[exact,poslsh,windowed]", "causal=[true]", "repeats=2", "warmup=0",
               f"out={tmp_path}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "results.csv").set_index("method")
    for col in ["exact_seconds", *LOAD]:
        assert col in df.columns, col
    assert math.isnan(df.exact_seconds["exact"])
    assert df.exact_seconds["poslsh"] > 0 and df.exact_seconds["windowed"] > 0
    assert (df.threads >= 1).all() and (df.cores > 0).all() and df.overloaded.isin([True, False]).all()
    if os.path.exists("/proc/loadavg"):
        assert (df.load_others >= 0).all() and (df.loadavg >= 0).all()


def test_step_and_decode_bench_cli_time_each_row_beside_its_reference(tmp_path):
    tiny = ["hidden=32", "layers=1", "heads=4", "kv_heads=4", "head_dim=8", "intermediate=64"]
    r = poslsh("step-bench", "seq_len=[32]", *tiny, "batch=1", "steps=2", "warmup=0", "s=[2]",
               "backend=[auto]", f"out={tmp_path / 'step'}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "step" / "results.csv").set_index("position")
    for col in ["ref_position", "ref_step_seconds", *LOAD]:
        assert col in df.columns, col
    assert df.ref_position["alibi"] == "rope" and df.ref_position["poslsh"] == "alibi"
    assert math.isnan(df.ref_step_seconds["rope"]) and (df.ref_step_seconds.drop("rope") > 0).all()
    r = poslsh("decode-bench", "context=[32]", "new_tokens=2", *tiny, "sigma=4",
               f"out={tmp_path / 'decode'}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "decode" / "results.csv").set_index("position")
    for col in ["ref_token_seconds", *LOAD]:
        assert col in df.columns, col
    assert math.isnan(df.ref_token_seconds["alibi"]) and (df.ref_token_seconds.drop("alibi") > 0).all()


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


def test_the_sampling_share_at_the_largest_n_is_the_median_over_its_rows():
    """Two Positional-LSH rows of one (s, backend) at the largest n (say iid and sobol masks): the
    share of drawing the masks is their median, and the sentence says how many rows it rests on."""
    from poslsh_cli.experiments.bench.claims import claim_near_linear_time

    rows = [dict(device="cpu", causal=True, method="exact", s=0, backend="rank1", n=n, seconds=n * 1e-6,
                 sample_seconds=0.0) for n in (1024, 2048, 4096)]
    for n in (1024, 2048, 4096):
        for share in (0.1, 0.3):
            rows.append(dict(device="cpu", causal=True, method="poslsh", s=8, backend="union", n=n,
                             seconds=n * 1e-6, sample_seconds=share * n * 1e-6))
    _, paragraphs = claim_near_linear_time(pd.DataFrame(rows))
    said = [p for p in paragraphs if "drawing the masks" in p]
    assert said == ["causal, s=8 (union), n=4096: drawing the masks and building their layout take 20.0% of the "
                    "end-to-end 0.0041 s (median of 2 rows)."], said


def test_cpu_auto_is_one_path_per_s_the_plans_at_the_longest_n_and_never_timed_twice():
    """On the CPU 'auto' is the path the plan's forward cost model picks for the grid's masks at its
    longest n (one series per s): the blocks for one mask, the union for many; asked beside an explicit
    path it resolves to, that path is timed once."""
    import torch

    from poslsh_cli.experiments.bench.command import partition_backends
    from poslsh_cli.numerics.sampling import bandwidths

    cpu, sigmas = torch.device("cpu"), bandwidths(8, None)
    assert partition_backends(cpu, ("auto",), 1, sigmas, 2**14) == ("blocks",)
    assert partition_backends(cpu, ("auto",), 100, sigmas, 2**14) == ("union",)
    assert partition_backends(cpu, ("auto", "blocks"), 1, sigmas, 2**14) == ("blocks",)
    assert partition_backends(cpu, ("auto", "blocks"), 100, sigmas, 2**14) == ("union", "blocks")
    assert partition_backends(cpu, ("blocks",), 100, sigmas, 2**14) == ("blocks",)  # auto not asked: not weighed
    # in half precision the plan does not weigh the masks (the s threshold), as attend() does not
    from poslsh_cli.attention.plan import UNION_MIN_S_CPU

    assert partition_backends(cpu, ("auto",), 1, sigmas, 2**14, dtype="bfloat16") == ("blocks",)
    assert partition_backends(cpu, ("auto",), UNION_MIN_S_CPU, sigmas, 2**14, dtype="bfloat16") == ("union",)
    # past its cap at the grid's n the union's band is not taken, though it is within it at 2^16, where
    # the paths are weighed
    import numpy as np

    from poslsh_cli.attention import AttentionSpec
    from poslsh_cli.attention import plan as plan_mod
    from poslsh_cli.attention.band import band_bytes
    from poslsh_cli.numerics.sampling import derive_seed

    at = AttentionSpec.build("poslsh", sigmas, 2**16, True, s=100, rng=np.random.default_rng(derive_seed(0, "bench-plan", 2**16, 100)))
    cap = 1.5 * band_bytes(at.bin_table[0], 2**16, True, 100)
    assert band_bytes(at.bin_table[0], 2**17 + 1, True, 100) > cap
    from poslsh_cli.experiments.bench.paths import _cpu_auto

    old, plan_mod.UNION_MAX_BYTES = plan_mod.UNION_MAX_BYTES, cap
    _cpu_auto.cache_clear()  # choices made under the real cap
    try:
        assert partition_backends(cpu, ("auto",), 100, sigmas, 2**16) == ("union",)
        assert partition_backends(cpu, ("auto",), 100, sigmas, 2**17 + 1) == ("blocks",)
        # with the backward pass too: the union within the cap, the blocks past it
        assert partition_backends(cpu, ("auto",), 100, sigmas, 2**16, backward=True) == ("union",)
        assert partition_backends(cpu, ("auto",), 100, sigmas, 2**17 + 1, backward=True) == ("blocks",)
    finally:
        plan_mod.UNION_MAX_BYTES = old
        _cpu_auto.cache_clear()


def test_a_forward_pass_memory_estimate_counts_the_unions_band_where_the_plan_may_take_it():
    """Past the dense bias the CPU may run either the blocks or the union (chosen by the masks drawn),
    so the estimate is the larger: at least the union's layout (its sorted block ends and one chunk's
    log counts, up to its cap) and at least the blocks' per-sample outputs."""
    from poslsh_cli.attention import Backend, Method, Plan
    from poslsh_cli.attention.plan import UNION_MAX_BYTES, union_band_bound
    from poslsh_cli.experiments.base import attention_bytes

    H, n, d, B = 8, 4096, 16, 4
    got = attention_bytes("poslsh", "cpu", n, B, H, d, 10)
    assert got >= union_band_bound(H, n, 10)
    assert got >= Plan(Method.POSLSH, Backend.BLOCKS).memory_bytes(B, H, n, d, 10)
    huge = attention_bytes("poslsh", "cpu", 2**17, 1, H, d, 10)
    assert huge < UNION_MAX_BYTES + Plan(Method.POSLSH, Backend.BLOCKS).memory_bytes(1, H, 2**17, d, 10) + 1
    # below the dense bias and for exact ALiBi: the plan's own estimate
    assert attention_bytes("poslsh", "cpu", 256, B, H, d, 10) == \
        Plan(Method.POSLSH, Backend.DENSE).memory_bytes(B, H, 256, d, 10)
    assert attention_bytes("alibi", "cpu", n, B, H, d, 0) == \
        Plan(Method.EXACT, Backend.RANK1).memory_bytes(B, H, n, d, 0)
    # the layout grows with s (every position's s block ends)
    assert attention_bytes("poslsh", "cpu", n, B, H, d, 1000) >= union_band_bound(H, n, 1000) > 8 * H * n * 1000
    # a training step past the dense bias: the layout too (each layer's held for its backward)
    step = attention_bytes("poslsh", "cpu", n, B, H, d, 10, training=True)
    assert step >= union_band_bound(H, n, 10)
    assert step >= Plan(Method.POSLSH, Backend.BLOCKS).memory_bytes(B, H, n, d, 10, training=True)


def test_the_bench_memory_estimate_caps_the_band_only_where_the_plan_keeps_it_under_its_cap():
    """The union's layout is under its cap only where the plan weighs the masks ('auto' in float32 and
    wider); asked for by name, or 'auto' in half precision, the union holds its whole layout."""
    from poslsh_cli.attention.plan import UNION_MAX_BYTES, union_band_bound
    from poslsh_cli.core.config import build_spec
    from poslsh_cli.experiments.bench.command import BenchSpec, memory

    def need(backends, dtype):
        return memory(build_spec(BenchSpec, dict(n=[2**17], s=[1000], partition_backends=backends, dtype=dtype,
                                                 causal=[True], methods=["poslsh"], device="cpu"))).bytes

    band = union_band_bound(8, 2**17, 1000)  # 8 heads x n positions x s block ends, past the cap
    assert band > UNION_MAX_BYTES
    auto, named = need(["auto"], "float32"), need(["union"], "float32")
    assert named - auto >= band - UNION_MAX_BYTES  # the whole layout where the union is asked for
    assert need(["union", "blocks"], "float32") == named
    assert need(["auto"], "bfloat16") >= band  # no weighing in half precision: the s threshold's union
    assert need(["blocks"], "float32") <= auto <= need(["blocks"], "float32") + UNION_MAX_BYTES
