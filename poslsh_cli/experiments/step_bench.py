"""``poslsh step-bench``: the cost of a training step (forward, backward, AdamW) of the same
model under each position scheme and attention path, side by side in one run.

Cells: (L, position, s, backend). ``backend=auto`` is what ``poslsh train`` uses (the attention
plan, :func:`poslsh_cli.attention.choose`: causal ALiBi as one extra q/k coordinate on the
bias-free causal SDPA kernel, Positional LSH as one dense attention with the bias ``log M~`` at
short lengths); ``backend=dense`` forces the dense-bias route, so exact ALiBi and Positional LSH
can be compared through the same kernel. The ``attention_path`` column is the label of the plan
that actually ran in the timed steps (recorded by the attention layers). Seconds per step are the median of ``steps`` timed steps after
``warmup``; memory is the peak rise (CUDA allocator, or the process's resident set on the CPU)
during one more step. Ratios within the run are what to compare; absolute times depend on the
machine and what else it runs.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Iterator

from poslsh_cli.attention.plan import BACKENDS, Backend
from poslsh_cli.verdicts.claims import Section, Status, Verdict, combine, crossover
from poslsh_cli.core.config import ConfigError, Spec, key
from poslsh_cli.experiments.base import (Device, Experiment, LMShape, MemoryNeed, attention_bytes, choices, lm_bytes,
                                         resolve_device, synchronize)
from poslsh_cli.numerics.methods import INFO
from poslsh_cli.lm.positions import Position, PositionState, method_of, sigma_label
from poslsh_cli.lm.loading import Arch
from poslsh_cli.numerics.sampling import derive_seed

COLUMNS = ("seq_len", "position", "s", "backend", "attention_path", "batch", "step_seconds", "tokens_per_s",
           "peak_mem_mb", "params", "device", "steps", "sigmas")

ROPE, ALIBI, POSLSH = Position.ROPE.value, Position.ALIBI.value, Position.POSLSH.value

#: Goals checked by the report: ALiBi against RoPE, Positional LSH against exact ALiBi through the
#: same dense-bias route, Positional LSH against exact ALiBi on the paths training takes at long
#: context (step time ratio per L), and its peak memory against exact ALiBi's at every L.
ALIBI_GOAL, POSLSH_GOAL = 1.5, 1.3
LONG_GOALS = {8192: 1.0, 16384: 0.5}
MEMORY_GOAL = 1.5


#: Attention paths a cell may ask for: auto (the plan, as poslsh train) or a forced backend.
StepBackend = choices("StepBackend", [Backend.DENSE, Backend.RANK1, Backend.BLOCKS, Backend.CHUNKED], __name__,
                      AUTO="auto")


@dataclass(frozen=True)
class StepBenchSpec(Spec):
    seq_len: tuple[int, ...] = key("training lengths L", [256, 1024], ge=2)
    position: tuple[Position, ...] = key("position schemes", [Position.ROPE, Position.ALIBI, Position.POSLSH],
                                         noun="position")
    s: tuple[int, ...] = key("Positional-LSH masks per head (poslsh only)", [10, 20], ge=1)
    backend: tuple[StepBackend, ...] = key("attention paths: auto (the plan, as poslsh train), or a forced backend: "
                                           + ", ".join(b.value for b in StepBackend if b.value != "auto")
                                           + " (each where the scheme has it)",
                                           [StepBackend.AUTO, StepBackend.DENSE, StepBackend.RANK1], noun="backend")
    batch: int = key("sequences per step", 16, ge=1)
    steps: int = key("timed steps (median reported)", 5, ge=1)
    warmup: int = key("untimed steps first", 2, ge=0)
    hidden: int = key("model width", 128, ge=1)
    layers: int = key("decoder layers", 4, ge=1)
    heads: int = key("attention heads", 8, ge=1)
    sigma: Optional[float] = key("one sigma for every head (the paper's code: 256); null: one per head from the "
                                 "standard ALiBi slopes", None, gt=0)
    kv_heads: int = key("key/value heads", 8, ge=1)
    head_dim: int = key("head dimension", 16, ge=1)
    intermediate: int = key("MLP width", 384, ge=1)
    device: Device = key("auto (CUDA when present), cpu, cuda, cuda:N", Device("auto"))

    def check(self) -> None:
        asked = [b for b in self.backend if b.value != "auto"]
        for p in self.position:
            if p is Position.ROPE or not asked:
                continue
            if not any(_has(p, b.value) for b in asked) and StepBackend.AUTO not in self.backend:
                raise ConfigError(f"position={p.value} runs on none of backend={[b.value for b in asked]} "
                                  f"(it has {', '.join(b.value for b in BACKENDS[method_of(p)])})")


def _has(position: Position, backend: str) -> bool:
    return Backend(backend) in BACKENDS[method_of(position)]


@dataclass
class StepBenchContext:
    device: Any
    arch: Arch


def prepare(spec: StepBenchSpec) -> StepBenchContext:
    from poslsh_cli.lm.evaluate import fast_cpu_math

    fast_cpu_math()
    return StepBenchContext(resolve_device(spec.device), Arch(spec.hidden, spec.layers, spec.heads, spec.kv_heads,
                                                     spec.intermediate, spec.head_dim, max(8192, 4 * max(spec.seq_len))))


def planned(position: Position, backend: str, n: int, device: Any) -> str:
    """The label of the plan a training step at length n takes (what the cells are told apart by;
    the ``attention_path`` column is recorded from the run itself)."""
    import torch

    from poslsh_cli.attention import choose

    if position is Position.ROPE:
        return "sdpa+rope"
    return choose(method_of(position), device=device, dtype=torch.float32, n=n, causal=True, grad=True,
                  backend=backend).label


def cells(spec: StepBenchSpec, ctx: StepBenchContext | None = None) -> list[dict[str, Any]]:
    """One cell per distinct path: a backend the scheme does not have, or one that resolves to a
    path already listed, is skipped."""
    import torch

    device = ctx.device if ctx is not None else torch.device("cpu")
    out = []
    for n in spec.seq_len:
        for p in spec.position:
            seen = set()
            for b in (spec.backend if p is not Position.ROPE else (StepBackend.AUTO,)):
                if b.value != "auto" and not _has(p, b.value):
                    continue
                path = planned(p, b.value, n, device)
                if path in seen:
                    continue
                seen.add(path)
                for s in (spec.s if p is not Position.ROPE and INFO[method_of(p)].randomized else (0,)):
                    out.append({"seq_len": n, "position": p.value, "s": s, "backend": b.value})
    return out


def run_cell(spec: StepBenchSpec, key: dict[str, Any], ctx: StepBenchContext, work: Any = None) -> tuple[list[dict], dict]:
    import numpy as np
    import torch

    from poslsh_cli.lm.data import VOCAB
    from poslsh_cli.experiments.measure import peak_memory_mb
    from poslsh_cli.lm.loading import build_model

    n, position, s, backend = key["seq_len"], Position(key["position"]), key["s"], key["backend"]
    state = (PositionState.standard(position, spec.heads, num_samples=s, seed=spec.seed, backend=backend)
             if spec.sigma is None else PositionState(position, [spec.sigma] * spec.heads, num_samples=s,
                                                      seed=spec.seed, backend=backend))
    model = build_model(ctx.arch, state, derive_seed(spec.seed, "init")).to(ctx.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(derive_seed(spec.seed, "step-bench", n))
    x = torch.as_tensor(rng.integers(0, VOCAB, size=(spec.batch, n + 1)), device=ctx.device)

    def step(t: int) -> float:
        state.step = t  # fresh masks every step, as in training
        synchronize(ctx.device)
        t0 = time.perf_counter()
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        synchronize(ctx.device)
        return time.perf_counter() - t0

    for t in range(spec.warmup):
        step(t)
    state.plans.clear()
    times = [step(spec.warmup + t) for t in range(spec.steps)]
    path = "sdpa+rope" if position is Position.ROPE else "+".join(sorted(state.plans))
    peak, _ = peak_memory_mb(lambda: step(-1), ctx.device)
    sec = statistics.median(times)
    row = {"seq_len": n, "position": position.value, "s": s, "backend": backend, "attention_path": path,
           "batch": spec.batch, "step_seconds": sec, "tokens_per_s": spec.batch * n / sec, "peak_mem_mb": peak,
           "params": int(sum(p.numel() for p in model.parameters())), "device": str(ctx.device), "steps": spec.steps,
           "sigmas": sigma_label(state.sigmas) if position is not Position.ROPE else ""}
    return [row], {}


def _time(g: Any, position: str, path: str | None = None, s: int | None = None) -> float:
    sel = g[g.position == position]
    if path is not None:
        sel = sel[sel.attention_path == path]
    if s is not None:
        sel = sel[sel.s == s]
    return float(sel.step_seconds.median()) if len(sel) else float("nan")


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    head = ["L", "position", "s", "path", "s/step", "tokens/s", "peak MiB", "vs rope", "vs alibi dense"]
    rows = []
    for n, g in df.groupby("seq_len"):
        rope, dense = _time(g, ROPE), _time(g, ALIBI, Backend.DENSE.value)
        for r in g.itertuples():
            rows.append([str(n), r.position, str(r.s) if r.s else "-", r.attention_path, f"{r.step_seconds:.3f}",
                         f"{r.tokens_per_s:.0f}", f"{r.peak_mem_mb:.0f}",
                         f"{r.step_seconds / rope:.2f}x" if rope == rope else "-",
                         f"{r.step_seconds / dense:.2f}x" if dense == dense else "-"])
    return head, rows


def plot(run: Path, df: Any) -> list[Path]:
    from poslsh_cli.verdicts.plotting import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    labels = [f"{r.position}{f' s={r.s}' if r.s else ''}\n{r.attention_path}" for r in df.drop_duplicates(
        ["position", "s", "attention_path"]).itertuples()]
    keys = df.drop_duplicates(["position", "s", "attention_path"])[["position", "s", "attention_path"]]
    width = 0.8 / max(1, df.seq_len.nunique())
    for i, (n, g) in enumerate(df.groupby("seq_len")):
        vals = [float(g[(g.position == k.position) & (g.s == k.s) & (g.attention_path == k.attention_path)]
                      .step_seconds.median()) for k in keys.itertuples()]
        ax.bar([j + i * width for j in range(len(keys))], vals, width=width, label=f"L={n}", color=f"C{i}")
    ax.set_xticks([j + width * (df.seq_len.nunique() - 1) / 2 for j in range(len(keys))], labels, fontsize=8)
    ax.set_ylabel("seconds per training step (median)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"Training step cost, batch {int(df.batch.iloc[0])}, {df.device.iloc[0]}")
    return save(fig, run, "step_time")


def report(run: Path, df: Any) -> Section:
    import pandas as pd

    sec = Section("step-bench", run, "Training-step cost of each position scheme")
    head, rows = summary(df)
    sec.tables.append(pd.DataFrame(rows, columns=head))
    sec.verdicts += claim_alibi_near_rope(df)
    sec.verdicts += claim_dense_route(df)
    sec.verdicts += claim_long_context(df)
    sec.verdicts += claim_memory(df)
    sec.paragraphs += crossover_findings(df)
    return sec


def _auto(g: Any, position: str, s: int | None = None) -> Any:
    sel = g[(g.position == position) & (g.backend == "auto")]
    return sel[sel.s == s] if s is not None else sel


def _poslsh_and_alibi(df: Any, column: str) -> Iterator[tuple[int, int, float, float]]:
    """(L, s, Positional LSH, exact ALiBi): medians of ``column`` on the plan's path (backend=auto),
    for every L and s where both were measured."""
    for n, g in df.groupby("seq_len"):
        a = float(_auto(g, ALIBI)[column].median())
        for s in sorted(_auto(g, POSLSH).s.unique()):
            p = float(_auto(g, POSLSH, s)[column].median())
            if a == a and p == p:
                yield int(n), int(s), p, a


def claim_alibi_near_rope(df: Any) -> list[Verdict]:
    st, ev = [], []
    for n, g in df.groupby("seq_len"):
        rope, fast = _time(g, ROPE), float(_auto(g, ALIBI).step_seconds.median())
        if rope == rope and fast == fast:
            st.append(Status.SUPPORTED if fast / rope <= ALIBI_GOAL else Status.NOT_SUPPORTED)
            ev.append(f"L={n}: {fast / rope:.2f}x")
    return [Verdict(f"causal exact ALiBi trains within {ALIBI_GOAL}x the step time of RoPE (SDPA)", combine(st),
                    "; ".join(ev) or "needs rope and alibi (auto) rows",
                    "median step time of alibi on the path poslsh train takes (auto) over rope, at every L")]


def claim_dense_route(df: Any) -> list[Verdict]:
    st, ev = [], []
    for n, g in df.groupby("seq_len"):
        dense = _time(g, ALIBI, Backend.DENSE.value)
        for s in sorted(g[g.position == POSLSH].s.unique()):
            p = _time(g, POSLSH, Backend.DENSE.value, s)
            if dense == dense and p == p:
                st.append(Status.SUPPORTED if p / dense <= POSLSH_GOAL else Status.NOT_SUPPORTED)
                ev.append(f"L={n} s={s}: {p / dense:.2f}x")
    return [Verdict(f"a Positional-LSH step costs at most {POSLSH_GOAL}x exact ALiBi through the same dense-bias "
                    "route, whatever s", combine(st), "; ".join(ev) or "needs poslsh and alibi with backend=dense rows",
                    "median step time ratio at every L and s")]


def claim_long_context(df: Any) -> list[Verdict]:
    """Near-linear training: Positional LSH (the plan's path) at most LONG_GOALS[L] times exact ALiBi's
    step time at each goal length measured."""
    st, ev = [], []
    for n, s, p, a in _poslsh_and_alibi(df, "step_seconds"):
        ev.append(f"L={n} s={s}: {p / a:.2f}x")
        if n in LONG_GOALS:
            st.append(Status.SUPPORTED if p / a <= LONG_GOALS[n] else Status.NOT_SUPPORTED)
    goals = ", ".join(f"{g}x at L={n}" for n, g in LONG_GOALS.items())
    status = combine(st) if st else Status.NOT_MEASURED
    return [Verdict(f"Positional LSH trains at least as fast as exact ALiBi at long context ({goals})", status,
                    "; ".join(ev) or "needs poslsh and alibi rows with backend=auto",
                    "median step time of poslsh over alibi, both on the path poslsh train takes, at each goal length "
                    "measured (NOT MEASURED without one)")]


def claim_memory(df: Any) -> list[Verdict]:
    st, ev = [], []
    for n, s, p, a in _poslsh_and_alibi(df, "peak_mem_mb"):
        if a > 0:
            st.append(Status.SUPPORTED if p / a <= MEMORY_GOAL else Status.NOT_SUPPORTED)
            ev.append(f"L={n} s={s}: {p:.0f} / {a:.0f} MiB = {p / a:.2f}x")
    return [Verdict(f"a Positional-LSH training step needs at most {MEMORY_GOAL}x exact ALiBi's peak memory", combine(st),
                    "; ".join(ev) or "needs poslsh and alibi rows with backend=auto",
                    "peak memory rise of one step (resident set on the CPU, allocator on CUDA), at every L")]


def crossover_findings(df: Any) -> list[str]:
    """The smallest L from which Positional LSH steps faster than exact ALiBi at every larger L."""
    ratios: dict[int, dict[int, float]] = {}
    for n, s, p, a in _poslsh_and_alibi(df, "step_seconds"):
        ratios.setdefault(s, {})[n] = p / a
    out = []
    for s, ratio in sorted(ratios.items()):
        if len(ratio) < 2:
            continue
        best = crossover(ratio)
        where = f"from L={best} on" if best else "at no measured L"
        out.append(f"Positional LSH s={s} trains faster than exact ALiBi {where} (step-time ratios: "
                   + ", ".join(f"L={n}: {r:.2f}x" for n, r in sorted(ratio.items())) + ").")
    return out


# ---------------------------------------------------------------------------------------------
# memory estimate (memory_check)


def memory(spec: StepBenchSpec) -> MemoryNeed:
    """Peak bytes of the largest cell's training step, at the longest L on the path each cell
    takes (:func:`poslsh_cli.experiments.base.lm_bytes`)."""
    from poslsh_cli.lm.data import VOCAB

    device, n = resolve_device(spec.device), max(spec.seq_len)
    shape = LMShape(VOCAB, spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.head_dim, spec.intermediate)
    need = MemoryNeed(0.0, "")
    for k in cells(spec, StepBenchContext(device, None)):
        if k["seq_len"] == n:
            path = planned(Position(k["position"]), k["backend"], n, device)
            b = lm_bytes(shape, spec.batch, n, attention_bytes(path, spec.batch, spec.heads, n, spec.head_dim, k["s"],
                                                               training=True), training=True)
            if b > need.bytes:
                need = MemoryNeed(b, f"a training step of {spec.batch} x {n} tokens, {k['position']} on {path}",
                                  spec.device)
    return need


EXPERIMENT = Experiment(
    name="step-bench",
    spec=StepBenchSpec,
    help="""Time a training step (forward, backward, AdamW) of the same model under each position
    scheme and attention path, with memory, side by side in one run.""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    plot=plot,
    report=report,
    presets=("step_bench", "step_bench_long"),
    order=45,
    memory=memory,
)
