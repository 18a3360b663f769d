"""A key/value cache that forgets what its scheme can no longer attend to (:class:`ForgettingCache`),
so that decoding keeps a bounded number of keys per layer whatever the context length.

Which keys a future query can still see, given the newest position t of a sequence, is each
method's declared forgetting rule (:mod:`poslsh_cli.numerics.methods`, ``forget``):

    Positional LSH   key j is seen by a query t' >= t only if some sample puts j and t' in one
                     block; blocks are contiguous and move forward, so j >= min_k start_k(t)
                     (the start of t's block in sample k, over every sample and head): at most
                     the largest block, O(sigma log s)
    fixed blocks     j >= the start of t's block
    windowed ALiBi   j >= t - max_h w_h
    exact / none     every key (nothing is forgotten)

After the last layer of a forward, the cache drops from every layer the keys before the earliest
slot any layer and any sequence of the batch still needs (one offset for all layers, so the one
attention mask transformers builds fits each of them). It records the position of every key it
keeps, which the attention function reads instead of counting keys from the mask
(:func:`poslsh_cli.lm.install.attention_forward`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from poslsh_cli.numerics.methods import method_def


def _drop_of(tokens_to_remove: int) -> int:
    """The number of tokens ``crop(tokens_to_remove)`` removes (transformers passes it negative)."""
    if tokens_to_remove > 0:
        raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
    return -tokens_to_remove


class ForgettingLayer(DynamicLayer):
    """One layer's keys and values from slot ``offset`` on (slots count every token written),
    with each kept key's position (``positions`` (B, kept), set by the attention function)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0
        self.offset = 0
        self.positions: torch.Tensor | None = None
        self.keep_from: int | None = None  # the first slot this layer's queries may still need
        self.spec: Any = None  # the attention spec of the last forward (what its queries may see)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.seen += key_states.shape[-2]
        return super().update(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kept = 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]
        return kept + query_length, self.offset

    def drop_before(self, slot: int) -> None:
        cut = slot - self.offset
        if cut <= 0:
            return
        self.keys = self.keys[..., cut:, :].contiguous()
        self.values = self.values[..., cut:, :].contiguous()
        if self.positions is not None:
            self.positions = self.positions[:, cut:]
        self.offset = slot

    def refusal(self, drop: int) -> str | None:
        """Why the last ``drop`` tokens cannot be removed from this layer (None: they can): only
        tokens still held can go, and the tokens left must not need a key already forgotten."""
        if drop == 0 or not self.is_initialized:
            return None
        if drop > self.keys.shape[-2]:
            return (f"cannot remove {drop} tokens: the forgetting cache holds {self.keys.shape[-2]} (the earlier ones "
                    "are forgotten)")
        if self.positions is not None and self.spec is not None and self.offset > 0:
            kept = self.positions[:, :-drop]
            earliest = earliest_needed(self.spec, kept[:, -1] + 1)
            if earliest is not None and bool((kept[:, 0] > earliest).any()):
                return (f"cannot remove {drop} tokens: decoding them again needs keys the forgetting cache has "
                        "forgotten (use a DynamicCache where many tokens are taken back)")
        return None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count),
        as assisted decoding does after rejected draft tokens; refused (ValueError, nothing
        changed) where :meth:`refusal` says why."""
        drop = _drop_of(tokens_to_remove)
        why = self.refusal(drop)
        if why is not None:
            raise ValueError(why)
        if drop == 0 or not self.is_initialized:
            return
        if self.positions is not None:
            self.positions = self.positions[:, :-drop]
        self.keys, self.values = self.keys[..., :-drop, :], self.values[..., :-drop, :]
        self.seen -= drop
        self.keep_from = None  # recomputed by the next forward

    def kv_bytes(self) -> int:
        if not self.is_initialized or self.keys.numel() == 0:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class ForgettingCache(Cache):
    """A transformers ``Cache`` for a model with a poslsh scheme installed: pass it to
    ``generate(..., cache=cache)`` (or a forward's ``cache=``). Exact ALiBi keeps every
    key; the other schemes keep only what their future queries can see (module docstring)."""

    def __init__(self, model: Any) -> None:
        state = getattr(model, "poslsh_position", None)
        if state is None:
            raise ValueError("ForgettingCache needs a model with a poslsh position scheme installed")
        layers = int(model.config.num_hidden_layers)
        super().__init__(layers=[ForgettingLayer() for _ in range(layers)])
        self.state = state
        self.num_layers = layers
        state._forgetting = self  # the attention function finds its layers here

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens from every layer, or from none: every layer
        is asked first (:meth:`ForgettingLayer.refusal`), so a refusal (ValueError) leaves the cache
        as it was (one layer may keep keys another has forgotten)."""
        drop = _drop_of(tokens_to_remove)
        for layer in self.layers:
            why = layer.refusal(drop)
            if why is not None:
                raise ValueError(why)
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def kv_bytes(self) -> int:
        """Bytes of the keys and values held now, every layer."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def kept(self) -> int:
        """Keys held per layer (the same in every layer)."""
        return max((layer.keys.shape[-2] if layer.is_initialized and layer.keys.numel() else 0)
                   for layer in self.layers)

    def after_layer(self, layer_idx: int, spec: Any, k_pos: torch.Tensor, q_pos: torch.Tensor) -> None:
        """Called by the attention function of layer ``layer_idx`` with the positions it used:
        records them, and after the last layer drops what no layer needs any more."""
        layer = self.layers[layer_idx]
        layer.positions, layer.spec = k_pos, spec
        layer.keep_from = layer.offset + first_needed(spec, k_pos, q_pos[:, -1])
        if layer_idx == self.num_layers - 1:
            slot = min(lay.keep_from for lay in self.layers if lay.keep_from is not None)
            for lay in self.layers:
                lay.drop_before(slot)


def earliest_needed(spec: Any, t: torch.Tensor) -> torch.Tensor | None:
    """The earliest key position (B,) a query at a position >= ``t`` (B,) may attend to under
    ``spec``, over every head (and sample): the method's declared forgetting rule
    (:class:`~poslsh_cli.numerics.methods.MethodDef` ``forget``); None when every key stays needed
    (exact, no bias). ValueError for an unknown method."""
    forget = method_def(spec.method).forget
    if forget is None:
        return None
    return torch.as_tensor(forget(spec, t.detach().cpu().numpy().astype(np.int64)), device=t.device)


def first_needed(spec: Any, k_pos: torch.Tensor, t: torch.Tensor) -> int:
    """The first key index (of the n keys at positions ``k_pos`` (B, n)) that a query at a position
    >= ``t`` (B,) may still attend to under ``spec``, over every sequence and head; 0 keeps all."""
    earliest = earliest_needed(spec, t)
    if earliest is None:
        return 0
    needed = k_pos >= earliest[:, None]  # (B, n); keys are in slot order, positions increase
    first = torch.where(needed.any(1), needed.to(torch.int8).argmax(1), torch.full_like(t, k_pos.shape[1]))
    return int(first.min()) if first.numel() else 0


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token's keys and values take in every layer (float32 unless the model's dtype)."""
    cfg = model.config
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    size = next(model.parameters()).element_size()
    return 2 * int(cfg.num_hidden_layers) * heads * head_dim * size


__all__ = ["ForgettingCache", "ForgettingLayer", "earliest_needed", "first_needed", "kv_bytes_per_token"]
