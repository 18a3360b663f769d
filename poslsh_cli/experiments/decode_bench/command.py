"""``poslsh decode-bench``: decoding speed and key/value memory against context length, for exact
ALiBi, windowed ALiBi and Positional LSH on the same model, side by side in one run.

Cells: (context, position, s). A cell prefills ``context`` random tokens through a
:class:`~poslsh_cli.lm.kvcache.ForgettingCache` (exact ALiBi keeps every key; windowed ALiBi the
window; Positional LSH the blocks its samples still hold open), then decodes ``new_tokens`` tokens
one at a time (greedy). Reported: the prefill time, the median seconds per decoded token, the
keys and values held (bytes, and tokens per layer) at the end, and what a cache that keeps every
key would hold. Ratios within one run are what to compare; absolute times depend on the machine and
what else it runs. So in a run with exact ALiBi, a row of another scheme decodes interleaved with the
same model under exact ALiBi, token for token (A B A B ...): ``ref_token_seconds`` is the median of the
exact-ALiBi tokens, the time its speed is compared with. Every row records the load while it was
timed (:class:`~poslsh_cli.experiments.measure.Load`); a speed claim from an overloaded row is
INCONCLUSIVE.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from poslsh_cli.core.config import Spec, key

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.base import Experiment, LMShape, MemoryNeed, attention_bytes, lm_bytes
from poslsh_cli.experiments.devices import Device, resolve_device, synchronize
from poslsh_cli.experiments.measure import LOAD_COLUMNS, LoadProbe, judge_load, load_paragraphs
from poslsh_cli.lm.loading import Arch, arch_key, build_model
from poslsh_cli.attention.scheme import Position, SchemeKeys, model_label, randomized, scheme_key, sigma_label
from poslsh_cli.lm.positions import PositionState
from poslsh_cli.numerics.sampling import derive_seed
from poslsh_cli.verdicts.claims import Groups, Section, Verdict
from poslsh_cli.verdicts.declared import Claim
from poslsh_cli.lm.evaluate import fast_cpu_math
from poslsh_cli.verdicts import plotting

COLUMNS = ("context", "position", "s", "batch", "prefill_seconds", "token_seconds", "tokens_per_s", "kv_bytes",
           "kv_tokens", "full_kv_bytes", "attention_path", "params", "device", "new_tokens", "sigmas",
           "ref_token_seconds", *LOAD_COLUMNS)

ALIBI, WINDOWED, POSLSH = Position.ALIBI.value, Position.WINDOWED.value, Position.POSLSH.value
#: Goals at the longest context measured (at least GOAL_CONTEXT): Positional LSH holds at most
#: 1/KV_GOAL of exact ALiBi's keys and values and decodes at least SPEED_GOAL times as fast.
GOAL_CONTEXT, KV_GOAL, SPEED_GOAL = 65536, 8.0, 4.0
KV_HELD = Claim("decode_bench/kv_held", "decode-bench",
                f"Positional-LSH decoding holds at most 1/{KV_GOAL:g} of exact ALiBi's keys and values",
                f"keys and values held while decoding, poslsh over alibi, at the longest context >= {GOAL_CONTEXT}",
                metric="kv_bytes", sides=({"position": ALIBI}, {"position": POSLSH, "s": "*"}))
DECODES_FASTER = Claim("decode_bench/decodes_faster", "decode-bench",
                       f"Positional LSH decodes at least {SPEED_GOAL:g}x as fast as exact ALiBi",
                       f"median seconds per decoded token, alibi (decoding interleaved with poslsh, token for token) "
                       f"over poslsh, at the longest context >= {GOAL_CONTEXT}", metric="tokens_per_s",
                       sides=({"position": ALIBI}, {"position": POSLSH, "s": "*"}))


@dataclass(frozen=True)
class DecodeBenchSpec(Spec):
    context: tuple[int, ...] = key("context lengths (tokens before decoding)", [1024, 4096, 16384, 65536], ge=1)
    position: tuple[Position, ...] = scheme_key("position", [Position.ALIBI, Position.WINDOWED,
                                                                   Position.POSLSH], "any but rope")
    s: tuple[int, ...] = scheme_key("s", [8], "poslsh only")
    new_tokens: int = key("tokens decoded after the context (median time reported)", 32, ge=1)
    batch: int = key("sequences decoded together", 1, ge=1)
    hidden: int = arch_key("hidden", 64)
    layers: int = arch_key("layers", 2)
    heads: int = arch_key("heads", 8)
    kv_heads: int = arch_key("kv_heads", 8)
    head_dim: int = arch_key("head_dim", 16)
    intermediate: int = arch_key("intermediate", 192)
    sigma: Optional[float] = scheme_key("sigma", None, "one for every head; null: one per head "
                                                      "from the standard ALiBi slopes")
    window_sigmas: float = scheme_key("window_sigmas", 4.0)
    device: Device = key("auto (CUDA when present), cpu, cuda, cuda:N", Device("auto"))

    def check(self) -> None:
        if Position.ROPE in self.position:
            raise ConfigError("position=rope decodes with transformers' own attention; decode-bench compares the "
                              "project's schemes (alibi, windowed, poslsh, fixed_block, none)")


@dataclass
class DecodeBenchContext:
    device: Any
    arch: Arch


def prepare(spec: DecodeBenchSpec) -> DecodeBenchContext:
    fast_cpu_math()
    longest = max(spec.context) + spec.new_tokens
    return DecodeBenchContext(resolve_device(spec.device), Arch.of(spec, longest))


def cells(spec: DecodeBenchSpec, ctx: DecodeBenchContext | None = None) -> list[dict[str, Any]]:
    return [{"context": n, "position": p.value, "s": s} for n in spec.context for p in spec.position
            for s in (spec.s if randomized(p) else (0,))]


def _decoder(spec: DecodeBenchSpec, ctx: DecodeBenchContext, position: Position, s: int) -> tuple[Any, Any, Any]:
    """(position state, model, cache) of ``position``: the same model and weights for every scheme."""
    from poslsh_cli.lm.kvcache import ForgettingCache

    state = PositionState.from_keys(SchemeKeys.of(spec, position=position, s=s, seed=spec.seed), spec.heads)
    model = build_model(ctx.arch, state, derive_seed(spec.seed, "init")).to(ctx.device).eval()
    return state, model, ForgettingCache(model)


def run_cell(spec: DecodeBenchSpec, key: dict[str, Any], ctx: DecodeBenchContext,
             work: Any = None) -> tuple[list[dict], dict]:
    import numpy as np
    import torch

    from poslsh_cli.lm.data import VOCAB
    from poslsh_cli.lm.kvcache import kv_bytes_per_token

    n, position, s = int(key["context"]), Position(key["position"]), int(key["s"])
    rng = np.random.default_rng(derive_seed(spec.seed, "decode-bench", n))
    x = torch.as_tensor(rng.integers(0, VOCAB, size=(spec.batch, n)), device=ctx.device)
    state, model, cache = _decoder(spec, ctx, position, s)
    paired = position is not Position.ALIBI and Position.ALIBI in spec.position  # compared with exact ALiBi
    decoders = [(model, cache)] + ([_decoder(spec, ctx, Position.ALIBI, 0)[1:]] if paired else [])
    tokens, prefill, times, kv = [], [], ([], []), 0
    with torch.no_grad(), LoadProbe(ctx.device) as probe:
        for m, c in decoders:
            synchronize(ctx.device)
            t0 = time.perf_counter()
            tokens.append(m(input_ids=x, cache=c, use_cache=True).logits[:, -1:].argmax(-1))
            synchronize(ctx.device)
            prefill.append(time.perf_counter() - t0)
        state.plans.clear()
        for _ in range(spec.new_tokens):  # A B A B ...: both medians see the same machine
            for i, (m, c) in enumerate(decoders):
                t0 = time.perf_counter()
                tokens[i] = m(input_ids=tokens[i], cache=c, use_cache=True).logits[:, -1:].argmax(-1)
                synchronize(ctx.device)
                times[i].append(time.perf_counter() - t0)
            kv = max(kv, cache.kv_bytes())
    sec = statistics.median(times[0])
    row = {"context": n, "position": position.value, "s": s, "batch": spec.batch, "prefill_seconds": prefill[0],
           "token_seconds": sec, "tokens_per_s": spec.batch / sec, "kv_bytes": kv, "kv_tokens": cache.kept(),
           "full_kv_bytes": kv_bytes_per_token(model) * spec.batch * (n + spec.new_tokens),
           "attention_path": "+".join(sorted(state.plans)), "params": int(sum(p.numel() for p in model.parameters())),
           "device": str(ctx.device), "new_tokens": spec.new_tokens, "sigmas": sigma_label(state.sigmas),
           "ref_token_seconds": statistics.median(times[1]) if times[1] else math.nan, **probe.load.columns()}
    return [row], {}


def alibi_speed(r: Any, a_tps: float) -> float:
    """Exact ALiBi's tokens per second beside row ``r``: from the tokens it decoded interleaved with
    the row (``ref_token_seconds``) where it did, else ``a_tps``, its own row's."""
    ref = float(getattr(r, "ref_token_seconds", math.nan))
    return r.tokens_per_s * r.token_seconds / ref if ref == ref else a_tps


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    head = ["context", "scheme", "tokens/s", "vs alibi", "KV MiB", "vs alibi", "KV tokens/layer", "prefill s"]
    rows = []
    for n, g in df.groupby("context"):
        a = g[g.position == ALIBI]
        a_tps = float(a.tokens_per_s.median()) if len(a) else float("nan")
        a_kv = float(a.kv_bytes.median()) if len(a) else float("nan")
        for r in g.itertuples():
            beside = alibi_speed(r, a_tps)
            rows.append([str(n), model_label(r.position, r.s, 0.0, r.sigmas), f"{r.tokens_per_s:.1f}",
                         f"{r.tokens_per_s / beside:.2f}x" if beside == beside else "-", f"{r.kv_bytes / 2**20:.2f}",
                         f"{r.kv_bytes / a_kv:.4f}x" if a_kv == a_kv and a_kv > 0 else "-", str(int(r.kv_tokens)),
                         f"{r.prefill_seconds:.2f}"])
    return head, rows


def plot(run: Path, df: Any) -> list[Path]:
    plt = plotting.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, ((pos, s, sigmas), g) in enumerate(df.groupby(["position", "s", "sigmas"], sort=False)):
        g = g.sort_values("context")
        label = model_label(pos, s, 0.0, sigmas)
        axes[0].plot(g.context, g.tokens_per_s, "o-", color=f"C{i}", label=label)
        axes[1].plot(g.context, g.kv_bytes / 2**20, "o-", color=f"C{i}", label=label)
    for ax, ylabel in zip(axes, ("decoded tokens per second (median)", "keys and values held (MiB)")):
        plotting.log_axes(ax, "context length (tokens)", ylabel, grid=False)
        ax.grid(alpha=0.3)
    axes[1].legend()
    fig.suptitle(f"Decoding through the key/value cache, batch {int(df.batch.iloc[0])}, {df.device.iloc[0]}")
    return plotting.save(fig, run, "decode")


def report(run: Path, df: Any) -> Section:
    sec = Section("decode-bench", run, "Decoding speed and key/value memory against context length")
    sec.add_table(*summary(df))
    sec.verdicts += claims(df)
    sec.paragraphs += load_paragraphs(df)
    return sec


def claims(df: Any) -> list[Verdict]:
    """Positional LSH against exact ALiBi at the longest context measured (from GOAL_CONTEXT on)."""
    both = [n for n, g in df.groupby("context") if {ALIBI, POSLSH} <= set(g.position)]
    if not both or max(both) < GOAL_CONTEXT:
        why = f"needs alibi and poslsh rows at a context of at least {GOAL_CONTEXT}"
        return [KV_HELD.not_measured(why), DECODES_FASTER.not_measured(why)]
    n = max(both)
    g = df[df.context == n]
    a = g[g.position == ALIBI].iloc[0]
    held, speeds = Groups(), Groups()
    for r in g[g.position == POSLSH].itertuples():
        beside = alibi_speed(r, a.tokens_per_s)
        kv, speed = r.kv_bytes / a.kv_bytes, r.tokens_per_s / beside
        held.add(bool(kv <= 1 / KV_GOAL), f"context {n}, s={int(r.s)}: {r.kv_bytes / 2**20:.2f} / "
                                          f"{a.kv_bytes / 2**20:.2f} MiB = 1/{1 / kv:.0f}")
        speeds.add(bool(speed >= SPEED_GOAL), f"context {n}, s={int(r.s)}: {r.tokens_per_s:.1f} / "
                                              f"{beside:.1f} tokens/s = {speed:.2f}x")
    return [held.verdict(KV_HELD, every=True),
            judge_load(speeds.verdict(DECODES_FASTER, every=True), g[g.position.isin([ALIBI, POSLSH])])]


def memory(spec: DecodeBenchSpec) -> MemoryNeed:
    """Peak bytes of the largest cell: the prefill of the longest context (a forward pass without
    gradients, :func:`~poslsh_cli.experiments.base.lm_bytes`) and every layer's keys and values of
    the context and the decoded tokens (what exact ALiBi's cache holds)."""
    from poslsh_cli.lm.data import VOCAB

    device, n = resolve_device(spec.device), max(spec.context)
    shape = LMShape(VOCAB, spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.head_dim, spec.intermediate)
    kv = 2 * 4.0 * spec.layers * spec.kv_heads * spec.head_dim * spec.batch * (n + spec.new_tokens)
    need = MemoryNeed(0.0, "")
    for p in spec.position:
        s = max(spec.s) if randomized(p) else 0
        att = attention_bytes(p, device, n, spec.batch, spec.heads, spec.head_dim, s)
        b = kv + lm_bytes(shape, spec.batch, n, att, training=False)
        if b > need.bytes:
            need = MemoryNeed(b, f"a context of {spec.batch} x {n} tokens and its keys and values, {p.value}",
                              spec.device)
    return need


EXPERIMENT = Experiment(
    name="decode-bench",
    spec=DecodeBenchSpec,
    help="""Decode through the key/value cache at several context lengths under exact ALiBi,
    windowed ALiBi and Positional LSH (a cache that forgets keys no future query can see):
    tokens per second and the keys and values held, side by side in one run.""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    plot=plot,
    report=report,
    presets=("decode_bench",),
    order=46,
    memory=memory,
)
