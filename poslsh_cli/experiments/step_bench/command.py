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

import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

from poslsh_cli.attention.plan import Backend, Plan, backends_of, union_band_bound
from poslsh_cli.core.config import Spec, key
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.base import Experiment, LMShape, MemoryNeed, choices, lm_bytes
from poslsh_cli.experiments.devices import Device, Precision, autocast, resolve_device, synchronize
from poslsh_cli.experiments.measure import LOAD_COLUMNS, LoadProbe, peak_memory_mb
from poslsh_cli.experiments.step_bench.report import plot, report, summary
from poslsh_cli.attention.scheme import Position, SchemeKeys, method_of, randomized, scheme_key, sigma_label
from poslsh_cli.lm.positions import PositionState
from poslsh_cli.lm.loading import Arch, arch_key, build_model
from poslsh_cli.numerics.sampling import bandwidths, derive_seed
from poslsh_cli.lm.evaluate import fast_cpu_math
from poslsh_cli.attention import plan_for

COLUMNS = ("seq_len", "position", "s", "backend", "attention_path", "batch", "step_seconds", "tokens_per_s",
           "peak_mem_mb", "params", "device", "steps", "sigmas", "precision", "ref_position", "ref_backend", "ref_path",
           "ref_step_seconds", *LOAD_COLUMNS, "mask_seconds", "mask_share")

ROPE, ALIBI, POSLSH = Position.ROPE.value, Position.ALIBI.value, Position.POSLSH.value
DENSE = Backend.DENSE.value

#: Attention paths a cell may ask for: auto (the plan, as poslsh train) or a forced backend.
StepBackend = choices("StepBackend", [Backend.DENSE, Backend.RANK1, Backend.BLOCKS, Backend.CHUNKED, Backend.UNION,
                                     Backend.FLEX], __name__, AUTO="auto")


@dataclass(frozen=True)
class StepBenchSpec(Spec):
    seq_len: tuple[int, ...] = key("training lengths L", [256, 1024], ge=2)
    position: tuple[Position, ...] = scheme_key("position", [Position.ROPE, Position.ALIBI, Position.POSLSH])
    s: tuple[int, ...] = scheme_key("s", [10, 20], "poslsh only")
    backend: tuple[StepBackend, ...] = key("attention paths: auto (the plan, as poslsh train), or a forced backend: "
                                           + ", ".join(b.value for b in StepBackend if b.value != "auto")
                                           + " (each where the scheme has it)",
                                           [StepBackend.AUTO, StepBackend.DENSE, StepBackend.RANK1], noun="backend")
    batch: int = key("sequences per step", 16, ge=1)
    steps: int = key("timed steps (median reported)", 5, ge=1)
    warmup: int = key("untimed steps first", 2, ge=0)
    hidden: int = arch_key("hidden", 128)
    layers: int = arch_key("layers", 4)
    heads: int = arch_key("heads", 8)
    sigma: Optional[float] = scheme_key("sigma", None, "one for every head (the paper's code: "
                                        "256); null: one per head from the standard ALiBi slopes")
    sigma_ratio: Optional[float] = key("one sigma for every head at this fraction of each L (the paper's 256 / 8192 = "
                                       "0.03125); null: sigma=", None, gt=0)
    batch_tokens: Optional[int] = key("tokens per step: the batch at each L is this over L (at least 1); null: batch=",
                                      None, ge=1)
    kv_heads: int = arch_key("kv_heads", 8)
    head_dim: int = arch_key("head_dim", 16)
    intermediate: int = arch_key("intermediate", 384)
    precision: Precision = key("fp32, bf16 or fp16: the arithmetic of the forward and backward passes (autocast, "
                               "as poslsh train; fp16 on CUDA only)", Precision.FP32)
    device: Device = key("auto (CUDA when present), cpu, cuda, cuda:N", Device("auto"))

    def check(self) -> None:
        if self.sigma is not None and self.sigma_ratio is not None:
            raise ConfigError("sigma= and sigma_ratio= both set the bandwidth: give one")
        asked = [b for b in self.backend if b.value != "auto"]
        if Position.ROPE in self.position and StepBackend.AUTO not in self.backend:
            raise ConfigError(f"position=rope runs on its own attention only (backend auto), and backend="
                              f"{[b.value for b in self.backend]} leaves auto out: add auto, or leave rope out")
        for p in self.position:
            if p is Position.ROPE or not asked:
                continue
            if not any(_has(p, b.value) for b in asked) and StepBackend.AUTO not in self.backend:
                raise ConfigError(f"position={p.value} runs on none of backend={[b.value for b in asked]} "
                                  f"(it has {', '.join(b.value for b in backends_of(method_of(p)))})")


def _has(position: Position, backend: str) -> bool:
    return Backend(backend) in backends_of(method_of(position))


def sigma_at(spec: "StepBenchSpec", n: int) -> Optional[float]:
    """The one sigma of every head at length n (``sigma_ratio`` of n, or ``sigma``), None for the
    standard slopes."""
    return spec.sigma_ratio * n if spec.sigma_ratio is not None else spec.sigma


def batch_at(spec: "StepBenchSpec", n: int) -> int:
    """Sequences per step at length n."""
    return max(1, spec.batch_tokens // n) if spec.batch_tokens is not None else spec.batch


@dataclass
class StepBenchContext:
    device: Any
    arch: Arch


def prepare(spec: StepBenchSpec) -> StepBenchContext:
    fast_cpu_math()
    return StepBenchContext(resolve_device(spec.device), Arch.of(spec, max(8192, 4 * max(spec.seq_len))))


def planned(position: Position, backend: str, n: int, device: Any, s: int = 0, sigma: Optional[float] = None,
            heads: int = 8, draw: bool = True) -> Any:
    """The plan a training step at length n takes (cells are told apart by its label; the
    ``attention_path`` column is recorded from the run itself): the plan with the cost model of one
    draw of the step's masks, as a training step chooses it (RoPE: SDPA without bias). ``draw=False``:
    without drawing them (the plan from sizes alone; O(1) memory whatever n)."""
    import numpy as np
    import torch

    from poslsh_cli.attention import AttentionSpec, Method, Plan, choose
    from poslsh_cli.attention.api import work_of

    if position is Position.ROPE:
        return Plan(Method.NO_BIAS, Backend.SDPA)
    method = method_of(position)
    work = None
    if draw and randomized(position) and torch.device(device).type == "cpu" and backend == "auto":
        spec = AttentionSpec.build(method, bandwidths(heads, sigma), n, True, s=s, rng=np.random.default_rng(0))
        work = work_of(spec, n)
    return choose(method, device=device, dtype=torch.float32, n=n, causal=True, grad=True, backend=backend,
                  s=s, work=work)


def mask_seconds(state: PositionState, n: int, layers: int, device: Any, steps: int = 3) -> float:
    """Seconds a training step spends drawing its masks and building what its attention path needs
    from them (every layer: the drawn partitions, then the dense ``log M~`` bias, the block layout or
    the union's sorted block ends), timed apart from the step: the median over ``steps`` fresh steps. 0 for a
    scheme that draws no masks."""
    import dataclasses

    import torch

    from poslsh_cli.attention.api import layout_for, work_of
    from poslsh_cli.attention.dense import poslsh_bias

    if state.position is Position.ROPE or not randomized(state.position):
        return 0.0
    fresh = dataclasses.replace(state, plans=set(), _cache={})
    probe = torch.zeros(1, len(state.sigmas), n, 1, device=device, requires_grad=True)
    times = []
    for t in range(steps):
        fresh.step = 10**6 + t  # steps no timed step drew
        synchronize(device)
        t0 = time.perf_counter()
        for layer in range(layers):
            spec = fresh.attention_spec(layer, n, None)
            plan = plan_for(spec.method, probe, probe, probe, True, state.backend, work=work_of(spec, n),
                            s=spec.partitions[0].num_samples)
            if plan.backend is Backend.DENSE:
                poslsh_bias(spec.partitions, True, device)
            else:
                layout_for(spec, plan, device, grad=True)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
                for s in (spec.s if randomized(p) else (0,)):
                    path = (planned(p, b.value, n, device, s, sigma_at(spec, n), spec.heads).label, s)
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

    from poslsh_cli.lm.data import VOCAB

    keys = SchemeKeys.of(spec, position=position, s=s, seed=spec.seed, sigma=sigma_at(spec, x.shape[1] - 1),
                         backend=backend)
    state = PositionState.from_keys(keys, spec.heads)
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

    n, position, s, backend = key["seq_len"], Position(key["position"]), key["s"], key["backend"]
    rng = np.random.default_rng(derive_seed(spec.seed, "step-bench", n))
    batch = batch_at(spec, n)
    x = torch.as_tensor(rng.integers(0, VOCAB, size=(batch, n + 1)), device=ctx.device)
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
    masks = mask_seconds(state, n, spec.layers, ctx.device)
    row = {"seq_len": n, "position": position.value, "s": s, "backend": backend, "attention_path": _path(state),
           "batch": batch, "step_seconds": sec, "tokens_per_s": batch * n / sec, "peak_mem_mb": peak,
           "params": int(sum(p.numel() for p in model.parameters())), "device": str(ctx.device), "steps": spec.steps,
           "sigmas": sigma_label(state.sigmas) if position is not Position.ROPE else "",
           "precision": spec.precision.value, "ref_position": ref[0].value if ref else "",
           "ref_backend": ref[1] if ref else "", "ref_path": _path(paths[1][0]) if ref else "",
           "ref_step_seconds": statistics.median(ref_times) if ref_times else float("nan"), **probe.load.columns(),
           "mask_seconds": masks, "mask_share": masks / sec}
    return [row], {}


def memory(spec: StepBenchSpec) -> MemoryNeed:
    """Peak bytes of the largest cell's training step, at the longest L on the path each cell
    takes (:func:`poslsh_cli.experiments.base.lm_bytes`)."""
    from poslsh_cli.lm.data import VOCAB

    device, n = resolve_device(spec.device), max(spec.seq_len)
    shape = LMShape(VOCAB, spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.head_dim, spec.intermediate)
    need = MemoryNeed(0.0, "")
    batch = batch_at(spec, n)
    # from the sizes alone (no masks drawn: a length past memory is refused before anything of its
    # size exists); where the plan would weigh the drawn masks, the larger of its two paths
    for p in spec.position:
        for backend in (spec.backend if p is not Position.ROPE else (StepBackend.AUTO,)):
            if backend.value != "auto" and not _has(p, backend.value):
                continue
            for s in (spec.s if randomized(p) else (0,)):
                plan = planned(p, backend.value, n, device, s, sigma_at(spec, n), spec.heads, draw=False)
                att = plan.memory_bytes(batch, spec.heads, n, spec.head_dim, s, training=True)
                if randomized(p) and backend.value == "auto" and device.type == "cpu":
                    # the plan may take the union by the masks drawn, only while its band is under the cap
                    outputs = Plan(plan.method, Backend.SDPA).memory_bytes(batch, spec.heads, n, spec.head_dim, 0, True)
                    att = max(att, outputs + union_band_bound(spec.heads, n, s, capped=True))
                b = lm_bytes(shape, batch, n, att, training=True)
                if b > need.bytes:
                    need = MemoryNeed(b, f"a training step of {batch} x {n} tokens, {p.value} on {plan.label}",
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
    presets=("step_bench", "step_bench_ratio", "step_bench_long"),
    order=45,
    memory=memory,
)
