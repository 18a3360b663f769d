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
machine and what else it runs. So a row times its steps interleaved with those of the scheme it is
compared with, when the run has it (``ref_position``: RoPE for exact ALiBi; exact ALiBi for the
others, on the row's backend where ALiBi has it, else on the plan's path): ``ref_step_seconds`` the
median of those, and the claims take their ratios from these pairs. Every row records the load
while it was timed (:class:`~poslsh_cli.experiments.measure.Load`); a speed claim from an
overloaded row is INCONCLUSIVE.
"""
from __future__ import annotations

import math
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
from poslsh_cli.experiments.measure import LOAD_COLUMNS, judge_load, overload_reason
from poslsh_cli.experiments.stage import Precision
from poslsh_cli.numerics.methods import INFO
from poslsh_cli.lm.positions import Position, PositionState, method_of, sigma_label
from poslsh_cli.lm.loading import Arch
from poslsh_cli.numerics.sampling import derive_seed

COLUMNS = ("seq_len", "position", "s", "backend", "attention_path", "batch", "step_seconds", "tokens_per_s",
           "peak_mem_mb", "params", "device", "steps", "sigmas", "precision", "ref_position", "ref_backend", "ref_path",
           "ref_step_seconds", *LOAD_COLUMNS)

ROPE, ALIBI, POSLSH = Position.ROPE.value, Position.ALIBI.value, Position.POSLSH.value
DENSE = Backend.DENSE.value

#: Goals checked by the report: ALiBi against RoPE, Positional LSH against exact ALiBi through the
#: same dense-bias route, Positional LSH against exact ALiBi on the paths training takes at long
#: context (step time ratio per L), and its peak memory against exact ALiBi's at every L.
ALIBI_GOAL, POSLSH_GOAL = 1.5, 1.3
LONG_GOALS = {8192: 1.0, 16384: 0.5}
MEMORY_GOAL = 1.5
#: On CUDA in bfloat16: exact ALiBi (FlexAttention) within this factor of RoPE's SDPA step
ALIBI_GOAL_CUDA = 1.3
#: The paper's training setting (one sigma = 256 for every head, s = 100 masks, L = 8192): a
#: Positional-LSH step at most this factor of exact ALiBi's, in time and in peak memory
PAPER_SETTING = {"seq_len": 8192, "s": 100, "sigmas": "sigma=256 every head"}
PAPER_GOAL = 1.5


#: Attention paths a cell may ask for: auto (the plan, as poslsh train) or a forced backend.
StepBackend = choices("StepBackend", [Backend.DENSE, Backend.RANK1, Backend.BLOCKS, Backend.CHUNKED, Backend.UNION,
                                     Backend.FLEX], __name__, AUTO="auto")


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
    precision: Precision = key("fp32, bf16 or fp16: the arithmetic of the forward and backward passes (autocast, "
                               "as poslsh train; fp16 on CUDA only)", Precision.FP32)
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


def planned(position: Position, backend: str, n: int, device: Any, s: int = 0) -> str:
    """The label of the plan a training step at length n takes (what the cells are told apart by;
    the ``attention_path`` column is recorded from the run itself)."""
    import torch

    from poslsh_cli.attention import choose

    if position is Position.ROPE:
        return "sdpa+rope"
    return choose(method_of(position), device=device, dtype=torch.float32, n=n, causal=True, grad=True,
                  backend=backend, num_samples=s).label


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
                for s in (spec.s if p is not Position.ROPE and INFO[method_of(p)].randomized else (0,)):
                    path = (planned(p, b.value, n, device, s), s)
                    if path in seen:
                        continue
                    seen.add(path)
                    out.append({"seq_len": n, "position": p.value, "s": s, "backend": b.value})
    return out


def reference(position: Position, backend: str) -> Optional[tuple[Position, str]]:
    """The (scheme, backend) a row's steps are timed interleaved with: RoPE for exact ALiBi; exact
    ALiBi for the others, on the row's backend where ALiBi has it, else on the plan's path."""
    if position is Position.ROPE:
        return None
    if position is Position.ALIBI:
        return Position.ROPE, "auto"
    return Position.ALIBI, backend if backend != "auto" and _has(Position.ALIBI, backend) else "auto"


def _trainer(spec: StepBenchSpec, ctx: StepBenchContext, position: Position, s: int, backend: str,
             x: Any) -> tuple[PositionState, Any, Any]:
    """(position state, model, ``step(t)`` -> seconds of one timed training step on ``x``)."""
    import torch

    from poslsh_cli.experiments.stage import autocast
    from poslsh_cli.lm.data import VOCAB
    from poslsh_cli.lm.loading import build_model

    state = (PositionState.standard(position, spec.heads, num_samples=s, seed=spec.seed, backend=backend)
             if spec.sigma is None else PositionState(position, [spec.sigma] * spec.heads, num_samples=s,
                                                      seed=spec.seed, backend=backend))
    model = build_model(ctx.arch, state, derive_seed(spec.seed, "init")).to(ctx.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(t: int) -> float:
        state.step = t  # fresh masks every step, as in training
        synchronize(ctx.device)
        t0 = time.perf_counter()
        with autocast(spec.precision, ctx.device):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        synchronize(ctx.device)
        return time.perf_counter() - t0

    return state, model, step


def _path(state: PositionState) -> str:
    return "sdpa+rope" if state.position is Position.ROPE else "+".join(sorted(state.plans))


def run_cell(spec: StepBenchSpec, key: dict[str, Any], ctx: StepBenchContext, work: Any = None) -> tuple[list[dict], dict]:
    import numpy as np
    import torch

    from poslsh_cli.lm.data import VOCAB
    from poslsh_cli.experiments.measure import LoadProbe, peak_memory_mb

    n, position, s, backend = key["seq_len"], Position(key["position"]), key["s"], key["backend"]
    rng = np.random.default_rng(derive_seed(spec.seed, "step-bench", n))
    x = torch.as_tensor(rng.integers(0, VOCAB, size=(spec.batch, n + 1)), device=ctx.device)
    state, model, step = _trainer(spec, ctx, position, s, backend, x)
    ref = reference(position, backend)
    ref = ref if ref and ref[0] in spec.position else None  # compared only with a scheme the run measures
    paths = [(state, step)] + ([_trainer(spec, ctx, ref[0], 0, ref[1], x)[0::2]] if ref else [])
    for t in range(spec.warmup):
        for _, f in paths:
            f(t)
    for st, _ in paths:
        st.plans.clear()
    times, ref_times = [], []
    with LoadProbe(ctx.device) as probe:  # A B A B ...: both medians see the same machine
        for t in range(spec.steps):
            for out, (_, f) in zip((times, ref_times), paths):
                out.append(f(spec.warmup + t))
    peak, _ = peak_memory_mb(lambda: step(-1), ctx.device)
    sec = statistics.median(times)
    row = {"seq_len": n, "position": position.value, "s": s, "backend": backend, "attention_path": _path(state),
           "batch": spec.batch, "step_seconds": sec, "tokens_per_s": spec.batch * n / sec, "peak_mem_mb": peak,
           "params": int(sum(p.numel() for p in model.parameters())), "device": str(ctx.device), "steps": spec.steps,
           "sigmas": sigma_label(state.sigmas) if position is not Position.ROPE else "",
           "precision": spec.precision.value, "ref_position": ref[0].value if ref else "",
           "ref_backend": ref[1] if ref else "", "ref_path": _path(paths[1][0]) if ref else "",
           "ref_step_seconds": statistics.median(ref_times) if ref_times else float("nan"), **probe.load.columns()}
    return [row], {}


def _time(g: Any, position: str, path: str | None = None, s: int | None = None) -> float:
    sel = g[g.position == position]
    if path is not None:
        sel = sel[sel.attention_path == path]
    if s is not None:
        sel = sel[sel.s == s]
    return float(sel.step_seconds.median()) if len(sel) else float("nan")


def _paired(rows: Any, ref: str, fallback: float, backend: str | None = None, path: str | None = None) -> float:
    """The step time of the reference ``rows`` were timed interleaved with (the median of their
    ``ref_step_seconds``) when it is ``ref`` (on ``backend``, on ``path``) for every one of them;
    else ``fallback``, the reference's own row (and runs written before the column)."""
    if rows.empty or "ref_step_seconds" not in rows.columns:
        return fallback
    ok = (rows.ref_position == ref) & rows.ref_step_seconds.notna()
    ok &= (rows.ref_backend == backend) if backend is not None else True
    ok &= (rows.ref_path == path) if path is not None else True
    return float(rows.ref_step_seconds.median()) if bool(ok.all()) else fallback


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    paired = "ref_step_seconds" in df.columns  # runs before the column have no such pairs
    head = ["L", "position", "s", "path", "s/step", "tokens/s", "peak MiB", "vs rope", "vs alibi dense"]
    head += ["vs ref (interleaved)"] if paired else []
    rows = []
    for n, g in df.groupby("seq_len"):
        rope, dense = _time(g, ROPE), _time(g, ALIBI, Backend.DENSE.value)
        for r in g.itertuples():
            ref = float(getattr(r, "ref_step_seconds", math.nan))
            rows.append([str(n), r.position, str(r.s) if r.s else "-", r.attention_path, f"{r.step_seconds:.3f}",
                         f"{r.tokens_per_s:.0f}", f"{r.peak_mem_mb:.0f}",
                         f"{r.step_seconds / rope:.2f}x" if rope == rope else "-",
                         f"{r.step_seconds / dense:.2f}x" if dense == dense else "-"]
                        + ([f"{r.step_seconds / ref:.2f}x {r.ref_position}" if math.isfinite(ref) else "-"] if paired
                           else []))
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
    sec.verdicts += claim_paper_setting(df)
    sec.paragraphs += crossover_findings(df)
    why = overload_reason(df)
    if why:
        sec.paragraphs.append(f"Load: {why}; the speed claims that use these rows are INCONCLUSIVE.")
    return sec


def _rows(df: Any, *positions: str) -> Any:
    """The rows of ``positions`` on the plan's path (backend=auto): a claim's evidence."""
    return df[df.position.isin(positions) & (df.backend == "auto")]


def _auto(g: Any, position: str, s: int | None = None) -> Any:
    sel = g[(g.position == position) & (g.backend == "auto")]
    return sel[sel.s == s] if s is not None else sel


def _poslsh_and_alibi(df: Any, column: str) -> Iterator[tuple[int, int, float, float]]:
    """(L, s, Positional LSH, exact ALiBi): medians of ``column`` on the plan's path (backend=auto),
    for every L and s where both were measured; step times of exact ALiBi are those timed
    interleaved with the Positional-LSH rows where the run has them."""
    for n, g in df.groupby("seq_len"):
        a = float(_auto(g, ALIBI)[column].median())
        for s in sorted(_auto(g, POSLSH).s.unique()):
            rows = _auto(g, POSLSH, s)
            p = float(rows[column].median())
            ref = _paired(rows, ALIBI, a, backend="auto") if column == "step_seconds" else a
            if ref == ref and p == p:
                yield int(n), int(s), p, ref


def claim_alibi_near_rope(df: Any) -> list[Verdict]:
    cuda = bool(df.device.astype(str).str.startswith("cuda").any())
    goal = ALIBI_GOAL_CUDA if cuda else ALIBI_GOAL
    st, ev = [], []
    for n, g in df.groupby("seq_len"):
        rope, fast = _paired(_auto(g, ALIBI), ROPE, _time(g, ROPE)), float(_auto(g, ALIBI).step_seconds.median())
        if rope == rope and fast == fast:
            st.append(Status.SUPPORTED if fast / rope <= goal else Status.NOT_SUPPORTED)
            ev.append(f"L={n}: {fast / rope:.2f}x")
    where = " on CUDA" if cuda else ""
    prec = sorted(set(df.precision.dropna().astype(str))) if "precision" in df.columns else ["fp32"]
    return [judge_load(Verdict(f"causal exact ALiBi trains within {goal}x the step time of RoPE (SDPA){where} "
                               f"({', '.join(prec)})", combine(st), "; ".join(ev) or "needs rope and alibi (auto) rows",
                               f"median step time of alibi on the path poslsh train takes (auto) over rope (timed "
                               f"interleaved with it), at every L (goal {ALIBI_GOAL_CUDA}x on CUDA, {ALIBI_GOAL}x on "
                               "the CPU)"), _rows(df, ROPE, ALIBI))]


def claim_paper_setting(df: Any) -> list[Verdict]:
    """The paper's training setting (PAPER_SETTING): Positional LSH's step time and peak memory at most
    PAPER_GOAL x exact ALiBi's, both on the paths training takes."""
    n, s, sig = PAPER_SETTING["seq_len"], PAPER_SETTING["s"], PAPER_SETTING["sigmas"]
    claim = (f"at the paper's setting (L={n}, {sig}, s={s}) a Positional-LSH training step costs at most "
             f"{PAPER_GOAL}x exact ALiBi's step time and memory")
    rule = (f"median step time and peak memory of poslsh s={s} over alibi, both backend=auto, at L={n} with {sig}; "
            "SUPPORTED when both ratios are at most the goal, NOT SUPPORTED when one is above; NOT MEASURED without "
            "those rows")
    g = df[(df.seq_len == n) & (df.sigmas.fillna("").astype(str) == sig)] if "sigmas" in df.columns else None
    a, p = (_auto(g, ALIBI), _auto(g, POSLSH, s)) if g is not None else (None, None)
    if a is None or a.empty or p.empty:
        return [Verdict(claim, Status.NOT_MEASURED, f"no alibi and poslsh s={s} rows at L={n} with {sig}", rule)]
    ref = _paired(p, ALIBI, float(a.step_seconds.median()), backend="auto")
    t, m = float(p.step_seconds.median()) / ref, float(p.peak_mem_mb.median()) / float(a.peak_mem_mb.median())
    ok = t <= PAPER_GOAL and m <= PAPER_GOAL
    verdict = Verdict(claim, Status.SUPPORTED if ok else Status.NOT_SUPPORTED,
                      f"step {p.step_seconds.median():.3f} s ({p.attention_path.iloc[0]}) vs {ref:.3f} s "
                      f"({a.attention_path.iloc[0]}) = {t:.2f}x; memory {p.peak_mem_mb.median():.0f} vs "
                      f"{a.peak_mem_mb.median():.0f} MiB = {m:.2f}x ({p.device.iloc[0]})", rule)
    return [verdict if m > PAPER_GOAL else judge_load(verdict, g[g.index.isin(a.index) | g.index.isin(p.index)])]


def claim_dense_route(df: Any) -> list[Verdict]:
    st, ev = [], []
    for n, g in df.groupby("seq_len"):
        for s in sorted(g[g.position == POSLSH].s.unique()):
            p, rows = _time(g, POSLSH, DENSE, s), g[(g.position == POSLSH) & (g.s == s) & (g.attention_path == DENSE)]
            dense = _paired(rows, ALIBI, _time(g, ALIBI, DENSE), path=DENSE)
            if dense == dense and p == p:
                st.append(Status.SUPPORTED if p / dense <= POSLSH_GOAL else Status.NOT_SUPPORTED)
                ev.append(f"L={n} s={s}: {p / dense:.2f}x")
    return [judge_load(Verdict(f"a Positional-LSH step costs at most {POSLSH_GOAL}x exact ALiBi through the same "
                               "dense-bias route, whatever s", combine(st),
                               "; ".join(ev) or "needs poslsh and alibi with backend=dense rows",
                               "median step time ratio at every L and s (exact ALiBi timed interleaved with it where "
                               "it was)"), df[df.attention_path == DENSE])]


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
    return [judge_load(Verdict(f"Positional LSH trains at least as fast as exact ALiBi at long context ({goals})",
                               status, "; ".join(ev) or "needs poslsh and alibi rows with backend=auto",
                               "median step time of poslsh over alibi (timed interleaved with it), both on the path "
                               "poslsh train takes, at each goal length measured (NOT MEASURED without one)"),
                       _rows(df[df.seq_len.isin(list(LONG_GOALS))], ALIBI, POSLSH))]


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
