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
from typing import Any, Callable

import numpy as np
import torch

from poslsh_cli.attention import exact_alibi, fixed_block_partitions, poslsh_attention, poslsh_layout
from poslsh_cli.experiments import resolve_device, synchronize, torch_dtype
from poslsh_cli.metrics import output_errors
from poslsh_cli.sampling import alibi_sigmas, derive_seed, sample_partitions

COLUMNS = ["method", "n", "head_dim", "heads", "s", "causal", "seconds", "peak_mem_mb", "rel_fro", "window_sigmas",
           "dtype", "device", "backend", "sample_seconds", "attention_seconds", "gflop", "gflops", "seed", "repeats"]

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
    device: torch.device
    dtype: torch.dtype
    sigmas: np.ndarray
    exact: dict[tuple[int, bool], torch.Tensor] = field(default_factory=dict)


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


def prepare(cfg: Any) -> Context:
    _mmap_threshold(_TIMING_THRESHOLD)
    device = resolve_device(cfg.device)
    sigmas = alibi_sigmas(cfg.heads) if cfg.sigma is None else np.full(cfg.heads, float(cfg.sigma))
    return Context(device=device, dtype=torch_dtype(cfg.dtype), sigmas=sigmas)


def poslsh_backends(device: torch.device) -> tuple[str, ...]:
    """Positional-LSH paths timed on ``device``: FlexAttention and padded blocks on CUDA; on CPU
    only blocks (uncompiled FlexAttention is a dense fallback, not a fast path)."""
    return ("flex", "blocks") if device.type == "cuda" else ("blocks",)


def cells(cfg: Any, ctx: Any = None) -> list[dict[str, Any]]:
    """Grid order per (n, causal): exact, Positional LSH per s (and backend on CUDA), windowed
    per c, fixed block. The backend enters the key only where there is more than one."""
    backends = poslsh_backends(ctx.device) if ctx is not None else ("blocks",)
    tag = (lambda b: {"backend": b}) if len(backends) > 1 else (lambda b: {})
    out = []
    for n in cfg.n:
        for causal in cfg.causal:
            base = {"n": n, "causal": causal}
            if "exact" in cfg.methods and n <= cfg.exact_max_n:
                out.append({**base, "method": "exact"})
            if "poslsh" in cfg.methods:
                out += [{**base, "method": "poslsh", "s": s, **tag(b)} for s in cfg.s for b in backends]
            if "windowed" in cfg.methods:
                out += [{**base, "method": "windowed", "window_sigmas": c} for c in cfg.window_sigmas]
            if "fixed_block" in cfg.methods:
                out += [{**base, "method": "fixed_block", **tag(b)} for b in backends]
    return out


def _inputs(cfg: Any, ctx: Context, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(derive_seed(cfg.seed, "bench-inputs", n, cfg.heads, cfg.head_dim))
    shape = (1, cfg.heads, n, cfg.head_dim)
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
    out: torch.Tensor


def measure(prepare: Callable[[], Any], attend: Callable[[Any], torch.Tensor], device: torch.device, repeats: int,
            warmup: int, backward: bool, inputs: tuple[torch.Tensor, ...]) -> Timing:
    """Time ``attend(prepare())``: end to end and each part, within the same calls.

    ``prepare`` is the method's per-call set-up (for Positional LSH: drawing the masks and
    building their layout; nothing for exact attention), ``attend`` the attention. Forward +
    backward when ``backward``. Peak memory is measured in one more, untimed, end-to-end call.
    """
    def call() -> tuple[float, float, torch.Tensor]:
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


def _exact_fn(q, k, v, ctx: Context, causal: bool, window: list[int] | None = None) -> Callable[[Any], torch.Tensor]:
    sig = torch.as_tensor(ctx.sigmas)
    return lambda _plan=None: exact_alibi(q, k, v, sig, causal, window=window)


def run_cell(cfg: Any, key: dict[str, Any], ctx: Context) -> tuple[list[dict], dict]:
    n, causal, method = key["n"], key["causal"], key["method"]
    q, k, v = _inputs(cfg, ctx, n)
    if cfg.backward:
        for t in (q, k, v):
            t.requires_grad_(True)
    d, H = cfg.head_dim, cfg.heads
    pairs_full = n * (n + 1) / 2 if causal else float(n) * n
    s, window_c, seed = 0, math.nan, -1
    prepare: Callable[[], Any] = lambda: None  # noqa: E731
    backend = "flex" if ctx.device.type == "cuda" else "chunked-sdpa"
    if method == "exact":
        attend = _exact_fn(q, k, v, ctx, causal)
        pairs = H * pairs_full
    elif method == "windowed":
        window_c = key["window_sigmas"]
        w = [int(math.ceil(window_c * sg)) for sg in ctx.sigmas]
        attend = _exact_fn(q, k, v, ctx, causal, window=w)
        pairs = sum(_band_pairs(n, wh, causal) for wh in w)
    else:
        path = key.get("backend", poslsh_backends(ctx.device)[0])
        if method == "poslsh":
            s = key["s"]
            seed = derive_seed(cfg.seed, "bench", n, s)

            def draw() -> list:
                g = np.random.default_rng(seed)
                return [sample_partitions(n, float(sg), s, g) for sg in ctx.sigmas]
        else:
            s = 1

            def draw() -> list:
                return fixed_block_partitions(n, ctx.sigmas)

        def prepare() -> tuple[list, Any]:
            parts = draw()
            return parts, poslsh_layout(parts, causal, path, ctx.device)

        def attend(plan: tuple[list, Any]) -> torch.Tensor:
            return poslsh_attention(q, k, v, plan[0], causal, layout=plan[1])

        parts = draw()
        lengths = np.concatenate([np.diff(o) for p in parts for o in p.offsets]).astype(np.float64)
        pairs = float(np.sum(lengths * (lengths + 1) / 2 if causal else lengths**2))
        backend = {"flex": "block-flex", "blocks": "block-flash-cpu" if ctx.device.type == "cpu"
                   else "block-padded"}[path]
    t = measure(prepare, attend, ctx.device, cfg.repeats, cfg.warmup, cfg.backward, (q, k, v))
    gflop = 4.0 * d * pairs / 1e9 * (3.0 if cfg.backward else 1.0)
    rel = math.nan
    if method == "exact":
        ctx.exact[(n, causal)] = t.out[0]
    elif n <= cfg.exact_max_n and "exact" in cfg.methods:
        ref = ctx.exact.get((n, causal))
        if ref is None:  # resumed run: recompute the reference, untimed
            with torch.no_grad():
                ref = ctx.exact[(n, causal)] = _exact_fn(q.detach(), k.detach(), v.detach(), ctx, causal)()[0]
        rel = float(np.median(output_errors(ref, t.out[0])[0]))
    row = BenchRow(method=method, n=n, head_dim=d, heads=H, s=s, causal=causal, seconds=t.seconds,
                   peak_mem_mb=t.peak_mem_mb, rel_fro=rel, window_sigmas=window_c, dtype=cfg.dtype,
                   device=str(ctx.device), backend=backend, sample_seconds=t.prepare_seconds,
                   attention_seconds=t.attention_seconds, gflop=gflop, gflops=gflop / t.seconds,
                   seed=seed, repeats=cfg.repeats)
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
