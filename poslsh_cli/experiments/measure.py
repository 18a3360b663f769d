"""Timing and memory measurement shared by the benchmarks (``bench``, ``step-bench``,
``decode-bench``): medians of repeated calls after warm-up (CUDA-synchronised), a compared path
timed interleaved with its reference (A B A B ...), the load of the machine while they ran
(:class:`LoadProbe`, and the rule that makes a speed claim from an overloaded row INCONCLUSIVE:
:func:`overload_reason`, :func:`judge_load`), and peak memory: the CUDA allocator's peak on a GPU,
the peak rise of the process's resident set on the CPU (sampled every 0.5 ms, with the heap
handing freed pages back so the resident set follows live tensors).
"""
from __future__ import annotations

import math
import os
import statistics
import threading
import time
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from poslsh_cli.experiments.devices import synchronize
from poslsh_cli.experiments.machine import usable_cores
from poslsh_cli.verdicts.claims import Status


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


# ---------------------------------------------------------------------------------------------
# the load of the machine while a timed block runs

#: Where the load is read (Linux); elsewhere the load columns are NaN and no row is overloaded
PROC = Path("/proc")
#: Seconds between two samples of the load
PROBE_EVERY_S = 0.05
#: Cores the others may hold on average beyond the spare ones before a row is overloaded: a
#: sampled count, in which a kernel thread or a daemon waking now and then is not contention
OVERLOAD_SLACK = 0.25
LOAD_COLUMNS = ("threads", "cores", "load_others", "loadavg", "overloaded")
LOAD_RULE = ("a speed claim is INCONCLUSIVE when a row it uses was measured overloaded: other processes' runnable "
             f"threads (mean over the timed calls) plus the threads the row's path needs (torch's CPU threads; one "
             f"on CUDA) above the cores this process may use, by more than {OVERLOAD_SLACK:g}")


def read_loadavg() -> Optional[tuple[float, int]]:
    """(1-minute load average, runnable threads system-wide: the first number of the 4th field of
    /proc/loadavg, this process's running threads included), or None without /proc."""
    try:
        fields = (PROC / "loadavg").read_text().split()
        return float(fields[0]), int(fields[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def own_running() -> Optional[int]:
    """This process's threads in state R (running or runnable), from /proc/self/task/*/stat; None
    without /proc. The state follows the command name, which may hold spaces and parentheses."""
    try:
        tasks = list((PROC / "self" / "task").iterdir())
    except OSError:
        return None
    running = 0
    for task in tasks:
        try:
            running += (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue  # the thread ended between listing and reading
    return running


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


@dataclass(frozen=True)
class Load:
    """The machine while a timed block ran: ``threads`` torch's CPU threads, ``cores`` the CPUs this
    process may use (:func:`~poslsh_cli.experiments.machine.usable_cores`), ``load_others`` the mean
    number of other processes' runnable threads, ``loadavg`` the 1-minute load average (for
    reference), and ``overloaded``: load_others + the threads the path needs > cores +
    OVERLOAD_SLACK (the others took cores the benchmark needed). A CUDA path needs one CPU thread,
    the one that launches its kernels."""

    threads: int
    cores: float
    load_others: float
    loadavg: float
    overloaded: bool

    def columns(self) -> dict[str, Any]:
        return asdict(self)


class LoadProbe:
    """Samples the load every ``every`` seconds in a thread while the block runs (Linux ``/proc``;
    NaN elsewhere); :attr:`load` is the result. Other processes' runnable threads are the
    system-wide count of /proc/loadavg less this process's own threads in state R, read together."""

    def __init__(self, device: Any = None, every: float = PROBE_EVERY_S) -> None:
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.every = every
        self.others: list[int] = []
        self.loadavg = math.nan

    def _sample(self) -> None:
        system, own = read_loadavg(), own_running()
        if system is not None and own is not None:
            self.loadavg = system[0]
            self.others.append(max(0, system[1] - own))

    def _poll(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> "LoadProbe":
        self.threads, self.cores = torch_threads(), usable_cores()
        self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def load(self) -> Load:
        others = statistics.fmean(self.others) if self.others else math.nan
        need = 1 if self.cuda else self.threads
        return Load(self.threads, self.cores, others, self.loadavg,
                    bool(others == others and others + need > self.cores + OVERLOAD_SLACK))


def load_paragraphs(rows: Any) -> list[str]:
    """The report's sentence on the load while ``rows`` were timed (:func:`overload_reason`), or none."""
    why = overload_reason(rows)
    return [f"Load: {why}; the speed claims that use these rows are INCONCLUSIVE."] if why else []


def overload_reason(rows: Any) -> Optional[str]:
    """Why the times in ``rows`` (a DataFrame of benchmark rows) cannot decide a speed claim: some
    were measured overloaded (:class:`Load`), said with the worst one's load and what to do; None
    when none was (or the rows predate the load columns)."""
    if rows is None or "overloaded" not in getattr(rows, "columns", ()):
        return None
    hit = rows[rows.overloaded.fillna(False).astype(bool)]
    if hit.empty:
        return None
    worst = hit.loc[hit.load_others.astype(float).idxmax()]
    others, cores = float(worst.load_others), float(worst.cores)
    return (f"{len(hit)} of {len(rows)} rows measured while other processes held {min(others, cores):.1f} of the "
            f"{cores:g} cores ({others:.1f} runnable threads, load {float(worst.loadavg):.2f}), threads "
            f"{int(worst.threads)}: rerun alone or with OMP_NUM_THREADS={max(1, int(cores - others))}")


def judge_load(verdict: Any, rows: Any) -> Any:
    """``verdict`` of a speed claim, INCONCLUSIVE (with :func:`overload_reason` in its evidence and
    :data:`LOAD_RULE` in its rule) when one of ``rows``, the rows it was computed from, was measured
    overloaded; a claim without measurements stays NOT MEASURED."""
    why = overload_reason(rows)
    if why is None or verdict.status is Status.NOT_MEASURED:
        return verdict
    return dataclasses.replace(verdict, status=Status.INCONCLUSIVE, evidence=f"{verdict.evidence}; {why}",
                               rule=f"{verdict.rule}; {LOAD_RULE}")


# ---------------------------------------------------------------------------------------------
# timing


@dataclass(frozen=True)
class Timing:
    seconds: float  # median end-to-end
    prepare_seconds: float  # median of the preparation part
    attention_seconds: float  # median of the attention part
    peak_mem_mb: float
    out: Any
    reference_seconds: float = math.nan  # median end-to-end of the reference, timed interleaved
    load: Optional[Load] = None  # the machine during the timed calls
    totals: tuple = ()  # every timed call's end-to-end seconds
    spent: float = 0.0  # wall seconds of the whole measurement (memory pass and warm-up included)


def timed_call(setup: Callable[[], Any], attend: Callable[[Any], Any], device: Any, backward: bool,
               inputs: tuple[Any, ...]) -> Callable[[], tuple[float, float, Any]]:
    """One call of a path: (seconds of ``setup()``, seconds of ``attend``, output)."""
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

    return call


def measure(setup: Callable[[], Any], attend: Callable[[Any], Any], device: Any, repeats: int,
            warmup: int, backward: bool, inputs: tuple[Any, ...],
            reference: Optional[tuple[Callable[[], Any], Callable[[Any], Any]]] = None,
            progress: Optional[Callable[[int, int, str], None]] = None) -> Timing:
    """Time ``attend(setup())``: end to end and each part, within the same calls.

    ``setup`` is the method's per-call set-up (for Positional LSH: drawing the masks and
    building their layout; nothing for exact attention), ``attend`` the attention. Forward +
    backward when ``backward``. Peak memory is measured first, in one more untimed end-to-end
    call; when that call took at least :data:`WARM_AFTER_S` it is the warm-up (the ``warmup``
    calls are skipped): what a first call costs more (heap growth, caches) is then a small part of
    one call, and it falls on the first of the repeats, which their median leaves out.
    ``bench_paper``'s largest cells take 5-80 s a call on a 2-core CPU; this saves a fifth of them.

    ``reference``, a (setup, attend) pair of the path this one is compared with, is warmed up the
    same way (without a memory pass) and timed alternately with it (A B A B ...), so both medians
    see the same machine: a ratio of the two stays honest when the load changes during the run.
    The load is sampled during the timed calls (:class:`LoadProbe`). ``progress(done, total, text)``
    hears each call as it finishes (a large cell's calls take a minute on a busy machine).
    """
    say = progress or (lambda done, total, text: None)
    call = timed_call(setup, attend, device, backward, inputs)
    other = timed_call(*reference, device, backward, inputs) if reference is not None else None
    t0 = time.perf_counter()
    say(0, repeats, "memory and warm-up call")
    peak, out = peak_memory_mb(lambda: call()[2], device)
    if time.perf_counter() - t0 < WARM_AFTER_S:
        for _ in range(warmup):
            call()
    for _ in range(warmup if other is not None else 0):
        a, b, _ = other()
        if a + b >= WARM_AFTER_S:
            break
    prep, att, total, ref = [], [], [], []
    with LoadProbe(device) as probe:
        for i in range(repeats):
            a, b, _ = call()
            prep.append(a)
            att.append(b)
            total.append(a + b)
            if other is not None:
                a, b, _ = other()
                ref.append(a + b)
            say(i + 1, repeats, "timed calls")
    return Timing(statistics.median(total), statistics.median(prep), statistics.median(att), peak, out,
                  statistics.median(ref) if ref else math.nan, probe.load, tuple(total), time.perf_counter() - t0)


class SharedReference:
    """A reference path timed beside a group of rows instead of in full beside each (``bench``'s exact
    ALiBi beside every row of one (n, causal)): its calls interleave with the rows' measurements, one
    call whenever the reference's timed seconds fall behind the rows' (so the group costs at most about
    twice the rows' and the reference's own timings), and a row's reference time is the median of every
    reference call up to and just after it."""

    def __init__(self, call: Callable[[], tuple[float, float, Any]]):
        self.call = call
        self.calls: list[float] = []
        self.ref_spent = 0.0
        self.rows_spent = 0.0
        self.warm = False

    def add(self, seconds: Sequence[float], spent: float = 0.0) -> None:
        """The reference's own timed calls (its cell, measured apart)."""
        self.calls.extend(seconds)
        self.ref_spent += spent or sum(seconds)
        self.warm = True

    def after_row(self, spent: float) -> float:
        """Count a row's measurement (``spent`` wall seconds), call the reference while it is behind
        (warming it up first if it has not run in this process), and return its median so far."""
        self.rows_spent += spent
        if not self.warm:
            self.call()
            self.warm = True
        while not self.calls or self.ref_spent < self.rows_spent:
            a, b, _ = self.call()
            self.calls.append(a + b)
            self.ref_spent += a + b
        return statistics.median(self.calls)


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
