"""Position schemes for a decoder-only language model built by transformers (Qwen3 architecture).

Every attention method is a scheme under its scheme name (:data:`poslsh_cli.methods.INFO`), plus
the architecture's own rotary embedding:

    none          no positional information (NoPE): causal attention, no bias, no rotary
    fixed_block   one deterministic partition per head, width round(2 sigma_h)
    windowed      exact ALiBi within |i-j| <= ceil(c sigma_h)
    alibi         exact ALiBi, bias -|i-j| / sigma_h with the standard slopes
    poslsh        Positional LSH: s masks per head, drawn anew at every step (docs/THEORY.md,
                  "Training identity")
    rope          the architecture's own rotary embedding and SDPA attention

The enum order is the display order of every table and figure.

For every scheme but ``rope`` the rotary embedding is replaced by the identity and attention is
the project's (:func:`poslsh_cli.attention.attend`), installed through transformers' own
attention-function registry (``AttentionInterface``) under the name ``poslsh``. Positional-LSH
masks for training step t, layer l, head h come from the seed ``derive_seed(seed, "masks", "step",
t, l, h)``: any step's masks replay. The scheme is stored in the checkpoint's ``config.json``
(``poslsh``), so :func:`load_model` restores it and ``AutoModelForCausalLM.from_pretrained``
still loads the weights.
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from poslsh_cli.config import ConfigError
from poslsh_cli.methods import INFO, Method, of_scheme
from poslsh_cli.sampling import alibi_sigmas, derive_seed

ATTENTION_NAME = "poslsh"

#: Position schemes: one per attention method (its scheme name), then ``rope``.
Position = enum.Enum("Position", [(INFO[m].scheme.upper(), INFO[m].scheme) for m in Method] + [("ROPE", "rope")],
                     type=str, module=__name__, qualname="Position")


def method_of(position: "Position | str") -> Method:
    """The attention method a scheme runs (every scheme but rope)."""
    position = Position(position)
    if position is Position.ROPE:
        raise ValueError("rope uses the model's own attention")
    return of_scheme(position.value)


def sigma_label(sigmas: Any) -> str:
    """A short name for a model's per-head bandwidths, the part of a trained scheme that tables and
    legends must tell apart: ``standard`` (the standard ALiBi slopes for its head count), ``sigma=V
    every head`` (one bandwidth, as the official code's sigma = 256), else the range and count."""
    sig = np.asarray([] if sigmas is None else list(sigmas), dtype=np.float64)
    if sig.size == 0:
        return ""
    if np.allclose(sig, alibi_sigmas(sig.size), rtol=1e-6):
        return "standard"
    if np.allclose(sig, sig[0], rtol=1e-9):
        return f"sigma={sig[0]:g} every head"
    return f"sigma {sig.min():g}..{sig.max():g} ({sig.size} heads)"


def model_label(position: str, s: Any = 0, dropout: Any = 0.0, sigmas: Any = "") -> str:
    """A trained model's scheme as tables and legends print it: position, s, attention dropout and,
    when not the standard slopes, its bandwidths (the training seed is shown or counted apart)."""
    s = int(s) if s == s and s else 0
    dropout = float(dropout) if dropout == dropout and dropout else 0.0
    sigmas = sigmas if isinstance(sigmas, str) else ""
    return (str(position) + (f" s={s}" if s else "") + (f" +dropout {dropout:g}" if dropout else "")
            + (f" ({sigmas})" if sigmas and sigmas != "standard" else ""))


def with_model_columns(df: Any) -> Any:
    """A results table with the columns that tell trained models apart besides position, s and seed
    (``attn_dropout``, ``sigmas``); runs written before a column existed get its neutral value (no
    dropout, the standard slopes)."""
    if "attn_dropout" not in df.columns:
        df = df.assign(attn_dropout=0.0)
    if "sigmas" not in df.columns:
        df = df.assign(sigmas="")
    return df.assign(attn_dropout=df.attn_dropout.fillna(0.0),
                     sigmas=df.sigmas.astype(object).where(df.sigmas.notna(), ""))


@dataclass
class PositionState:
    """What a model's attention layers need to apply a scheme; shared by every layer.

    ``step`` is the training step whose masks are drawn (set by the training loop);
    ``eval_key`` replaces it for evaluation (fixed masks, so a validation loss replays).
    """

    position: Position
    sigmas: np.ndarray  # (H,) float64
    num_samples: int = 0
    window_sigmas: float = 4.0
    seed: int = 0
    step: int = 0
    backend: str = "auto"
    eval_key: str | None = None
    #: the checkpoint's own attention, untouched (an ALiBi checkpoint's inline attention)
    native: bool = False
    #: labels of the attention plans that ran (poslsh_cli.attention.Plan.label), as recorded by attend
    plans: set = field(default_factory=set, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.position = Position(self.position)
        self.sigmas = np.asarray(self.sigmas, dtype=np.float64).reshape(-1)

    @classmethod
    def standard(cls, position: Position | str, heads: int, **kw: Any) -> "PositionState":
        """One sigma per head from the standard ALiBi slopes."""
        return cls(Position(position), alibi_sigmas(heads), **kw)

    def attention_spec(self, layer: int, n: int, scale: float | None) -> Any:
        """The :class:`~poslsh_cli.attention.AttentionSpec` of ``layer`` at length n, this step.
        Positional-LSH masks of head h come from ``derive_seed(seed, "masks", "step", t, layer, h)``
        (``"eval", key`` in place of the step while evaluating)."""
        from poslsh_cli.attention import AttentionSpec

        key = (self.step, self.eval_key, layer, n)
        spec = self._cache.get(key)
        if spec is not None:
            return spec
        method = method_of(self.position)
        tag = ("eval", self.eval_key) if self.eval_key is not None else ("step", self.step)
        rngs = [np.random.default_rng(derive_seed(self.seed, "masks", *tag, layer, h))
                for h in range(len(self.sigmas))] if INFO[method].randomized else None
        spec = AttentionSpec.build(method, self.sigmas, n, True, num_samples=self.num_samples, rng=rngs,
                                   window_sigmas=self.window_sigmas, scale=scale)
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[key] = spec
        return spec

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items()
             if not k.startswith("_") and k not in ("step", "eval_key", "native", "plans")}
        if self.native:
            d["native"] = True
        d["position"] = self.position.value
        d["sigmas"] = [float(x) for x in self.sigmas]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "PositionState":
        return cls(**{k: v for k, v in d.items() if k in ("position", "sigmas", "num_samples", "window_sigmas",
                                                          "seed", "backend", "native")})


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                      dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
    """The ``poslsh`` entry of transformers' attention registry.

    query (B, H, n, d), key/value (B, H_kv, n, d) as the model's attention module passes them
    (grouped key/value heads are expanded here); causal always (decoder). Returns the output
    as (B, n, H, d), the layout transformers expects, and no attention weights.
    """
    from poslsh_cli.attention import attend

    state: PositionState = module.poslsh_position
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    spec = state.attention_spec(module.layer_idx, query.shape[-2], scaling)
    out = attend(query, key, value, spec, backend=state.backend, on_plan=lambda p: state.plans.add(p.label),
                 dropout=dropout if module.training else 0.0)  # (B, H, n, d)
    return out.transpose(1, 2).contiguous(), None


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


def _alibi_adapter(module: Any, mtype: str, layer: int) -> Any:
    """A replacement ``forward`` for the inline attention of an ALiBi checkpoint (BLOOM, MPT,
    Falcon-RW): its own fused projection and output projection around the project's attention
    (:func:`~poslsh_cli.attention.attend`) with the module's position state."""
    import torch

    from poslsh_cli.attention import attend
    from poslsh_cli.capture import ALIBI_ARCHS, alibi_scaling, split_qkv

    arch = ALIBI_ARCHS[mtype]
    heads = getattr(module, "num_heads", None) or module.n_heads

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        state: PositionState = module.poslsh_position
        B, T, _ = hidden_states.shape
        q, k, v = split_qkv(module, mtype, getattr(module, arch.qkv)(hidden_states), heads)  # (B, H, T, d)
        spec = state.attention_spec(layer, T, alibi_scaling(module, mtype, q.shape[-1]))
        context = attend(q, k, v, spec, backend=state.backend,
                         on_plan=lambda p: state.plans.add(p.label)).transpose(1, 2).reshape(B, T, -1)  # (B, T, H d)
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
    from transformers import AttentionInterface

    from poslsh_cli.capture import ALIBI_ARCHS, attention_modules

    config = model.config
    mtype = getattr(config, "model_type", None)
    if mtype in ALIBI_ARCHS:
        for layer, m in enumerate(attention_modules(model, mtype)):
            m.poslsh_position = state
            if "_poslsh_native_forward" not in m.__dict__:
                m._poslsh_native_forward = m.forward
            m.forward = m._poslsh_native_forward if state.native else _alibi_adapter(m, mtype, layer)
        config.poslsh = state.to_json()
        model.poslsh_position = state
        return model
    AttentionInterface.register(ATTENTION_NAME, attention_forward)
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


@dataclass(frozen=True)
class Arch:
    """Sizes of the Qwen3 decoder trained from scratch (byte vocabulary)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int
    max_positions: int

    def config(self) -> dict:
        """Its transformers ``Qwen3Config`` arguments (vocabulary 256, tied embeddings)."""
        from poslsh_cli.data import VOCAB

        return dict(vocab_size=VOCAB, hidden_size=self.hidden, intermediate_size=self.intermediate,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                    max_position_embeddings=self.max_positions, tie_word_embeddings=True, use_cache=False,
                    attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build_model(arch: Arch, state: PositionState, seed: int) -> Any:
    """A randomly initialised Qwen3ForCausalLM (vocabulary 256, tied embeddings) with ``state``."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    config = tf.Qwen3Config(**arch.config())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.Qwen3ForCausalLM(config)
    return install(model, state)


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


def load_model(path: Path, device: str = "cpu", trust_remote_code: bool = False) -> tuple[Any, PositionState]:
    """A checkpoint saved by ``poslsh train``, an ALiBi checkpoint (BLOOM, MPT, Falcon-RW: its own
    attention, with its own slopes, as the native state) or another causal LM (its own attention,
    recorded as ``rope``)."""
    import transformers as tf

    from poslsh_cli.capture import ALIBI_ARCHS, alibi_sigmas_of, check_checkpoint, is_adapter, load_adapter, \
        read_config, refuse_rotary_falcon

    tf.logging.set_verbosity_error()
    path = Path(path)
    check_checkpoint(path)
    cfg = read_config(path)
    mtype = cfg.get("model_type")
    refuse_rotary_falcon(path, mtype, bool(cfg.get("alibi")))
    impl = ALIBI_ARCHS[mtype].impl if mtype in ALIBI_ARCHS else "sdpa"
    if is_adapter(path):  # a LoRA adapter saved beside its base: merged here
        model = load_adapter(path)
    else:
        try:
            model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                            attn_implementation=impl,
                                                            trust_remote_code=trust_remote_code)
        except Exception as exc:  # a broken checkpoint: one line
            text = str(exc).strip().splitlines()
            raise ConfigError(f"{path}: cannot load the checkpoint ({text[0] if text else type(exc).__name__})") \
                from None
    heads = model.config.num_attention_heads
    saved = cfg.get("poslsh")
    if saved:
        state = PositionState.from_json(saved)
    elif mtype in ALIBI_ARCHS:
        state = PositionState(Position.ALIBI, alibi_sigmas_of(getattr(model, "transformer", model), mtype, heads),
                              native=True)
    else:
        state = PositionState.standard(Position.ROPE, heads)
    install(model, state)
    return model.to(device).eval(), state
