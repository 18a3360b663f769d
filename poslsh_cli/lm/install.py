"""A position scheme installed into a transformers model: for every scheme but ``rope`` the rotary
embedding is replaced by the identity and attention is the project's
(:func:`poslsh_cli.attention.attend`), through transformers' own attention-function registry
(``AttentionInterface``) under the name ``poslsh``; ALiBi architectures that compute attention
inline (BLOOM, MPT, Falcon-RW) get an adapter on their attention modules instead. The scheme is
stored in the model's ``config.json`` (``poslsh``), so :func:`poslsh_cli.lm.loading.load_model`
restores it and ``AutoModelForCausalLM.from_pretrained`` still loads the weights.
"""
from __future__ import annotations

from typing import Any

from poslsh_cli.core.config import ConfigError
from poslsh_cli.lm.positions import ATTENTION_NAME, Position, PositionState


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                      dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
    """The ``poslsh`` entry of transformers' attention registry.

    query (B, H, m, d), key/value (B, H_kv, n, d) as the model's attention module passes them
    (grouped key/value heads are expanded here); causal always (decoder). ``attention_mask`` is
    what transformers builds for this entry (:func:`register`: SDPA's boolean mask, or None when
    there is no padding and every query sees the keys up to itself). Without padding and with as
    many queries as keys (training, evaluation windows) the method runs on its own fast path;
    otherwise (a padded batch, a step decoded through a key/value cache) at each sequence's
    positions, counted from its first real token
    (:func:`~poslsh_cli.attention.positioned.positioned_attention`). Returns the output as
    (B, m, H, d), the layout transformers expects, and no attention weights.
    """
    from poslsh_cli.attention import attend
    from poslsh_cli.attention.positioned import positioned_attention, positions_from_mask

    import torch

    state: PositionState = module.poslsh_position
    forgetting = state._forgetting
    layer = forgetting.layers[module.layer_idx] if forgetting is not None else None
    if layer is not None and key is not layer.keys:
        layer = None  # another cache (or none) holds these keys
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    (B, _, m, _), n = query.shape, key.shape[-2]
    # the fast paths take the spec at length n; at explicit positions only its widths, shifts or windows
    # matter, which do not depend on n: one spec per layer serves every decoding step
    positioned = attention_mask is not None or m != n or (layer is not None and layer.positions is not None)
    spec = state.attention_spec(module.layer_idx, 1 if positioned else n, scaling)
    if dropout and module.training and (attention_mask is not None or m != n):
        raise ConfigError("attention dropout is not available with padding or a key/value cache")
    if layer is not None and layer.positions is not None:  # a step through a forgetting cache: it kept positions
        q_pos = layer.positions[:, -1:] + torch.arange(1, m + 1, device=query.device)
        k_pos = torch.cat([layer.positions, q_pos], 1)
        allowed = positions_from_mask(attention_mask, B, m, n, query.device)[2]
        state.plans.add("positioned")
        out = positioned_attention(query, key, value, spec, q_pos, k_pos, allowed, scaling)
    elif attention_mask is None and m == n:
        out = attend(query, key, value, spec, backend=state.backend, on_plan=lambda p: state.plans.add(p.label),
                     dropout=dropout if module.training else 0.0)  # (B, H, n, d)
        if layer is not None:  # a prompt into a forgetting cache: it keeps these positions
            q_pos = k_pos = torch.arange(n, device=query.device).expand(B, n)
    else:
        q_pos, k_pos, allowed = positions_from_mask(attention_mask, B, m, n, query.device)
        state.plans.add("positioned")
        out = positioned_attention(query, key, value, spec, q_pos, k_pos, allowed, scaling)
    if layer is not None:
        forgetting.after_layer(module.layer_idx, spec, k_pos, q_pos)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """The ``poslsh`` attention function and its mask function (SDPA's: a boolean mask from the
    padding and the cache, None where causal alone says it all) in transformers' registries."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _no_rotary() -> Any:
    import torch

    class NoRotary(torch.nn.Module):
        """Identity rotary embedding: cos = 1, sin = 0, so q and k are left as they are."""

        def __init__(self, head_dim: int) -> None:
            super().__init__()
            self.head_dim = head_dim

        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (*position_ids.shape, self.head_dim)
            return x.new_ones(shape), x.new_zeros(shape)

    return NoRotary


def _record_padding(inputs: dict) -> Any:
    """A forward pre-hook of the whole model that keeps its 2-D ``attention_mask`` (1: a real
    token) in ``inputs`` for the attention adapters: each architecture hands its attention layers
    a mask of its own format, the model's input is one format for all."""
    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        inputs["mask"] = mask if mask is not None and mask.dim() == 2 and not bool(mask.all()) else None

    return hook


def _alibi_adapter(module: Any, mtype: str, layer: int, inputs: dict) -> Any:
    """A replacement ``forward`` for the inline attention of an ALiBi checkpoint (BLOOM, MPT,
    Falcon-RW): its own fused projection and output projection around the project's attention
    (:func:`~poslsh_cli.attention.attend`) with the module's position state; a padded batch (the
    model's ``attention_mask``, recorded in ``inputs``) runs at explicit positions, each sequence
    counted from its first real token (:mod:`poslsh_cli.attention.positioned`)."""
    import torch

    from poslsh_cli.attention import attend
    from poslsh_cli.attention.positioned import positioned_attention, positions_from_mask
    from poslsh_cli.lm.capture import alibi_scaling, split_qkv
    from poslsh_cli.lm.pretrained import ALIBI_ARCHS

    arch = ALIBI_ARCHS[mtype]
    heads = getattr(module, "num_heads", None) or module.n_heads

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        state: PositionState = module.poslsh_position
        past = kwargs.get("layer_past", kwargs.get("past_key_values", kwargs.get("cache")))
        if kwargs.get("use_cache") or (past is not None and past.get_seq_length() > 0):
            raise ConfigError(f"{mtype} under a swapped attention scheme runs without a key/value cache "
                              "(use_cache=False); its own attention (attention=own) decodes with one")
        B, T, _ = hidden_states.shape
        q, k, v = split_qkv(module, mtype, getattr(module, arch.qkv)(hidden_states), heads)  # (B, H, T, d)
        scaling = alibi_scaling(module, mtype, q.shape[-1])
        padding = inputs.get("mask")
        if padding is not None and padding.shape == (B, T):
            real = padding.to(torch.bool)
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            q_pos, k_pos, allowed = positions_from_mask((real[:, None, None, :] & causal).to(q.device), B, T, T,
                                                        q.device)
            state.plans.add("positioned")
            out = positioned_attention(q, k, v, state.attention_spec(layer, 1, scaling), q_pos, k_pos, allowed,
                                       scaling)
        else:
            out = attend(q, k, v, state.attention_spec(layer, T, scaling), backend=state.backend,
                         on_plan=lambda p: state.plans.add(p.label))
        context = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, H d)
        out = getattr(module, arch.out)(context)
        if mtype == "bloom":  # BLOOM's attention module adds the residual itself (dropout_add)
            residual = args[0] if args else kwargs["residual"]
            out = torch.nn.functional.dropout(out, p=module.hidden_dropout, training=module.training) + residual
        return out, None

    return forward


def install(model: Any, state: PositionState) -> Any:
    """Apply ``state`` to a transformers causal LM in place (and record it in its config).

    ALiBi checkpoints (BLOOM, MPT, Falcon-RW) keep their own inline attention for a ``native``
    state and get an adapter around the project's attention otherwise.
    """
    from poslsh_cli.lm.capture import attention_modules
    from poslsh_cli.lm.pretrained import ALIBI_ARCHS

    config = model.config
    mtype = getattr(config, "model_type", None)
    if mtype in ALIBI_ARCHS:
        inputs = model.__dict__.get("_poslsh_inputs")
        if inputs is None:  # once per model: the padding mask of each call, for the adapters
            inputs = model._poslsh_inputs = {}
            model.register_forward_pre_hook(_record_padding(inputs), with_kwargs=True)
        for layer, m in enumerate(attention_modules(model, mtype)):
            m.poslsh_position = state
            if "_poslsh_native_forward" not in m.__dict__:
                m._poslsh_native_forward = m.forward
            m.forward = m._poslsh_native_forward if state.native else _alibi_adapter(m, mtype, layer, inputs)
        config.poslsh = state.to_json()
        model.poslsh_position = state
        return model
    register()
    heads = config.num_attention_heads
    if len(state.sigmas) != heads:
        raise ConfigError(f"the position scheme has {len(state.sigmas)} sigmas for a model with {heads} heads")
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "q_proj"):
            m.poslsh_position = state
    inner = model.model if hasattr(model, "model") else model
    if state.position is Position.ROPE:
        model.set_attn_implementation("sdpa")
        if getattr(inner, "_poslsh_rotary", None) is not None:
            inner.rotary_emb = inner._poslsh_rotary
    else:
        model.set_attn_implementation(ATTENTION_NAME)
        if getattr(inner, "_poslsh_rotary", None) is None:
            inner._poslsh_rotary = inner.rotary_emb
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        inner.rotary_emb = _no_rotary()(head_dim)
    config.poslsh = state.to_json()
    model.poslsh_position = state
    return model


def set_attention_dropout(model: Any, p: float) -> Any:
    """Attention dropout ``p`` in every attention layer of a transformers decoder (and its config),
    applied while training: the regulariser control of exact ALiBi (docs/THEORY.md)."""
    import torch

    model.config.attention_dropout = float(p)
    for m in model.modules():
        d = getattr(m, "attention_dropout", None)
        if isinstance(d, torch.nn.Dropout):  # BLOOM's own attention
            d.p = float(p)
        elif isinstance(d, (int, float)) and hasattr(m, "layer_idx"):
            m.attention_dropout = float(p)
    return model
