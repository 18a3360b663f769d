"""Speed, memory and accuracy of Positional-LSH attention against exact and windowed ALiBi.

Random inputs q, k, v ~ N(0, 1) of shape (1, heads, n, head_dim), one sigma per head. A cell is
one (n, causal, method, parameter[, backend]) point. Each timed call is the method's whole
forward pass as it is used: for Positional LSH the masks are drawn anew for every forward pass,
so a call samples the partitions, builds their block layout, then attends. ``seconds`` is the
median end-to-end time of ``repeats`` calls after ``warmup`` untimed ones (CUDA-synchronised);
``sample_seconds`` (sampling + layout) and ``attention_seconds`` are the medians of the two
parts, timed within the same calls. On CUDA Positional LSH is timed on both of its paths
(FlexAttention and padded blocks; column ``backend``). Peak memory: CUDA's allocator peak on GPU;
on CPU the peak rise of the process's resident memory during one call, sampled every 0.5 ms
(Linux ``/proc/self/statm``). ``rel_fro`` is against the exact path's output, where it runs.
``gflop`` counts the useful floating-point work of the method (4 d per attended pair: q.k and
p.v), so ``gflops`` says how well the method uses the hardware, not just how it compares.
"""
from __future__ import annotations

import math
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from poslsh_cli.claims import TIME_RULE, Section, Verdict, combine, time_status, upper_half
from poslsh_cli.config import Spec, key
from poslsh_cli.experiment import (Dtype, Experiment, MemoryNeed, check_device, choices, resolve_device, synchronize,
                                   torch_dtype)
from poslsh_cli.methods import Method
from poslsh_cli.metrics import fit_loglog_slope
from poslsh_cli.sampling import derive_seed

COLUMNS = ("method", "n", "head_dim", "heads", "s", "causal", "seconds", "peak_mem_mb", "rel_fro", "window_sigmas",
           "dtype", "device", "backend", "sample_seconds", "attention_seconds", "gflop", "gflops", "seed", "repeats")


#: The methods bench times: every attention method but no_bias (nothing to compare it with).
BenchMethod = choices("BenchMethod", [Method.EXACT, Method.POSLSH, Method.WINDOWED, Method.FIXED_BLOCK], __name__)


@dataclass(frozen=True)
class BenchSpec(Spec):
    n: tuple[int, ...] = key("sequence lengths (int or list)", [1024, 2048, 4096, 8192, 16384, 32768], ge=2)
    heads: int = key("number of heads; standard ALiBi slopes give one sigma per head", 8, ge=1)
    sigma: Optional[float] = key("one sigma for every head instead of the ALiBi slopes", None, gt=0)
    head_dim: int = key("head dimension d", 64, ge=1)
    causal: tuple[bool, ...] = key("causal attention (bool or list)", [False])
    s: tuple[int, ...] = key("Positional-LSH sample counts (each is one method point)", [1, 2, 4, 8, 16, 32], ge=1)
    window_sigmas: tuple[float, ...] = key("windowed exact ALiBi half-widths w = ceil(c*sigma), one point per c",
                                           [0.5, 1.0, 2.0, 4.0, 8.0, 16.0], gt=0)
    methods: tuple[BenchMethod, ...] = key("methods to time: exact, poslsh, windowed, fixed_block",
                                           list(BenchMethod), noun="method")
    exact_max_n: int = key("largest n for which exact ALiBi is timed (and rel_fro computed)", 32768, ge=2)
    dtype: Dtype = key("input and compute dtype", Dtype.FLOAT32)
    repeats: int = key("timed repeats per point (median reported), after warmup", 3, ge=1)
    warmup: int = key("untimed calls before timing", 1, ge=0)
    backward: bool = key("time forward + backward instead of forward only", False)
    device: str = key("auto (CUDA when present), cpu, cuda, cuda:N", "auto")

    def check(self) -> None:
        check_device(self.device)


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


@dataclass
class Context:
    device: Any
    dtype: Any
    sigmas: Any  # (heads,) float64
    exact: dict[tuple[int, bool], Any] = field(default_factory=dict)


def _mmap_threshold(nbytes: int) -> None:
    """Allocations above ``nbytes`` are served by mmap and returned to the OS when freed (glibc).

    Timing runs at 32 MiB (glibc's own ceiling for its dynamic threshold, fixed so every cell
    sees the same allocator); the memory pass drops it to 64 KiB, so the resident set follows
    live tensors and its peak is the method's peak rather than reused heap.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, int(nbytes))  # M_MMAP_THRESHOLD
        libc.mallopt(-1, int(2 * nbytes))  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)  # hand freed heap pages back: reusing them counts again
    except (OSError, AttributeError):
        pass


_TIMING_THRESHOLD, _MEMORY_THRESHOLD = 32 * 2**20, 64 * 2**10


def prepare(spec: BenchSpec) -> Context:
    import numpy as np

    from poslsh_cli.sampling import alibi_sigmas

    _mmap_threshold(_TIMING_THRESHOLD)
    device = resolve_device(spec.device)
    sigmas = alibi_sigmas(spec.heads) if spec.sigma is None else np.full(spec.heads, float(spec.sigma))
    return Context(device=device, dtype=torch_dtype(spec.dtype.value), sigmas=sigmas)


def skip_reason(spec: BenchSpec) -> str | None:
    """A CUDA preset on a machine without CUDA is skipped (reproduce), not failed."""
    if spec.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return f"device={spec.device} but this machine has no CUDA GPU"
    return None


def poslsh_backends(device: Any) -> tuple[str, ...]:
    """Positional-LSH paths timed on ``device``: FlexAttention and padded blocks on CUDA; on CPU
    only blocks (uncompiled FlexAttention is a dense fallback, not a fast path)."""
    return ("flex", "blocks") if device.type == "cuda" else ("blocks",)


def memory(spec: BenchSpec) -> MemoryNeed:
    """Peak bytes at the largest n: q, k, v, the outputs kept for the error, the per-sample outputs
    and layout of Positional LSH at the largest s, and the exact path's chunk (bounded), on the
    bench's device; doubled when the backward pass is timed."""
    from poslsh_cli.attention import BLOCK_BATCH_BYTES, CHUNK_ELEMENTS

    n, H, d = max(spec.n), spec.heads, spec.head_dim
    elem = {"float64": 8, "float32": 4}.get(spec.dtype.value, 2)
    s = max(spec.s) if BenchMethod.POSLSH in spec.methods else 1
    b = elem * (6 * H * n * d + H * s * n * d) + 13.0 * H * s * n + 2 * 4 * CHUNK_ELEMENTS + BLOCK_BATCH_BYTES
    b += elem * H * d * sum(x for x in spec.n if x <= spec.exact_max_n)  # the exact outputs kept per n
    return MemoryNeed(b * (2 if spec.backward else 1), f"n={n}, {H} heads, s={s}", spec.device)


def cells(spec: BenchSpec, ctx: Any = None) -> list[dict[str, Any]]:
    """Grid order per (n, causal): exact, Positional LSH per s (and backend on CUDA), windowed
    per c, fixed block. The backend enters the key only where there is more than one."""
    backends = poslsh_backends(ctx.device) if ctx is not None else ("blocks",)
    tag = (lambda b: {"backend": b}) if len(backends) > 1 else (lambda b: {})
    methods = set(spec.methods)
    out = []
    for n in spec.n:
        for causal in spec.causal:
            base = {"n": n, "causal": causal}
            if BenchMethod.EXACT in methods and n <= spec.exact_max_n:
                out.append({**base, "method": BenchMethod.EXACT.value})
            if BenchMethod.POSLSH in methods:
                out += [{**base, "method": BenchMethod.POSLSH.value, "s": s, **tag(b)} for s in spec.s for b in backends]
            if BenchMethod.WINDOWED in methods:
                out += [{**base, "method": BenchMethod.WINDOWED.value, "window_sigmas": c} for c in spec.window_sigmas]
            if BenchMethod.FIXED_BLOCK in methods:
                out += [{**base, "method": BenchMethod.FIXED_BLOCK.value, **tag(b)} for b in backends]
    return out


def _inputs(spec: BenchSpec, ctx: Context, n: int) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(derive_seed(spec.seed, "bench-inputs", n, spec.heads, spec.head_dim))
    shape = (1, spec.heads, n, spec.head_dim)
    return tuple(torch.randn(shape, generator=g).to(device=ctx.device, dtype=ctx.dtype) for _ in range(3))


class _RssPeak:
    """Peak resident-set rise of this process while the block runs (Linux; NaN elsewhere)."""

    def __init__(self) -> None:
        self.ok = os.path.exists("/proc/self/statm")
        self.page = os.sysconf("SC_PAGE_SIZE") if self.ok else 1

    def _rss(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self.page

    def __enter__(self) -> "_RssPeak":
        if self.ok:
            self.base = self.peak = self._rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.0005)

    def __exit__(self, *exc: Any) -> None:
        if self.ok:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss())

    @property
    def mb(self) -> float:
        return (self.peak - self.base) / 2**20 if self.ok else math.nan


@dataclass(frozen=True)
class Timing:
    seconds: float  # median end-to-end
    prepare_seconds: float  # median of the preparation part
    attention_seconds: float  # median of the attention part
    peak_mem_mb: float
    out: Any


def measure(prepare: Callable[[], Any], attend: Callable[[Any], Any], device: Any, repeats: int,
            warmup: int, backward: bool, inputs: tuple[Any, ...]) -> Timing:
    """Time ``attend(prepare())``: end to end and each part, within the same calls.

    ``prepare`` is the method's per-call set-up (for Positional LSH: drawing the masks and
    building their layout; nothing for exact attention), ``attend`` the attention. Forward +
    backward when ``backward``. Peak memory is measured in one more, untimed, end-to-end call.
    """
    import torch

    def call() -> tuple[float, float, Any]:
        synchronize(device)
        t0 = time.perf_counter()
        plan = prepare()
        synchronize(device)
        t1 = time.perf_counter()
        if backward:
            for t in inputs:
                t.grad = None
            out = attend(plan)
            out.float().square().sum().backward()
            out = out.detach()
        else:
            with torch.no_grad():
                out = attend(plan)
        synchronize(device)
        return t1 - t0, time.perf_counter() - t1, out

    for _ in range(warmup):
        call()
    prep, att, total = [], [], []
    for _ in range(repeats):
        a, b, _ = call()
        prep.append(a)
        att.append(b)
        total.append(a + b)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = call()[2]
        synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    else:
        _mmap_threshold(_MEMORY_THRESHOLD)
        try:
            with _RssPeak() as mem:
                out = call()[2]
        finally:
            _mmap_threshold(_TIMING_THRESHOLD)
        peak = mem.mb
    return Timing(statistics.median(total), statistics.median(prep), statistics.median(att), peak, out)


def run_cell(spec: BenchSpec, key: dict[str, Any], ctx: Context, work: Any = None) -> tuple[list[dict], dict]:
    import numpy as np
    import torch

    from poslsh_cli.attention import AttentionSpec, attend, fixed_block_partitions, prepare as prepare_layout
    from poslsh_cli.attention import windows
    from poslsh_cli.metrics import output_errors
    from poslsh_cli.sampling import sample_partitions

    n, causal, method = key["n"], key["causal"], Method(key["method"])
    q, k, v = _inputs(spec, ctx, n)
    if spec.backward:
        for t in (q, k, v):
            t.requires_grad_(True)
    d, H = spec.head_dim, spec.heads
    pairs_full = n * (n + 1) / 2 if causal else float(n) * n
    s, window_c, seed = 0, math.nan, -1
    backend = "flex" if ctx.device.type == "cuda" else "chunked-sdpa"
    if method in (Method.EXACT, Method.WINDOWED):
        if method is Method.WINDOWED:
            window_c = key["window_sigmas"]
            att = AttentionSpec(method, ctx.sigmas, causal, window=windows(ctx.sigmas, window_c))
            pairs = sum(_band_pairs(n, wh, causal) for wh in att.window)
        else:
            att = AttentionSpec(method, ctx.sigmas, causal)
            pairs = H * pairs_full

        def prepare() -> AttentionSpec:
            return att

        def run(plan: Any) -> Any:
            return attend(q, k, v, plan)
    else:
        path = key.get("backend", poslsh_backends(ctx.device)[0])
        if method is Method.POSLSH:
            s = key["s"]
            seed = derive_seed(spec.seed, "bench", n, s)

            def draw() -> tuple:
                g = np.random.default_rng(seed)
                return tuple(sample_partitions(n, float(sg), s, g) for sg in ctx.sigmas)
        else:
            s = 1

            def draw() -> tuple:
                return tuple(fixed_block_partitions(n, ctx.sigmas))

        def prepare() -> tuple[AttentionSpec, Any]:
            plan = AttentionSpec(method, ctx.sigmas, causal, partitions=draw())
            return plan, prepare_layout(plan, path, ctx.device)

        def run(plan: tuple[AttentionSpec, Any]) -> Any:
            return attend(q, k, v, plan[0], layout=plan[1])

        lengths = np.concatenate([np.diff(o) for p in draw() for o in p.offsets]).astype(np.float64)
        pairs = float(np.sum(lengths * (lengths + 1) / 2 if causal else lengths**2))
        backend = {"flex": "block-flex", "blocks": "block-flash-cpu" if ctx.device.type == "cpu"
                   else "block-padded"}[path]
    t = measure(prepare, run, ctx.device, spec.repeats, spec.warmup, spec.backward, (q, k, v))
    gflop = 4.0 * d * pairs / 1e9 * (3.0 if spec.backward else 1.0)
    rel = math.nan
    if method is Method.EXACT:
        ctx.exact[(n, causal)] = t.out[0]
    elif n <= spec.exact_max_n and BenchMethod.EXACT in spec.methods:
        ref = ctx.exact.get((n, causal))
        if ref is None:  # resumed run: recompute the reference, untimed
            with torch.no_grad():
                ref = ctx.exact[(n, causal)] = attend(q.detach(), k.detach(), v.detach(),
                                                      AttentionSpec(Method.EXACT, ctx.sigmas, causal))[0]
        rel = float(np.median(output_errors(ref, t.out[0])[0]))
    row = BenchRow(method=method.value, n=n, head_dim=d, heads=H, s=s, causal=causal, seconds=t.seconds,
                   peak_mem_mb=t.peak_mem_mb, rel_fro=rel, window_sigmas=window_c, dtype=spec.dtype.value,
                   device=str(ctx.device), backend=backend, sample_seconds=t.prepare_seconds,
                   attention_seconds=t.attention_seconds, gflop=gflop, gflops=gflop / t.seconds,
                   seed=seed, repeats=spec.repeats)
    return [asdict(row)], {}


def _band_pairs(n: int, w: int, causal: bool) -> float:
    """Number of (i, j) with |i - j| <= w (and j <= i when causal)."""
    w = min(w, n - 1)
    one_side = w * n - w * (w + 1) / 2  # pairs with 1 <= i - j <= w
    return n + one_side if causal else n + 2 * one_side


def crossover(df: Any, method: str, select: Callable[[Any], Any] | None = None) -> float:
    """Smallest n from which ``method`` is faster than exact at every measured larger n.

    ``df`` holds the rows of one causal setting (times of causal and bidirectional attention are
    not comparable); ``select`` narrows the method's rows (one s, one backend).
    """
    if "causal" in df.columns and df.causal.nunique() > 1:
        raise ValueError("crossover compares one causal setting at a time: group by causal first")
    ex = df[df.method == "exact"].groupby("n")["seconds"].median()
    m = df[df.method == method]
    if select is not None:
        m = select(m)
    m = m.groupby("n")["seconds"].median()
    common = sorted(set(ex.index) & set(m.index))
    best = math.nan
    for n in reversed(common):
        if m[n] < ex[n]:
            best = n
        else:
            break
    return best


def pareto_front(points: np.ndarray) -> np.ndarray:
    """Points (seconds, error, label, ...) not beaten on both time and error, by increasing time."""
    order = np.argsort(points[:, 0].astype(float), kind="stable")
    front, best = [], np.inf
    for i in order:
        if float(points[i, 1]) < best:
            front.append(points[i])
            best = float(points[i, 1])
    return np.asarray(front, dtype=object)


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    """Per (n, causal): exact time; Positional LSH at each s (end to end, and its sampling part);
    the cheapest window at least as accurate."""
    head = ["n", "causal", "exact s", "poslsh", "e2e s", "of which sampling", "speed-up", "rel_fro", "window@≤err",
            "window s", "win speed-up"]
    if "backend" not in df.columns:
        df = df.assign(backend="")
    rows = []
    for (n, causal), g in df.groupby(["n", "causal"], sort=True):
        ex = g[g.method == "exact"]["seconds"]
        ex_t = float(ex.iloc[0]) if len(ex) else math.nan
        win = g[g.method == "windowed"]
        multi = g[g.method == "poslsh"].backend.nunique() > 1
        for _, p in g[g.method == "poslsh"].iterrows():
            ok = win[win.rel_fro <= p.rel_fro] if np.isfinite(p.rel_fro) else win.iloc[0:0]
            best = ok.loc[ok.seconds.idxmin()] if len(ok) else None
            share = p.get("sample_seconds", math.nan) / p.seconds
            rows.append([str(n), str(causal), f"{ex_t:.3g}", f"s={p.s}" + (f" {p.backend}" if multi else ""),
                         f"{p.seconds:.3g}", f"{share:.0%}" if np.isfinite(share) else "-",
                         f"{ex_t / p.seconds:.2f}x" if np.isfinite(ex_t) else "-", f"{p.rel_fro:.3g}",
                         f"{best.window_sigmas:g}σ" if best is not None else "-",
                         f"{best.seconds:.3g}" if best is not None else "-",
                         f"{ex_t / best.seconds:.2f}x" if best is not None and np.isfinite(ex_t) else "-"])
    return head, rows


# ---------------------------------------------------------------------------------------------
# figures


def plot(run: Path, df: Any) -> list[Path]:
    """Time against n (end to end: Positional LSH includes drawing its masks) with crossovers,
    and the error-time Pareto front per n, one pair of figures per causal setting."""
    import matplotlib.ticker
    import pandas as pd

    from poslsh_cli.plotting import pyplot, save

    plt = pyplot()
    if "backend" not in df.columns:
        df = df.assign(backend="")
    paths = []
    for causal, g in df.groupby("causal"):
        fig, ax = plt.subplots(figsize=(8, 5))
        multi = g[g.method == "poslsh"].backend.nunique() > 1
        lines = [("exact", {}, "k", "-", "exact ALiBi")]
        pos = g[g.method == "poslsh"][["s", "backend"]].drop_duplicates().sort_values(["s", "backend"])
        lines += [("poslsh", {"s": s, "backend": b}, f"C{i % 10}", "-" if b != "flex" else "-.",
                   f"Positional LSH s={s}" + (f" ({b})" if multi else ""))
                  for i, (s, b) in enumerate(pos.itertuples(index=False))]
        cs = sorted(g[g.method == "windowed"].window_sigmas.unique())
        lines += [("windowed", {"window_sigmas": c}, plt.cm.Purples(0.35 + 0.6 * i / max(1, len(cs))), "--",
                   f"windowed w={c:g}σ") for i, c in enumerate(cs)]
        lines += [("fixed_block", {}, "C7", ":", "fixed block")]
        for method, params, color, ls, label in lines:
            def sel(frame: pd.DataFrame, params: dict = params) -> pd.DataFrame:
                for k, v in params.items():
                    frame = frame[frame[k] == v]
                return frame

            m = sel(g[g.method == method]).sort_values("n")
            if m.empty:
                continue
            x = crossover(g, method, sel) if method != "exact" else float("nan")
            ax.plot(m.n, m.seconds, ls, color=color, marker="o", ms=3, lw=1.2,
                    label=label + (f"  (faster from n={int(x)})" if np.isfinite(x) else ""))
            if np.isfinite(x):
                ax.plot([x], [m.set_index("n").seconds[x]], "*", color=color, ms=11, mec="k", mew=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("seconds, end to end (median)")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(ncol=2)
        dev = str(g.device.iloc[0])
        ax.set_title(f"Attention time, {int(g.heads.iloc[0])} heads, d={int(g.head_dim.iloc[0])}, "
                     f"{g.dtype.iloc[0]}, {'causal' if causal else 'bidirectional'}, {dev}; ★ crossover")
        paths += save(fig, run, f"bench_time_vs_n_{'causal' if causal else 'bidir'}")

        pts = g[g.method.isin(["poslsh", "windowed", "fixed_block"]) & g.rel_fro.notna()]
        ns = sorted(pts.n.unique())
        if ns:
            cols = min(3, len(ns))
            rows = int(np.ceil(len(ns) / cols))
            fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.8 * rows), squeeze=False, layout="constrained")
            for ax, n in zip(axes.flat, ns):
                p = pts[pts.n == n]
                ex = g[(g.method == "exact") & (g.n == n)].seconds
                for method, marker, color in (("poslsh", "o", "C0"), ("windowed", "s", "C4"), ("fixed_block", "^", "C7")):
                    q = p[p.method == method]
                    ax.scatter(q.seconds, q.rel_fro, marker=marker, color=color, s=22, label=method, zorder=3)
                    for _, r in q.iterrows():
                        tag = f"s={r.s}" if method == "poslsh" else (f"{r.window_sigmas:g}σ" if method == "windowed" else "")
                        if method == "poslsh" and multi:
                            tag += f" {r.backend}"
                        ax.annotate(tag, (r.seconds, r.rel_fro), fontsize=8, xytext=(3, 2), textcoords="offset points")
                front = pareto_front(p[["seconds", "rel_fro", "method"]].to_numpy())
                ax.step(front[:, 0].astype(float), front[:, 1].astype(float), where="post", color="k", lw=0.8, alpha=0.6)
                if len(ex):
                    ax.axvline(float(ex.iloc[0]), color="k", ls="--", lw=0.8, label="exact time")
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                winners = ", ".join(sorted(set(front[:, 2])))
                ax.set_title(f"n={n}: front = {winners}", fontsize=9)
                ax.set_xlabel("seconds, end to end")
                ax.grid(True, which="both", alpha=0.25)
            for ax in axes.flat[len(ns):]:
                ax.axis("off")
            axes[0][0].set_ylabel("relative error vs exact")
            axes[0][0].legend()
            paths += save(fig, run, f"bench_pareto_{'causal' if causal else 'bidir'}")
    return paths


# ---------------------------------------------------------------------------------------------
# report


def report(run: Path, df: Any) -> Section:
    import pandas as pd

    sec = Section("bench", run, "Speed: Positional-LSH attention against exact and windowed ALiBi")
    head, rows = summary(df)
    sec.tables.append(pd.DataFrame(rows, columns=head))
    dev = df.device.iloc[0]
    if "backend" not in df.columns:
        df = df.assign(backend="")
    statuses, ev = [], []
    for causal, g in df.groupby("causal"):
        mode = "causal" if causal else "bidirectional"
        p = g[g.method == "poslsh"]
        for (s, backend), gs in p.groupby(["s", "backend"]):
            x = crossover(g, "poslsh", lambda f, s=s, b=backend: f[(f.s == s) & (f.backend == b)])
            where = f"from n={int(x)} on" if math.isfinite(x) else "at no measured n"
            sec.paragraphs.append(f"{mode}: Positional LSH s={s} ({backend}) is faster than exact {where} ({dev}).")
            ns = upper_half(gs.n)
            fit = fit_loglog_slope(gs[gs.n.isin(ns)].n, gs[gs.n.isin(ns)].seconds) if ns else None
            statuses.append(time_status(fit))
            ev.append(f"{mode} s={s} {backend}: {fit.slope:.2f}" if fit else f"{mode} s={s} {backend}: fewer than 3 n")
            big = gs[gs.n == gs.n.max()]
            if "sample_seconds" in gs.columns and len(big):
                share = float(big.sample_seconds.iloc[0] / big.seconds.iloc[0])
                if math.isfinite(share):
                    sec.paragraphs.append(f"{mode}, s={s} ({backend}), n={int(big.n.iloc[0])}: drawing the masks and "
                                          f"building their layout take {share:.1%} of the end-to-end "
                                          f"{big.seconds.iloc[0]:.3g} s.")
        ex = g[g.method == "exact"]
        ns = upper_half(ex.n)
        if ns:
            ev.append(f"{mode} exact: {fit_loglog_slope(ex[ex.n.isin(ns)].n, ex[ex.n.isin(ns)].seconds).slope:.2f}")
    sec.verdicts.append(Verdict("Positional-LSH time grows near-linearly in n (Theorem 2.2)", combine(statuses),
                                "log-log slopes over the larger n: " + "; ".join(ev) if ev else "no Positional-LSH rows",
                                TIME_RULE))
    # the error-time Pareto front per n, and Positional LSH against windowed ALiBi at matched error
    for causal, g in df.groupby("causal"):
        mode = "causal" if causal else "bidirectional"
        pts = g[g.method != "exact"].dropna(subset=["rel_fro"])
        fronts, beaten, total = [], 0, 0
        for n, gn in pts.groupby("n"):
            front = pareto_front(gn[["seconds", "rel_fro", "method"]].to_numpy())
            fronts.append(f"n={n}: {', '.join(sorted(set(front[:, 2])))}")
            win = gn[gn.method == "windowed"]
            for _, r in gn[gn.method == "poslsh"].iterrows():
                total += 1
                beaten += bool(((win.seconds <= r.seconds) & (win.rel_fro <= r.rel_fro)).any())
        if fronts:
            sec.paragraphs.append(f"{mode}: error–time Pareto front (end-to-end time) per n: " + "; ".join(fronts) + ".")
        if total and (pts.method == "windowed").any():
            sec.paragraphs.append(f"{mode}: {beaten} of {total} Positional-LSH points are matched by a windowed exact "
                                  "ALiBi point that is at least as fast and at least as accurate.")
    return sec


EXPERIMENT = Experiment(
    name="bench",
    spec=BenchSpec,
    help="""Time exact ALiBi, windowed ALiBi, fixed blocks and Positional LSH side by side.

    Random inputs, one sigma per head (standard slopes). Reports the end-to-end median time
    (Positional LSH draws its masks in every call: sampling + layout + attention, with the
    parts in sample_seconds and attention_seconds), peak memory, useful GFLOP/s and relative
    error against exact, per (n, causal, method, s or window).""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    plot=plot,
    report=report,
    presets=("bench", "bench_gpu"),
    order=40,
    skip_reason=skip_reason,
    memory=memory,
)
