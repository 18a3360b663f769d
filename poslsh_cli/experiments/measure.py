"""Timing and memory measurement shared by the benchmarks (``bench``, ``step-bench``): medians of
repeated calls after warm-up (CUDA-synchronised), and peak memory: the CUDA allocator's peak on a
GPU, the peak rise of the process's resident set on the CPU (sampled every 0.5 ms, with the heap
handing freed pages back so the resident set follows live tensors).
"""
from __future__ import annotations

import math
import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from poslsh_cli.experiments.base import synchronize


def mmap_threshold(nbytes: int) -> None:
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


TIMING_THRESHOLD, MEMORY_THRESHOLD = 32 * 2**20, 64 * 2**10
#: A call at least this long (seconds) in the memory pass needs no further warm-up (:func:`measure`).
WARM_AFTER_S = 2.0


class RssPeak:
    """Peak resident-set rise of this process while the block runs (Linux; NaN elsewhere)."""

    def __init__(self) -> None:
        self.ok = os.path.exists("/proc/self/statm")
        self.page = os.sysconf("SC_PAGE_SIZE") if self.ok else 1

    def _rss(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self.page

    def __enter__(self) -> "RssPeak":
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


def measure(setup: Callable[[], Any], attend: Callable[[Any], Any], device: Any, repeats: int,
            warmup: int, backward: bool, inputs: tuple[Any, ...]) -> Timing:
    """Time ``attend(setup())``: end to end and each part, within the same calls.

    ``setup`` is the method's per-call set-up (for Positional LSH: drawing the masks and
    building their layout; nothing for exact attention), ``attend`` the attention. Forward +
    backward when ``backward``. Peak memory is measured first, in one more untimed end-to-end
    call; when that call took at least :data:`WARM_AFTER_S` it is the warm-up (the ``warmup``
    calls are skipped): what a first call costs more (heap growth, caches) is then a small part of
    one call, and it falls on the first of the repeats, which their median leaves out.
    ``bench_paper``'s largest cells take 5-80 s a call on a 2-core CPU; this saves a fifth of them.
    """
    import torch

    def call() -> tuple[float, float, Any]:
        synchronize(device)
        t0 = time.perf_counter()
        ready = setup()
        synchronize(device)
        t1 = time.perf_counter()
        if backward:
            for t in inputs:
                t.grad = None
            out = attend(ready)
            out.float().square().sum().backward()
            out = out.detach()
        else:
            with torch.no_grad():
                out = attend(ready)
        synchronize(device)
        return t1 - t0, time.perf_counter() - t1, out

    t0 = time.perf_counter()
    peak, out = peak_memory_mb(lambda: call()[2], device)
    if time.perf_counter() - t0 < WARM_AFTER_S:
        for _ in range(warmup):
            call()
    prep, att, total = [], [], []
    for _ in range(repeats):
        a, b, _ = call()
        prep.append(a)
        att.append(b)
        total.append(a + b)
    return Timing(statistics.median(total), statistics.median(prep), statistics.median(att), peak, out)



def peak_memory_mb(call: Callable[[], Any], device: Any) -> tuple[float, Any]:
    """(peak memory in MiB above what was allocated before, result) of one ``call()``."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = call()
        synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20, out
    mmap_threshold(MEMORY_THRESHOLD)
    try:
        with RssPeak() as mem:
            out = call()
    finally:
        mmap_threshold(TIMING_THRESHOLD)
    return mem.mb, out
