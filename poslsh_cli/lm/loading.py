"""Models with a position scheme: poslsh's byte-level Qwen3-architecture model built from a
configuration (:class:`Arch`, :func:`build_model`), and any checkpoint loaded with its scheme
(:func:`load_model`: a ``poslsh train`` checkpoint, an ALiBi checkpoint with its own slopes, or
another causal LM under its own attention).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from poslsh_cli.core.config import key
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.install import install
from poslsh_cli.attention.scheme import Position, SWAP_S, SchemeKeys, method_of, randomized
from poslsh_cli.lm.positions import PositionState
from poslsh_cli.attention.plan import Backend, backends_of
from poslsh_cli.lm.checkpoint import (
    check_checkpoint, hf_config, is_adapter, load_failure, read_config, refuse_rotary_falcon)
from poslsh_cli.numerics.sampling import Sampler


#: The byte model's size keys, declared once: a command that builds the model declares each with
#: :func:`arch_key`, choosing only its default (``tests/test_architecture.py`` holds them to this table).
ARCH_KEYS = {"hidden": "byte model: width", "layers": "byte model: decoder layers",
             "heads": "byte model: attention heads (one ALiBi slope each)",
             "kv_heads": "byte model: key/value heads (grouped-query attention)",
             "head_dim": "byte model: head dimension", "intermediate": "byte model: MLP width"}


def arch_key(name: str, default: int) -> Any:
    """The spec field of the byte model's size key ``name`` (:data:`ARCH_KEYS`)."""
    return key(ARCH_KEYS[name], default, ge=1)


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

    @classmethod
    def of(cls, spec: Any, max_positions: int) -> "Arch":
        """The sizes a command's keys name (:data:`ARCH_KEYS`), with room for ``max_positions``."""
        return cls(spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.intermediate, spec.head_dim, max_positions)

    def config(self) -> dict:
        """Its transformers ``Qwen3Config`` arguments (vocabulary 256, tied embeddings)."""
        from poslsh_cli.lm.data import VOCAB

        return dict(vocab_size=VOCAB, hidden_size=self.hidden, intermediate_size=self.intermediate,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                    max_position_embeddings=self.max_positions, tie_word_embeddings=True, use_cache=True,
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


def load_model(path: Path, device: str = "cpu", trust_remote_code: bool = False) -> tuple[Any, PositionState]:
    """A checkpoint saved by ``poslsh train``, an ALiBi checkpoint (BLOOM, MPT, Falcon-RW: its own
    attention, with its own slopes, as the native state) or another causal LM (its own attention,
    recorded as ``rope``)."""
    import transformers as tf

    from poslsh_cli.lm.pretrained import ALIBI_ARCHS, alibi_sigmas_of, load_adapter

    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
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
            model = tf.AutoModelForCausalLM.from_pretrained(path, config=hf_config(path), local_files_only=True,
                                                            use_safetensors=True, attn_implementation=impl,
                                                            trust_remote_code=trust_remote_code)
        except Exception as exc:  # a broken checkpoint: one line
            raise load_failure(path, exc, hf_config(path)) from None
    heads = model.config.num_attention_heads
    saved = cfg.get("poslsh")
    if saved:  # the scheme it was trained with (lm.checkpoint.saved_scheme), as its layers apply it
        state = PositionState.from_json(saved, path / "config.json")
    elif mtype in ALIBI_ARCHS:
        own = alibi_sigmas_of(getattr(model, "transformer", model), mtype, heads)
        state = PositionState.from_keys(SchemeKeys(Position.ALIBI, alibi="model"), heads, own, native=True)
    else:
        state = PositionState.from_keys(SchemeKeys(Position.ROPE), heads)
    install(model, state)
    return model.to(device).eval(), state


def with_scheme(model: Any, own: PositionState, attention: str = "own", s: int = 0, seed: Optional[int] = None,
                path: Optional[Path] = None, sampler: Optional[str] = None,
                backend: Optional[str] = None) -> PositionState:
    """Install on ``model`` (loaded with its ``own`` state) the scheme ``attention`` (``own``, or
    one of :class:`Position` swapped in on the checkpoint's bandwidths), with ``s`` masks per head
    for Positional LSH (0: the checkpoint's own, else 8) and mask seed ``seed`` (None: the
    checkpoint's own for its own scheme, 0 for a swapped one); the state that now runs.
    ``sampler`` (how Positional-LSH masks are drawn: iid, stratified, sobol) and ``backend`` (the
    attention path) are the checkpoint's own unless given; a swapped method that does not run on
    the checkpoint's backend takes ``auto``. A rotary scheme on a checkpoint without one, a swap on
    an ALiBi checkpoint whose attention computes inline, or a backend the method does not run on,
    is one ConfigError."""
    import dataclasses

    where = f"{path}: " if path is not None else ""
    samplers, backends = [x.value for x in Sampler], ["auto", *(b.value for b in Backend)]
    if sampler is not None and sampler not in samplers:
        raise ConfigError(f"sampler={sampler!r}: one of {', '.join(samplers)}")
    if backend is not None and backend not in backends:
        raise ConfigError(f"backend={backend!r}: one of {', '.join(backends)}")
    if attention == "own":
        redraw = randomized(own.position) and (s or seed is not None)
        if not (redraw or sampler not in (None, own.sampler) or backend not in (None, own.backend)):
            return own
        position = own.position
        state = dataclasses.replace(own, s=s or own.s, seed=own.seed if seed is None else seed,
                                    sampler=sampler or own.sampler, backend=backend or own.backend, plans=set(),
                                    _cache={}, _forgetting=None)
    else:
        try:
            position = Position(attention)
        except ValueError:
            raise ConfigError(f"attention={attention!r}: one of own, {', '.join(p.value for p in Position)}") from None
        if position is Position.ROPE and own.position is not Position.ROPE:
            raise ConfigError("attention=rope: only a RoPE checkpoint has the rotary embedding it needs")
        if own.native:
            raise ConfigError(f"{where}an ALiBi checkpoint's own attention computes inline; under a swapped "
                              "scheme it runs without a key/value cache (poslsh perplexity measures it)")
        samples = s or own.s or SWAP_S
        runs_on = backends_of(method_of(position)) if position is not Position.ROPE else ()
        kept = own.backend if own.backend == "auto" or Backend(own.backend) in runs_on else "auto"
        state = own.swapped(position, samples, 0 if seed is None else seed, sampler=sampler or own.sampler,
                            backend=backend or kept)
    if state.backend != "auto" and position is not Position.ROPE \
            and Backend(state.backend) not in backends_of(method_of(position)):
        raise ConfigError(f"{where}backend={state.backend}: {position.value} runs on "
                          f"{', '.join(b.value for b in backends_of(method_of(position)))} (or auto)")
    install(model, state)
    return state
