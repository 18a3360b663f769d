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

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.attention.scheme import Position
from poslsh_cli.lm.positions import ATTENTION_NAME, PositionState


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                      dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
    """The ``poslsh`` entry of transformers' attention registry.

    query (B, H, m, d), key/value (B, H_kv, n, d) as the model's attention module passes them
    (grouped key/value heads are expanded here); causal always (decoder). ``attention_mask`` is
    what transformers builds for this entry (:func:`attention_mask_for`: SDPA's boolean mask, or
    None when every query sees the real keys up to itself); which tokens are real comes from the
    model's own 2-D ``attention_mask``, recorded by :func:`install`'s hook. Paths:

    - as many queries as keys, no cache (training, evaluation windows, a prompt): the method's fast
      path (:func:`~poslsh_cli.attention.attend`); a padded batch as each sequence's real tokens
      alone from position 0 (:func:`~poslsh_cli.attention.positioned.attend_each_sequence`);
    - a step decoded through a key/value cache, or a mask that restricts more than causality and
      padding (a sliding window): at each token's position, counted from its sequence's first real
      token (:func:`~poslsh_cli.attention.positioned.positioned_attention`).

    Returns the output as (B, m, H, d), the layout transformers expects, and no attention weights.
    """
    from poslsh_cli.attention import attend
    from poslsh_cli.attention.positioned import (allowed_from_mask, attend_each_sequence, positioned_attention,
                                                 positions_from_padding)

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
    inputs = getattr(module, "poslsh_inputs", None)
    inputs = {} if inputs is None else inputs
    padding = _padding_of(inputs, needed=attention_mask is not None)
    on_plan = lambda p: state.plans.add(p.label)  # noqa: E731
    drop = dropout if module.training else 0.0
    step = m != n or (layer is not None and layer.positions is not None)  # a step through a cache
    if not step and (attention_mask is None or _plain(inputs, attention_mask, padding, B, n)):
        spec = state.attention_spec(module.layer_idx, n, scaling)
        if padding is None:
            out = attend(query, key, value, spec, backend=state.backend, on_plan=on_plan, dropout=drop)  # (B, H, n, d)
        else:
            spec_at = lambda r: state.attention_spec(module.layer_idx, r, scaling)  # noqa: E731
            out = attend_each_sequence(query, key, value, padding, spec_at, backend=state.backend, on_plan=on_plan,
                                       dropout=drop)
        if layer is not None:  # a prompt into a forgetting cache: it keeps these positions
            q_pos, k_pos = positions_from_padding(padding, B, m, n, query.device, inputs.get("tokens"))
    else:
        if drop:
            raise ConfigError("attention dropout is not available with a key/value cache or a sliding window")
        # at explicit positions only the spec's widths, shifts or windows matter, which do not depend on n
        spec = state.attention_spec(module.layer_idx, 1, scaling)
        if layer is not None and layer.positions is not None:  # a step through a forgetting cache: it kept positions
            q_pos = layer.positions[:, -1:] + torch.arange(1, m + 1, device=query.device)
            k_pos = torch.cat([layer.positions, q_pos], 1)
        else:
            q_pos, k_pos = positions_from_padding(padding, B, m, n, query.device, inputs.get("tokens"))
        allowed = allowed_from_mask(attention_mask, B, m, n, query.device)
        state.plans.add("positioned")
        out = positioned_attention(query, key, value, spec, q_pos, k_pos, allowed, scaling)
    if layer is not None:
        forgetting.after_layer(module.layer_idx, spec, k_pos, q_pos)
    return out.transpose(1, 2).contiguous(), None


def _padding_of(inputs: dict, needed: bool) -> Any:
    """The 2-D padding mask (B, L) bool of the model call now running (None: no padding), as
    :func:`_record_padding` recorded it; a 4-D mask given to the model says what queries see, not
    which tokens are real, and is refused where padding may matter (``needed``)."""
    padding = inputs.get("mask")
    if isinstance(padding, str):
        if not needed:
            return None
        raise ConfigError("give the model a 2-D attention_mask (1: a real token, 0: padding): positions are counted "
                          "over the real tokens, which a 4-D mask does not say")
    return padding


def _plain(inputs: dict, attention_mask: Any, padding: Any, B: int, n: int) -> bool:
    """Whether this forward's mask is causal attention over the real tokens and nothing more;
    checked once per mask tensor and model call (transformers hands every layer the same one)."""
    from poslsh_cli.attention.positioned import allowed_from_mask, is_causal_padding

    seen = inputs.setdefault("plain", [])
    for mask, verdict in seen:
        if mask is attention_mask:
            return verdict
    if padding is not None and padding.shape[-1] != n:
        return False
    verdict = is_causal_padding(allowed_from_mask(attention_mask, B, n, n, attention_mask.device), padding)
    seen.append((attention_mask, verdict))
    return verdict


def register() -> None:
    """The ``poslsh`` attention function and its mask function (:func:`attention_mask_for`) in
    transformers' registries."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, attention_mask_for)


def attention_mask_for(*args: Any, **kwargs: Any) -> Any:
    """The mask transformers hands :func:`attention_forward`: SDPA's (a boolean mask from the
    padding and the cache, None where causality alone says it all), and None as well for a
    forward without a cache whose mask would be causal attention over the real tokens and nothing
    else: the attention reads which tokens are real from the model's 2-D ``attention_mask`` and
    runs each sequence alone, so no (B, n, n) mask is built for it."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if (kwargs.get("mask_function") is causal_mask_function and kwargs.get("local_size") is None and not args
            and kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0
            and kwargs.get("q_length") == kwargs.get("kv_length")):
        return None
    return sdpa_mask(*args, **kwargs)


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


def _record_padding(forward: Any) -> Any:
    """A forward pre-hook of a model (whose ``forward`` takes ``attention_mask``) that keeps, for
    the attention functions of this call, in the model's ``_poslsh_inputs``: ``mask``, its 2-D
    ``attention_mask`` as bool (B, L) (1: a real token; None without padding, a string where the
    mask is not 2-D), and ``tokens``, L: the tokens so far (those in a cache and this call's).
    Each architecture hands its attention layers a mask of its own format (with a sliding window
    in it, if any); the model's input says which tokens are real, for all."""
    import inspect

    signature = inspect.signature(forward)

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        try:
            given = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            given = {}
        given = {**given, **given.get("kwargs", {}), **kwargs}
        mask = given.get("attention_mask")
        ids = given.get("input_ids")
        ids = ids if ids is not None else given.get("inputs_embeds")
        cache = given.get("past_key_values", given.get("cache"))
        inputs = module.__dict__.setdefault("_poslsh_inputs", {})
        inputs.clear()
        if mask is not None and mask.dim() == 2:
            inputs["tokens"] = mask.shape[-1]
        elif ids is not None:
            past = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else 0
            inputs["tokens"] = int(past) + ids.shape[1]
        if mask is None or (mask.dim() == 2 and bool(mask.all())):
            inputs["mask"] = None
        else:
            inputs["mask"] = mask.bool() if mask.dim() == 2 else "not 2-D"

    return hook


def _padding_record(model: Any) -> dict:
    """The dict from which the attention of ``model`` reads the padding of the call now running:
    its base model's (the one under the LM head, which every call of the model goes through),
    filled by a :func:`_record_padding` hook registered once."""
    base = getattr(model, "base_model", None) or model
    inputs = base.__dict__.get("_poslsh_inputs")
    if inputs is None:
        inputs = base._poslsh_inputs = {}
        base.register_forward_pre_hook(_record_padding(base.forward), with_kwargs=True)
    return inputs


def _alibi_adapter(module: Any, mtype: str, layer: int, inputs: dict) -> Any:
    """A replacement ``forward`` for the inline attention of an ALiBi checkpoint (BLOOM, MPT,
    Falcon-RW): its own fused projection and output projection around the project's attention
    (:func:`~poslsh_cli.attention.attend`) with the module's position state; a padded batch (the
    model's ``attention_mask``, recorded in ``inputs``) runs as each sequence's real tokens alone,
    from position 0 (:func:`~poslsh_cli.attention.positioned.attend_each_sequence`)."""
    import torch

    from poslsh_cli.attention import attend
    from poslsh_cli.attention.positioned import attend_each_sequence
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
        padding = _padding_of(inputs, needed=True)
        on_plan = lambda p: state.plans.add(p.label)  # noqa: E731
        if padding is not None:
            if padding.shape != (B, T):
                raise ConfigError(f"{mtype}: an attention_mask of shape {tuple(padding.shape)} for {B} sequences "
                                  f"of {T} tokens")
            out = attend_each_sequence(q, k, v, padding, lambda r: state.attention_spec(layer, r, scaling),
                                       backend=state.backend, on_plan=on_plan)
        else:
            out = attend(q, k, v, state.attention_spec(layer, T, scaling), backend=state.backend, on_plan=on_plan)
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
    inputs = _padding_record(model)  # the padding mask of each call, for the attention functions
    if mtype in ALIBI_ARCHS:
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
            m.poslsh_inputs = inputs
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
