"""Capture per-layer Q/K/V of a pretrained model opened by :func:`poslsh_cli.lm.pretrained.load`.

For models whose attention goes through transformers' ``ALL_ATTENTION_FUNCTIONS`` (BERT, Llama,
Mistral, Qwen3, Llama-4) the tensors are captured at the ``sdpa`` entry itself (patched for one
forward pass), so they are exactly what attention uses: after RoPE, after any q/k norm, with the
model's own ``scaling``. Key/value heads of grouped-query attention are expanded to one per
query head the way ``repeat_kv`` does.

ALiBi models compute attention inline (BLOOM, MPT, Falcon with ``alibi=True``, Baichuan's remote
code): their q, k, v are taken from the output of the fused projection (BLOOM and Falcon
interleave q/k/v per head, MPT and Baichuan stack [Q|K|V]) and their own attention context from
the input of the output projection, by forward hooks; their slopes come from the model's own
functions (:data:`poslsh_cli.lm.pretrained.ALIBI_ARCHS`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.pretrained import ALIBI_ARCHS, LoadedModel


@dataclass
class CapturedLayer:
    """What one attention layer used: q, k, v (heads, n, head_dim), with GQA heads expanded."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scaling: float
    causal: bool
    output: torch.Tensor = field(repr=False)  # the model's own attention output (heads, n, head_dim)
    kv_heads: int = 0


@contextmanager
def _capturing(store: list[dict]) -> Iterator[None]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    had_local = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def capture(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, **kwargs: Any) -> Any:
        out = previous(module, query, key, value, attention_mask, **kwargs)
        store.append({"layer": getattr(module, "layer_idx", None), "q": query.detach(), "k": key.detach(),
                      "v": value.detach(), "scaling": kwargs.get("scaling", getattr(module, "scaling", None)),
                      "causal": bool(getattr(module, "is_causal", False)), "out": out[0].detach(),
                      "mask": attention_mask, "sliding_window": kwargs.get("sliding_window")})
        return out

    ALL_ATTENTION_FUNCTIONS["sdpa"] = capture
    try:
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = previous
        else:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]


@torch.no_grad()
def capture_qkv(loaded: LoadedModel, input_ids: torch.Tensor, layers: Sequence[int]) -> dict[int, CapturedLayer]:
    """Run one forward pass and return the attention inputs of ``layers`` (batch 1 squeezed)."""
    if loaded.model_type in ALIBI_ARCHS:
        return _capture_alibi(loaded, input_ids, layers)
    store: list[dict] = []
    device = next(loaded.model.parameters()).device
    with _capturing(store):
        loaded.model(input_ids=input_ids.to(device), use_cache=False)
    if len(store) != loaded.num_layers:
        raise ConfigError(f"captured {len(store)} attention calls for {loaded.num_layers} layers; "
                          f"this {loaded.model_type} model does not route attention through sdpa")
    out = {}
    for order, rec in enumerate(store):
        layer = rec["layer"] if rec["layer"] is not None else order
        if layer not in layers:
            continue
        q, k, v = rec["q"][0], rec["k"][0], rec["v"][0]  # (H, n, d), (Hkv, n, d)
        groups = q.shape[0] // k.shape[0]
        out[layer] = CapturedLayer(q=q, k=k.repeat_interleave(groups, dim=0), v=v.repeat_interleave(groups, dim=0),
                                   scaling=float(rec["scaling"]), causal=rec["causal"],
                                   output=rec["out"][0].transpose(0, 1), kv_heads=int(k.shape[0]))
    return out


def attention_modules(model: Any, mtype: str) -> list[Any]:
    """The attention module of every layer of an ALiBi model, in layer order."""
    arch = ALIBI_ARCHS[mtype]
    found = [m for m in model.modules() if hasattr(m, arch.qkv) and hasattr(m, arch.out)]
    return found


def split_qkv(module: Any, mtype: str, fused: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (B, H, T, d) from the fused projection's output (B, T, 3 H d), as the model splits
    it (MPT's ``clip_qkv`` included)."""
    arch = ALIBI_ARCHS[mtype]
    B, T, three_hd = fused.shape
    d = three_hd // (3 * heads)
    if getattr(module, "clip_qkv", None):
        fused = fused.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    if arch.layout == "interleaved":
        x = fused.view(B, T, heads, 3, d)
        q, k, v = x[..., 0, :], x[..., 1, :], x[..., 2, :]
    else:
        q, k, v = (t.reshape(B, T, heads, d) for t in fused.chunk(3, dim=-1))
    return tuple(t.transpose(1, 2) for t in (q, k, v))


def alibi_scaling(module: Any, mtype: str, head_dim: int) -> float:
    """The logit scale of an ALiBi model's attention (MPT may configure its own)."""
    import math

    return float(getattr(module, "softmax_scale", None) or 1.0 / math.sqrt(head_dim))


def _capture_alibi(loaded: LoadedModel, input_ids: torch.Tensor, layers: Sequence[int]) -> dict[int, CapturedLayer]:
    arch = ALIBI_ARCHS[loaded.model_type]
    mods = attention_modules(loaded.model, loaded.model_type)
    if len(mods) != loaded.num_layers:
        raise ConfigError(f"found {len(mods)} attention modules for {loaded.num_layers} layers in this "
                          f"{loaded.model_type} model")
    fused: dict[int, torch.Tensor] = {}
    context: dict[int, torch.Tensor] = {}
    handles = []
    for i, m in enumerate(mods):
        if i not in layers:
            continue
        handles.append(getattr(m, arch.qkv).register_forward_hook(
            lambda mod, inp, out, i=i: fused.__setitem__(i, out.detach())))
        handles.append(getattr(m, arch.out).register_forward_pre_hook(
            lambda mod, inp, i=i: context.__setitem__(i, inp[0].detach())))
    device = next(loaded.model.parameters()).device
    try:
        loaded.model(input_ids=input_ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    H = loaded.num_heads
    out = {}
    for i in layers:
        q, k, v = (t[0] for t in split_qkv(mods[i], loaded.model_type, fused[i], H))  # (H, n, d)
        d = q.shape[-1]
        ctx = context[i][0].view(-1, H, d).transpose(0, 1)  # (H, n, d): the model's own attention output
        out[i] = CapturedLayer(q=q, k=k, v=v, scaling=alibi_scaling(mods[i], loaded.model_type, d), causal=True,
                               output=ctx, kv_heads=H)
    return out
