"""Positional-LSH attention against exact ALiBi on real model activations.

For each requested layer the model's own q, k, v are captured once; ALiBi slopes (or one sigma)
give a bandwidth per head. Cells: per layer, one per baseline (no bias, fixed block, windowed
exact ALiBi per window) and one per (s, trial) of Positional LSH, all heads at once. Each head
gets a row with its own seed, so ``poslsh sample n=<n> sigma=<sigma> s=<s> seed=<seed>``
replays its masks. Errors are against exact ALiBi in float64.
"""
from __future__ import annotations

import io
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from poslsh_cli.attention import (alibi_chunked, fixed_block_partitions, no_bias_attention,
                                  poslsh_attention)
from poslsh_cli.config import ConfigError
from poslsh_cli.experiments import resolve_device, synchronize, torch_dtype
from poslsh_cli.metrics import output_errors
from poslsh_cli.sampling import alibi_sigmas, derive_seed, sample_partitions

COLUMNS = ["model", "layer", "head", "sigma", "causal", "n", "s", "trial", "seed", "method", "rel_fro",
           "max_row_rel", "seconds", "window", "qkv_file"]

@dataclass(frozen=True)
class OutputErrorRow:
    model: str
    layer: int
    head: int
    sigma: float
    causal: bool
    n: int
    s: int  # 0 for baselines
    trial: int
    seed: int  # -1 where nothing is random
    method: str  # poslsh | fixed_block | no_bias | windowed
    rel_fro: float
    max_row_rel: float
    seconds: float  # wall time of the method for the whole layer (all heads at once)
    window: int  # windowed: w (for the head); else -1
    qkv_file: str


@dataclass
class Context:
    """What every cell of one run shares: captured tensors, bandwidths, exact outputs."""

    model_name: str
    layers: list[int]
    heads: list[int]
    sigmas: np.ndarray  # (len(heads),)
    causal: bool
    device: torch.device
    dtype: torch.dtype
    qkv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]
    input_ids: np.ndarray
    exact: dict[int, torch.Tensor] = field(default_factory=dict)
    files: dict[str, Any] = field(default_factory=dict)  # relative path -> bytes producer


def prepare(cfg: Any) -> Context:
    """Load the checkpoint, tokenise, capture q/k/v of the requested layers (raises ConfigError)."""
    from poslsh_cli import capture

    device = resolve_device(cfg.device)
    path = capture.resolve_model_path(_preset_path(cfg.model), cfg.model.name)
    loaded = capture.load(path, trust_remote_code=cfg.model.trust_remote_code, device=str(device))
    if loaded.max_positions is not None and cfg.n > loaded.max_positions:
        raise ConfigError(f"n={cfg.n} exceeds the model's {loaded.max_positions} positions")
    layers = list(range(loaded.num_layers)) if cfg.layers == "all" else list(cfg.layers)
    heads = list(range(loaded.num_heads)) if cfg.heads == "all" else list(cfg.heads)
    if max(layers) >= loaded.num_layers:
        raise ConfigError(f"layer {max(layers)} out of range: the model has {loaded.num_layers} layers")
    if max(heads) >= loaded.num_heads:
        raise ConfigError(f"head {max(heads)} out of range: the model has {loaded.num_heads} heads")
    ids = capture.tokenize(loaded.tokenizer, capture.read_text(cfg.text), cfg.n)
    captured = capture.capture_qkv(loaded, ids, layers)
    all_sigmas = alibi_sigmas(loaded.num_heads) if cfg.sigma is None else np.full(loaded.num_heads, float(cfg.sigma))
    causal = loaded.causal if cfg.causal == "auto" else cfg.causal == "true"
    qkv = {}
    for layer in layers:
        c = captured[layer]
        sel = torch.as_tensor(heads, device=c.q.device)
        qkv[layer] = (c.q[sel], c.k[sel], c.v[sel], c.scaling)  # (H', n, d) each
    name = cfg.model.name if cfg.model.name != "custom" else str(path)
    ctx = Context(model_name=name, layers=layers, heads=heads, sigmas=all_sigmas[heads], causal=causal,
                  device=device, dtype=torch_dtype(cfg.dtype), qkv=qkv, input_ids=ids[0].numpy())
    if cfg.save_qkv:
        for layer in layers:
            ctx.files[_qkv_file(layer)] = (lambda layer=layer: _npz(ctx, layer))
    del loaded
    return ctx


def _preset_path(model: Any) -> str | None:
    import os

    if model.path:
        return model.path
    root = os.environ.get("POSLSH_MODELS")
    if model.subdir and root:
        return os.path.join(root, model.subdir)
    return None


def _qkv_file(layer: int) -> str:
    return f"qkv/layer{layer}.npz"


def _npz(ctx: Context, layer: int) -> bytes:
    q, k, v, scaling = ctx.qkv[layer]
    buf = io.BytesIO()
    np.savez_compressed(buf, q=q.float().cpu().numpy(), k=k.float().cpu().numpy(), v=v.float().cpu().numpy(),
                        input_ids=ctx.input_ids, heads=np.asarray(ctx.heads), scaling=np.float64(scaling))
    return buf.getvalue()


def cells(cfg: Any, ctx: Context | None = None) -> list[dict[str, Any]]:
    """Grid order: per layer, the baselines, then Positional LSH for each (s, trial).

    Layers are known only after loading (``layers=all``): the runner calls this again with the
    context; without it, the config's explicit list is used.
    """
    layers = ctx.layers if ctx is not None else (list(cfg.layers) if cfg.layers != "all" else [])
    out: list[dict[str, Any]] = []
    for layer in layers:
        for b in cfg.baselines:
            if b == "windowed":
                out += [{"layer": layer, "method": b, "window_sigmas": float(c)} for c in cfg.window_sigmas]
            else:
                out.append({"layer": layer, "method": b})
        out += [{"layer": layer, "method": "poslsh", "s": s, "trial": t} for s in cfg.s for t in range(cfg.trials)]
    return out


def _exact(ctx: Context, layer: int) -> torch.Tensor:
    """Exact ALiBi output of a layer in float64 (chunked: no n x n tensor), cached."""
    if layer not in ctx.exact:
        q, k, v, scaling = ctx.qkv[layer]
        H, n, _ = q.shape
        chunk = max(16, min(1024, int(2**27 // max(1, H * n))))  # about 1 GiB of float64 scores
        sig = torch.as_tensor(ctx.sigmas, dtype=torch.float64)
        ctx.exact[layer] = alibi_chunked(q[None].double().to(ctx.device), k[None].double().to(ctx.device),
                                         v[None].double().to(ctx.device), sig, ctx.causal, chunk=chunk,
                                         scale=scaling)[0]
    return ctx.exact[layer]


def run_cell(cfg: Any, key: dict[str, Any], ctx: Context) -> tuple[list[dict], dict]:
    layer, method = key["layer"], key["method"]
    q, k, v, scaling = ctx.qkv[layer]
    q, k, v = (t[None].to(device=ctx.device, dtype=ctx.dtype) for t in (q, k, v))  # (1, H, n, d)
    n = q.shape[-2]
    exact = _exact(ctx, layer)
    seeds = [-1] * len(ctx.heads)
    s, trial, windows = 0, 0, [-1] * len(ctx.heads)
    synchronize(ctx.device)
    t0 = time.perf_counter()
    if method == "poslsh":
        s, trial = key["s"], key["trial"]
        seeds = [derive_seed(cfg.seed, "output-error", layer, h, s, trial) for h in ctx.heads]
        parts = [sample_partitions(n, float(sg), s, np.random.default_rng(sd)) for sg, sd in zip(ctx.sigmas, seeds)]
        out = poslsh_attention(q, k, v, parts, ctx.causal, scale=scaling)
    elif method == "fixed_block":
        out = poslsh_attention(q, k, v, fixed_block_partitions(n, ctx.sigmas), ctx.causal, scale=scaling)
    elif method == "no_bias":
        out = no_bias_attention(q, k, v, ctx.causal, scale=scaling)
    elif method == "windowed":
        windows = [int(math.ceil(key["window_sigmas"] * sg)) for sg in ctx.sigmas]
        out = alibi_chunked(q, k, v, torch.as_tensor(ctx.sigmas), ctx.causal, window=windows, scale=scaling)
    else:  # pragma: no cover - cells() only makes the methods above
        raise ValueError(method)
    synchronize(ctx.device)
    seconds = time.perf_counter() - t0
    rel_fro, max_row = output_errors(exact, out[0])
    qkv_file = _qkv_file(layer) if cfg.save_qkv else ""
    rows = [OutputErrorRow(model=ctx.model_name, layer=layer, head=h, sigma=float(sg), causal=ctx.causal, n=n, s=s,
                           trial=trial, seed=sd, method=method, rel_fro=float(rf), max_row_rel=float(mr),
                           seconds=seconds, window=w, qkv_file=qkv_file)
            for h, sg, sd, rf, mr, w in zip(ctx.heads, ctx.sigmas, seeds, rel_fro, max_row, windows)]
    return [asdict(r) for r in rows], {}


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    """Per layer: median over heads of the error at the largest s, the fitted slope, baselines."""
    from poslsh_cli.metrics import fit_loglog_slope

    head = ["layer", "slope", "poslsh@s_max", "s_max", "no_bias", "fixed_block", "windowed", "secs"]
    rows = []
    for layer, g in df.groupby("layer", sort=True):
        p = g[g.method == "poslsh"]
        med = p.groupby(["s", "trial"])["rel_fro"].median().reset_index()
        fit = fit_loglog_slope(med["s"], med["rel_fro"]) if len(med) else None
        smax = int(p["s"].max()) if len(p) else 0

        def base(m: str) -> str:
            b = g[g.method == m]
            return f"{b['rel_fro'].median():.4f}" if len(b) else "-"

        top = p[p.s == smax]["rel_fro"].median() if len(p) else float("nan")
        rows.append([str(layer), f"{fit.slope:.3f}" if fit else "-", f"{top:.4f}", str(smax), base("no_bias"),
                     base("fixed_block"), base("windowed"),
                     f"{g.drop_duplicates(['method', 's', 'trial', 'window'])['seconds'].sum():.1f}"])
    return head, rows
