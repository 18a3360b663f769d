"""Speed, memory and accuracy of Positional-LSH attention against exact and windowed ALiBi.

Random inputs q, k, v ~ N(0, 1) of shape (1, heads, n, head_dim), one sigma per head. A cell is
one (n, causal, method, parameter[, backend]) point. Each timed call is the method's whole
forward pass as it is used: for Positional LSH the masks are drawn anew for every forward pass,
so a call samples the partitions, builds their block layout, then attends. ``seconds`` is the
median end-to-end time of ``repeats`` calls after ``warmup`` untimed ones (CUDA-synchronised);
``sample_seconds`` (sampling + layout) and ``attention_seconds`` are the medians of the two
parts, timed within the same calls; ``spread`` is the slowest call over the fastest. A cell's calls
draw the same masks (its seed), so its spread is the machine's; between cells the draws differ, and
the union route scores a band that follows the longest block drawn, so its times need not be
monotone in n. On CUDA Positional LSH is timed on both of its paths
(FlexAttention and padded blocks; column ``backend``). Peak memory: CUDA's allocator peak on GPU;
on CPU the peak rise of the process's resident memory during one call, sampled every 0.5 ms
(Linux ``/proc/self/statm``). ``rel_fro`` is against the exact path's output, where it runs.
``gflop`` counts the useful floating-point work of the method (4 d per attended pair: q.k and
p.v; for Positional LSH each pair some mask keeps, once), so ``gflops`` says how well the method uses the hardware, not just how it compares.
``machine_gflops`` is what this machine attains on attention: the bias-free flash kernel (PyTorch
SDPA) on one dense problem of the same heads and head dimension, causal or not as the row, timed
once per run; ``fraction`` = ``gflops / machine_gflops``, how close a path comes to it (the
roofline of attention here). ``max_err_f64`` is the largest difference of the row's output from
float64 exact ALiBi on 128 query rows spread over the sequence (for exact rows: their rounding
error; for the others: their approximation error). ``exact_backends`` times exact ALiBi on
several paths side by side (the ``backend`` column names each).

Every row compared with exact ALiBi (a method other than exact, at an n where exact is timed) is
paired with exact ALiBi (the first of ``exact_backends``) timed beside its (n, causal) group: exact
ALiBi's own cell, then after each row one more exact call whenever exact's timed seconds fall behind
the group's rows' (:class:`~poslsh_cli.experiments.measure.SharedReference`), never the whole
baseline again per row. ``exact_seconds`` is the median of the exact calls up to and just after the
row, the time its speed-up is taken against, so a load that changes during the run moves both alike;
a group costs at most about twice the rows' and the baseline's own timings. Every row records the load while it was timed
(``threads``, ``cores``, ``load_others``, ``loadavg``, ``overloaded``:
:class:`~poslsh_cli.experiments.measure.Load`); a speed claim from an overloaded row is INCONCLUSIVE.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

import numpy as np

from poslsh_cli.experiments.bench.paths import partition_backends
from poslsh_cli.experiments.bench.references import (check_rows, exact_output, exact_path, inputs, machine_gflops,
                                                        reference64, useful_pairs)
from poslsh_cli.experiments.bench.report import plot, report, summary
from poslsh_cli.core.config import Spec, check, key
from poslsh_cli.experiments.base import Experiment, MemoryNeed, choices
from poslsh_cli.experiments.devices import Device, Dtype, cuda_skip_reason, resolve_device, torch_dtype
from poslsh_cli.numerics.methods import INFO, Method
from poslsh_cli.attention.scheme import scheme_key
from poslsh_cli.numerics.sampling import Sampler, bandwidths, derive_seed
from poslsh_cli.attention.plan import union_band_bound, weighs
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.measure import SharedReference, TIMING_THRESHOLD, measure, mmap_threshold, timed_call
from poslsh_cli.numerics.metrics import output_errors
from poslsh_cli.attention import choose

#: Exact-ALiBi paths bench can time side by side (``auto``: the one the plan takes)
EXACT_BACKENDS = ("auto", "rank1", "chunked", "dense", "flex")
#: Paths of the partition methods (Positional LSH, fixed blocks) bench can time side by side
PARTITION_BACKENDS = ("auto", "blocks", "union", "flex", "dense")


#: The methods bench can time: every attention method.
BenchMethod = choices("BenchMethod", list(Method), __name__)


@dataclass(frozen=True)
class BenchSpec(Spec):
    n: tuple[int, ...] = key("sequence lengths (int or list)", [1024, 2048, 4096, 8192, 16384, 32768], ge=2)
    heads: int = key("number of heads; standard ALiBi slopes give one sigma per head", 8, ge=1)
    sigma: Optional[float] = scheme_key("sigma", None, "one for every head instead of the ALiBi slopes")
    head_dim: int = key("head dimension d", 64, ge=1)
    causal: tuple[bool, ...] = key("causal attention (bool or list)", [False])
    s: tuple[int, ...] = scheme_key("s", [1, 2, 4, 8, 16, 32], "each is one method point")
    sampler: tuple[Sampler, ...] = scheme_key("sampler", [Sampler.IID], "a list: side by side")
    window_sigmas: tuple[float, ...] = scheme_key("window_sigmas", [0.5, 1.0, 2.0, 4.0, 8.0, 16.0], "one point per c")
    methods: tuple[BenchMethod, ...] = key("methods to time: " + ", ".join(m.value for m in BenchMethod)
                                           + " (default: every method with a positional bias)",
                                           [BenchMethod(m.value) for m in (Method.EXACT, Method.POSLSH, Method.WINDOWED,
                                                                           Method.FIXED_BLOCK)], noun="method")
    exact_max_n: int = key("largest n for which exact ALiBi is timed (and rel_fro computed)", 32768, ge=2)
    exact_backends: tuple[str, ...] = key("exact-ALiBi paths to time: auto (the plan's: rank1 on the CPU, flex on "
                                          "CUDA), rank1, chunked, dense, flex; the first is the reference of "
                                          "rel_fro", ["auto"], noun="exact backend")
    partition_backends: tuple[str, ...] = key("Positional-LSH and fixed-block paths to time: auto (CUDA: the union "
                                              "route the plan takes and the per-mask flex route; CPU: the plan's at "
                                              "the grid's longest n), blocks, union (one attention over "
                                              "the union of each query's s blocks, weighted by log counts), flex "
                                              "(one FlexAttention call per mask), dense", ["auto"],
                                              noun="partition backend")
    dtype: Dtype = key("input and compute dtype", Dtype.FLOAT32)
    repeats: int = key("timed repeats per point (median reported), after warmup", 3, ge=1)
    warmup: int = key("untimed calls before timing", 1, ge=0)
    backward: bool = key("time forward + backward instead of forward only", False)
    device: Device = key("auto (CUDA when present), cpu, cuda, cuda:N", Device("auto"))

    def check(self) -> None:
        for b in self.exact_backends:
            check(b in EXACT_BACKENDS, f"unknown exact backend {b!r} (one of {', '.join(EXACT_BACKENDS)})")
        check(len(set(self.exact_backends)) == len(self.exact_backends), "exact_backends lists a path twice")
        for b in self.partition_backends:
            check(b in PARTITION_BACKENDS, f"unknown partition backend {b!r} (one of {', '.join(PARTITION_BACKENDS)})")
        check(len(set(self.partition_backends)) == len(self.partition_backends), "partition_backends lists a path twice")


@dataclass(frozen=True)
class BenchRow:
    method: str
    n: int
    head_dim: int
    heads: int
    s: int  # poslsh: samples; fixed_block: 1; else 0
    causal: bool
    seconds: float  # end to end: sampling + layout + attention (median over repeats)
    peak_mem_mb: float
    rel_fro: float  # against exact (median over heads); NaN where exact is not run
    window_sigmas: float  # windowed: c in w = ceil(c sigma); else NaN
    dtype: str
    device: str
    backend: str
    sample_seconds: float  # drawing the partitions and building their layout (0 for exact/windowed)
    attention_seconds: float  # the attention itself, given the layout
    gflop: float
    gflops: float
    seed: int
    repeats: int
    max_err_f64: float  # max |output - float64 exact| over CHECK_ROWS query rows
    machine_gflops: float  # the bias-free flash kernel's useful GFLOP/s on a dense problem (this run)
    fraction: float  # gflops / machine_gflops
    sampler: str = ""  # poslsh: how its masks are drawn (iid, stratified, sobol); else empty
    backward: bool = False  # timed forward + backward
    planned: bool = True  # the path is the one the plan takes by itself (what commands run)
    exact_seconds: float = math.nan  # exact ALiBi timed interleaved with this row (median); NaN: not compared
    threads: int = 0  # the load while the row was timed (measure.Load)
    cores: float = math.nan
    load_others: float = math.nan
    loadavg: float = math.nan
    overloaded: bool = False
    spread: float = math.nan  # the slowest timed call over the fastest (the cell's masks, drawn again in each)


#: results.csv's columns: the row's fields, in their order
COLUMNS = tuple(f.name for f in fields(BenchRow))


@dataclass
class BenchContext:
    device: Any
    dtype: Any
    sigmas: Any  # (heads,) float64
    exact: dict[tuple[int, bool], Any] = field(default_factory=dict)
    exact64: dict[tuple[int, bool], Any] = field(default_factory=dict)  # float64 exact on the check rows
    machine: dict[bool, float] = field(default_factory=dict)  # causal -> attainable GFLOP/s
    #: (n, causal) -> exact ALiBi timed beside that group's rows (measure.SharedReference)
    refs: dict[tuple[int, bool], Any] = field(default_factory=dict)




def prepare(spec: BenchSpec) -> BenchContext:


    mmap_threshold(TIMING_THRESHOLD)
    device = resolve_device(spec.device)
    sigmas = bandwidths(spec.heads, spec.sigma)
    ctx = BenchContext(device=device, dtype=torch_dtype(spec.dtype.value), sigmas=sigmas)
    for causal in spec.causal:
        ctx.machine[causal] = machine_gflops(spec, ctx, causal)
    return ctx


def memory(spec: BenchSpec) -> MemoryNeed:
    """Peak bytes at the largest n: q, k, v, the outputs kept for the error, the per-sample outputs
    and layout of Positional LSH at the largest s, the union's layout where it is timed on the
    CPU (at most its cap) and the exact path's chunk (bounded), on the bench's device; doubled when
    the backward pass is timed."""
    from poslsh_cli.attention import BLOCK_BATCH_BYTES, CHUNK_ELEMENTS

    n, H, d = max(spec.n), spec.heads, spec.head_dim
    elem = {"float64": 8, "float32": 4}.get(spec.dtype.value, 2)
    s = max(spec.s) if any(INFO[Method(m.value)].randomized for m in spec.methods) else 1
    b = elem * (6 * H * n * d + H * s * n * d) + 13.0 * H * s * n + 2 * 4 * CHUNK_ELEMENTS + BLOCK_BATCH_BYTES
    b += elem * H * d * sum(x for x in spec.n if x <= spec.exact_max_n)  # the exact outputs kept per n
    device = resolve_device(spec.device)
    if s > 1 and device.type == "cpu" and any(
            "union" in partition_backends(device, spec.partition_backends, k, bandwidths(H, spec.sigma), n,
                                          spec.backward, spec.dtype.value, c, d) for k in spec.s for c in spec.causal):
        # 'auto' in float32 and wider weighs the masks and keeps the band under its cap; asked for by
        # name, or in half precision (no weighing), the union's band is not capped
        capped = "union" not in spec.partition_backends and spec.dtype.value in ("float32", "float64")
        b += union_band_bound(H, n, s, capped)
    return MemoryNeed(b * (2 if spec.backward else 1), f"n={n}, {H} heads, s={s}", spec.device)


def cells(spec: BenchSpec, ctx: Any = None) -> list[dict[str, Any]]:
    """Grid order per (n, causal): exact first (the reference of every error), then each method
    in display order: one cell, one per window c, or one per s; partition methods once per
    backend on CUDA (the backend enters the key only where there is more than one)."""
    device = ctx.device if ctx is not None else _cpu()

    sigmas = ctx.sigmas if ctx is not None else bandwidths(spec.heads, spec.sigma)
    backends = {(s, c): partition_backends(device, spec.partition_backends, s, sigmas, max(spec.n), spec.backward,
                                           spec.dtype.value, c, spec.head_dim) for s in (*spec.s, 1) for c in spec.causal}
    tag = (lambda b: {"backend": b}) if any(len(b) > 1 for b in backends.values()) else (lambda b: {})
    chosen = {Method(m.value) for m in spec.methods}
    order = [Method.EXACT] + [m for m in Method if m is not Method.EXACT]
    out = []
    for n in spec.n:
        for causal in spec.causal:
            base = {"n": n, "causal": causal}
            for m in (m for m in order if m in chosen):
                info, cell = INFO[m], {**base, "method": m.value}
                if m is Method.EXACT:
                    several = len(spec.exact_backends) > 1
                    out += [{**cell, **({"backend": b} if several else {})} for b in spec.exact_backends] \
                        if n <= spec.exact_max_n else []
                elif info.params == "window":
                    out += [{**cell, "window_sigmas": c} for c in spec.window_sigmas]
                elif info.params.endswith("partitions"):
                    several = len(spec.sampler) > 1  # the sampler enters the key only where there is more than one
                    per_s = [{"s": s, **({"sampler": sm.value} if several else {})} for sm in spec.sampler
                             for s in spec.s] if info.randomized else [{}]
                    out += [{**cell, **x, **tag(b)} for x in per_s for b in backends[(x.get("s", 1), causal)]]
                else:
                    out.append(cell)
    return out


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


def run_cell(spec: BenchSpec, key: dict[str, Any], ctx: BenchContext, work: Any = None) -> tuple[list[dict], dict]:
    from poslsh_cli.attention import AttentionSpec, attend, layout_for

    n, causal, method = key["n"], key["causal"], Method(key["method"])
    info = INFO[method]
    q, k, v = inputs(spec, ctx, n)
    if spec.backward:
        for t in (q, k, v):
            t.requires_grad_(True)
    d, H = spec.head_dim, spec.heads
    s, window_c = key.get("s", 0), key.get("window_sigmas", math.nan)
    seed = derive_seed(spec.seed, "bench", n, s) if info.randomized else -1
    sampler = key.get("sampler", spec.sampler[0].value) if info.randomized else "iid"
    samples = s if info.randomized else 1

    def build() -> AttentionSpec:
        rng = np.random.default_rng(seed) if info.randomized else None  # heads draw from it in order
        return AttentionSpec.build(method, ctx.sigmas, n, causal, s=s, rng=rng, sampler=sampler,
                                   window_sigmas=None if math.isnan(window_c) else window_c)

    fixed = build()
    plan, planned = _plan(spec, key, ctx, fixed, samples)
    per_call = fixed.partitions is not None  # masks are drawn (and laid out) in every forward pass

    def draw() -> tuple[AttentionSpec, Any]:  # the untimed part of a call: masks and their layout
        att = build() if per_call else fixed
        return att, layout_for(att, plan, ctx.device, grad=spec.backward)

    def run(ready: tuple[AttentionSpec, Any]) -> Any:
        return attend(q, k, v, ready[0], layout=ready[1], plan=plan)

    pairs = useful_pairs(fixed, n, causal, H)
    if fixed.partitions is not None:
        s = fixed.partitions[0].num_samples
    paired = method is not Method.EXACT and n <= spec.exact_max_n and \
        Method.EXACT.value in {m.value for m in spec.methods}
    t = measure(draw, run, ctx.device, spec.repeats, spec.warmup, spec.backward, (q, k, v),
                progress=None if work is None else
                lambda done, total, text: work.progress(done, total, f"{method.value} n={n} {text}"))
    first_exact = method is Method.EXACT and key.get("backend", spec.exact_backends[0]) == spec.exact_backends[0]
    if first_exact or paired:
        ref = ctx.refs.get((n, causal))
        if ref is None:
            ref = ctx.refs[(n, causal)] = SharedReference(timed_call(*exact_path(spec, ctx, n, causal, (q, k, v)),
                                                                     ctx.device, spec.backward, (q, k, v)))
        if first_exact:
            ref.add(t.totals, t.spent)
    exact_seconds = ctx.refs[(n, causal)].after_row(t.spent) if paired else math.nan
    gflop = 4.0 * d * pairs / 1e9 * (3.0 if spec.backward else 1.0)
    rel = math.nan
    if first_exact:
        ctx.exact[(n, causal)] = t.out[0]
    elif n <= spec.exact_max_n and Method.EXACT.value in {m.value for m in spec.methods}:
        rel = float(np.median(output_errors(exact_output(spec, ctx, n, causal, (q, k, v)), t.out[0])[0]))
    err64 = float((t.out[:, :, check_rows(n)].double() - reference64(ctx, n, causal, (q, k, v))).abs().max())
    machine = ctx.machine.get(causal, math.nan)
    row = BenchRow(method=method.value, n=n, head_dim=d, heads=H, s=s, causal=causal, seconds=t.seconds,
                   peak_mem_mb=t.peak_mem_mb, rel_fro=rel, window_sigmas=window_c, dtype=spec.dtype.value,
                   device=str(ctx.device), backend=plan.label, sample_seconds=t.prepare_seconds,
                   attention_seconds=t.attention_seconds, gflop=gflop, gflops=gflop / t.seconds,
                   seed=seed, repeats=spec.repeats, max_err_f64=err64, machine_gflops=machine,
                   fraction=gflop / t.seconds / machine if machine == machine else math.nan,
                   sampler=sampler if info.randomized else "", backward=spec.backward, planned=planned,
                   exact_seconds=exact_seconds, spread=max(t.totals) / min(t.totals) if t.totals else math.nan,
                   **t.load.columns())
    return [asdict(row)], {}


def _plan(spec: BenchSpec, key: dict[str, Any], ctx: BenchContext, att: Any, samples: int) -> tuple[Any, bool]:
    """The path a cell times (its ``backend``: asked, or the plan's) and whether it is the plan's own
    choice for these masks (the plan's cost model weighed where attend() weighs it: plan.weighs)."""
    from poslsh_cli.attention.api import work_of

    n, causal, method = key["n"], key["causal"], Method(key["method"])
    partitioned = INFO[method].params.endswith("partitions")
    if partitioned:
        backend = key.get("backend", partition_backends(ctx.device, spec.partition_backends, key.get("s", 0) or 1,
                                                        ctx.sigmas, max(spec.n), spec.backward, spec.dtype.value,
                                                        causal, spec.head_dim)[0])
    else:
        backend = key.get("backend", spec.exact_backends[0]) if method is Method.EXACT else "auto"
    weighed = weighs(att.partitions is not None, ctx.device, ctx.dtype, n, spec.backward)
    cost = work_of(att, n, spec.head_dim) if weighed else None
    try:
        plan = choose(method, device=ctx.device, dtype=ctx.dtype, n=n, causal=causal, grad=spec.backward,
                      backend=backend, s=samples, work=cost)
    except ValueError as exc:

        raise ConfigError(f"{'partition' if partitioned else 'exact'}_backends: {exc}") from None
    return plan, plan == choose(method, device=ctx.device, dtype=ctx.dtype, n=n, causal=causal, grad=spec.backward,
                                s=samples, work=cost)


EXPERIMENT = Experiment(
    name="bench",
    spec=BenchSpec,
    help="""Time exact ALiBi, windowed ALiBi, fixed blocks and Positional LSH side by side.

    Random inputs, one sigma per head (standard slopes). Reports the end-to-end median time
    (Positional LSH draws its masks in every call: sampling + layout + attention, with the
    parts in sample_seconds and attention_seconds), peak memory, useful GFLOP/s and relative
    error against exact, per (n, causal, method, s or window).

    What a grid costs: each point one untimed memory pass, warmup calls when a call is short,
    then repeats timed calls; exact ALiBi's own point once per (n, causal), then more exact calls
    between the other points only while its timed seconds fall behind theirs (each point's
    speed-up is against those), so a grid takes at most about twice its points' own timings.
    Exact ALiBi is the costly point at large n (about 40 s a call at n=32768 on a 2-core CPU):
    exact_max_n= leaves it out beyond.""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    plot=plot,
    report=report,
    presets=("bench", "bench_gpu"),
    order=40,
    skip_reason=lambda spec: cuda_skip_reason(spec.device),
    memory=memory,
)
