"""The model a ``poslsh train`` run starts from, converted to a position scheme.

Three sources (:class:`Source`):

    bytes   the project's byte-level Qwen3 decoder, built from the run's sizes (vocabulary 256)
    init    a pretrained causal LM that transformers loads from a local directory (Llama, Mistral,
            Qwen2/3 and other rotary decoders; BLOOM, MPT, Falcon-RW with ALiBi), with the
            tokenizer saved beside it (``AutoTokenizer``, offline), or a byte-level checkpoint
    arch    a checkpoint's ``config.json`` and tokenizer, randomly initialised (from scratch at a
            real model's sizes, e.g. Qwen3-0.6B)

Conversion (:meth:`Source.state` and :func:`poslsh_cli.lm.install.install`): a rotary model's
rotary embedding becomes the identity and the scheme's attention is installed through
transformers' attention registry; ``rope`` keeps the model as it is. An ALiBi model keeps its own
slopes (``alibi=auto`` or ``model``; its own attention for ``alibi``, the project's attention
with its sigmas for the other schemes); ``alibi=standard`` uses the standard slopes of its head
count. Optional LoRA (:mod:`poslsh_cli.lm.lora`) is saved merged into full weights or as the
adapter beside its base (:func:`save`). Every saved
directory holds the tokenizer and records the scheme once (``config.json`` ``poslsh``; an adapter
saved alone, which has no config.json, in ``poslsh_train.json``) beside the training record
(``poslsh_train.json``), so ``AutoModelForCausalLM.from_pretrained`` loads it and
:func:`poslsh_cli.lm.loading.load_model` restores the scheme.
"""
from __future__ import annotations

import enum
import json
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.checkpoint import base_view, check_checkpoint, hf_config, load_failure, load_tokenizer, mark
from poslsh_cli.lm.trained import TRAIN_INFO
from poslsh_cli.lm.lora import is_lora
from poslsh_cli.lm.models import ModelSpec, presets, resolve
from poslsh_cli.attention.scheme import Position
from poslsh_cli.lm.positions import PositionState

#: files a tokenizer saved by ``save_pretrained`` leaves in a checkpoint directory
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json",
                   "spiece.model")


class Kind(str, enum.Enum):
    BYTES = "bytes"
    INIT = "init"
    ARCH = "arch"


@dataclass(frozen=True)
class Source:
    """Where a run's model comes from, checked once before anything is written.

    ``path``: the checkpoint (init) or the configuration's directory (arch); ``config``: its
    config.json; ``tokenizer``: the directory the tokenizer is read from (None: bytes);
    ``alibi``: the ``alibi=`` choice; ``byte_config``: the byte model's transformers config
    arguments (kind bytes)."""

    kind: Kind
    path: Optional[Path]
    config: dict
    tokenizer: Optional[Path]
    alibi: str = "auto"
    byte_config: Optional[dict] = None

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type"))

    @property
    def heads(self) -> int:
        c = self.config
        return int(c.get("num_attention_heads") or c.get("n_head") or c.get("n_heads"))

    @property
    def alibi_model(self) -> bool:
        """An ALiBi checkpoint (BLOOM, MPT, Falcon-RW): its own slopes, its own inline attention."""
        from poslsh_cli.lm.pretrained import ALIBI_ARCHS

        return self.model_type in ALIBI_ARCHS and (self.model_type != "falcon" or bool(self.config.get("alibi")))

    @property
    def own_slopes(self) -> bool:
        return self.alibi_model and self.alibi in ("auto", "model")

    def describe(self) -> str:
        if self.kind is Kind.BYTES:
            return "byte-level qwen3 (built from the run's sizes)"
        what = "pretrained" if self.kind is Kind.INIT else "from scratch at the sizes of"
        return f"{self.model_type} {what} {self.path}"

    def check_position(self, position: Any) -> None:
        if Position(position) is Position.ROPE and self.alibi_model:
            raise ConfigError(f"{self.path} ({self.model_type}) has no rotary embedding to keep: position=rope needs a "
                              "rotary model")

    def state(self, keys: Any, model: Any) -> Any:
        """The :class:`~poslsh_cli.lm.positions.PositionState` the scheme keys ``keys``
        (:class:`~poslsh_cli.attention.scheme.SchemeKeys`) name for this model: one ``sigma`` for
        every head when given (the paper's constant sigma), else its own slopes (an ALiBi checkpoint
        under alibi=auto/model; its own attention for alibi) or the standard ones."""
        from poslsh_cli.lm.pretrained import alibi_sigmas_of

        self.check_position(keys.position)
        own = self.own_slopes and keys.sigma is None
        model_sigmas = alibi_sigmas_of(getattr(model, "transformer", model), self.model_type, self.heads) if own else None
        return PositionState.from_keys(keys, self.heads, model_sigmas, native=own and keys.position is Position.ALIBI)


def resolve_ref(ref: str, key_name: str) -> Path:
    """A checkpoint directory, or a model preset (``conf/model/``: ``$POSLSH_MODELS/<dir>``)."""
    import os

    if ref in presets() and ref not in ("custom", "minilm"):
        p = presets()[ref]
        return resolve(ModelSpec(name=ref, path=p.get("path"), subdir=p.get("subdir")))
    path = Path(os.path.expanduser(ref)).resolve()
    if not path.exists():
        raise ConfigError(f"{key_name}={ref}: {path} does not exist (give a checkpoint directory or a model preset: "
                          f"{', '.join(n for n in presets() if n not in ('custom', 'minilm'))})")
    return path


def has_tokenizer(path: Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def _read_config(path: Path, key_name: str) -> dict:
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key_name}={path}: not a Hugging Face checkpoint directory (no config.json)")
    try:
        return base_view(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key_name}={path}: config.json cannot be read ({exc})") from None


def _check_architecture(path: Path, cfg: dict, key_name: str, alibi: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from poslsh_cli.lm.pretrained import ALIBI_ARCHS

    mtype = cfg.get("model_type")
    if "auto_map" in cfg:
        raise ConfigError(f"{key_name}={path}: the checkpoint ships its own modeling code (auto_map); poslsh train "
                          "converts architectures transformers implements")
    if mtype not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"{key_name}={path}: model_type {mtype!r} is not a causal language model transformers knows")
    if mtype == "falcon" and not cfg.get("alibi"):
        if alibi == "model":
            raise ConfigError(f"{key_name}={path}: a Falcon with rotary embeddings (alibi=false) has no ALiBi slopes "
                              "for alibi=model")
        raise ConfigError(f"{key_name}={path}: a Falcon with rotary embeddings computes attention inline; poslsh "
                          "converts rotary decoders with q_proj/k_proj/v_proj (Llama, Mistral, Qwen) and ALiBi "
                          "Falcons (alibi=true)")
    if alibi == "model" and mtype not in ALIBI_ARCHS:
        raise ConfigError(f"{key_name}={path}: {mtype} has no ALiBi slopes of its own: alibi=model needs an ALiBi "
                          "checkpoint (BLOOM, MPT, Falcon-RW); alibi=standard uses the standard slopes")
    if mtype == "falcon" and (cfg.get("multi_query") or cfg.get("new_decoder_architecture")):
        raise ConfigError(f"{key_name}={path}: an ALiBi Falcon with multi_query or new_decoder_architecture has no "
                          "per-head q/k/v layout poslsh knows (Falcon-RW's is supported)")


def open_source(init: Optional[str], arch: Optional[str], alibi: str, byte_config: dict) -> Source:
    """Check what ``init=`` / ``arch=`` name and return the run's :class:`Source` (one clear
    ConfigError otherwise: no checkpoint, no config, unreadable weights, no tokenizer, a
    tokenizer that does not fit the vocabulary, an architecture that cannot be converted)."""
    from poslsh_cli.lm.data import VOCAB

    if init is not None and arch is not None:
        raise ConfigError("init= (pretrained weights) and arch= (a configuration trained from scratch) exclude "
                          "each other")
    if init is None and arch is None:
        if alibi == "model":
            raise ConfigError("alibi=model needs an ALiBi checkpoint as init= (BLOOM, MPT, Falcon-RW)")
        return Source(Kind.BYTES, None, {"model_type": "qwen3", **byte_config}, None, alibi, byte_config)
    key_name, ref = ("init", init) if init is not None else ("arch", arch)
    path = resolve_ref(ref, key_name)
    if init is not None:
        if not path.exists():
            raise ConfigError(f"init={ref}: checkpoint {path} does not exist")
        check_checkpoint(path)
    cfg = _read_config(path, key_name)
    _check_architecture(path, cfg, key_name, alibi)
    vocab = int(cfg.get("vocab_size") or 0)
    if has_tokenizer(path):
        tok_dir: Optional[Path] = path
        n = _tokenizer_size(path, key_name)
        if n > vocab:
            raise ConfigError(f"{key_name}={path}: the tokenizer has {n} tokens but the model's vocabulary is {vocab} "
                              "(a tokenizer of another model?)")
    elif vocab == VOCAB and cfg.get("model_type") == "qwen3":
        tok_dir = None  # a byte-level checkpoint of poslsh train
    else:
        raise ConfigError(f"{key_name}={path}: no tokenizer beside the weights ({', '.join(TOKENIZER_FILES[:2])}); "
                          "save it there with AutoTokenizer.save_pretrained")
    return Source(Kind.INIT if init is not None else Kind.ARCH, path, cfg, tok_dir, alibi)


def _tokenizer_size(path: Path, key_name: str) -> int:
    try:
        return len(load_tokenizer(path))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{key_name}={path}: the tokenizer cannot be loaded ({first})") from None


def tokenizer_of(source: Source) -> Any:
    """The text-to-token map of the run: bytes, or the checkpoint's own tokenizer."""
    from poslsh_cli.lm.data import ByteTokenizer, HFTokenizer

    return ByteTokenizer() if source.tokenizer is None else HFTokenizer.load(source.tokenizer)


def _quiet() -> None:
    import transformers as tf

    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()


def _impl(mtype: str) -> str:
    from poslsh_cli.lm.pretrained import ALIBI_ARCHS

    return ALIBI_ARCHS[mtype].impl if mtype in ALIBI_ARCHS else "sdpa"


def load_weights(path: Path, dtype: Any = None) -> Any:
    """A causal LM from a local directory (float32 unless ``dtype``), on the CPU."""
    import torch
    import transformers as tf

    _quiet()
    cfg = _read_config(Path(path), "checkpoint")
    try:
        return tf.AutoModelForCausalLM.from_pretrained(path, config=hf_config(path), local_files_only=True,
                                                       use_safetensors=True, dtype=dtype or torch.float32,
                                                       attn_implementation=_impl(cfg.get("model_type")))
    except Exception as exc:

        raise load_failure(path, exc, hf_config(path)) from None


def new_model(source: Source, seed: int) -> Any:
    """Random initial weights from ``seed``: the byte model from its sizes, or ``arch``'s config."""
    import torch
    import transformers as tf

    _quiet()
    if source.kind is Kind.BYTES:
        config = tf.Qwen3Config(**source.byte_config)
    else:
        config = hf_config(source.path) or tf.AutoConfig.from_pretrained(source.path, local_files_only=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=_impl(source.model_type))
    return model.float()


# ---------------------------------------------------------------------------------------------
# saving


def save(model: Any, path: Path, info: Any, tokenizer: Optional[Path], lora_save: str = "merged",
         state_dict: Optional[dict] = None) -> None:
    """Write a trained model into ``path``: full weights (``save_pretrained``; a LoRA model merged
    into them, or only its adapter with ``lora_save=adapter``), the tokenizer, and
    ``poslsh_train.json`` (``info``, a :class:`~poslsh_cli.lm.trained.TrainInfo`: the data,
    the step). ``state_dict``: the full
    weights when the caller gathered them (a sharded model)."""
    import copy

    path = Path(path)
    if is_lora(model):
        if lora_save == "adapter":
            model.save_pretrained(path, safe_serialization=True)  # no config.json: transformers loads it as an adapter
            info = dataclasses.replace(info, adapter_of=info.init)
        else:
            merged = copy.deepcopy(model).merge_and_unload()
            merged.save_pretrained(path, safe_serialization=True)
    else:
        if state_dict is not None:  # gathered from shards: tied weights (an lm_head that is the embedding) once
            seen: set[int] = set()
            for name, p in model.named_parameters(remove_duplicate=False):
                if id(p) in seen:
                    state_dict.pop(name, None)
                seen.add(id(p))
        model.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
    state = getattr(model, "poslsh_position", None)
    if (path / "config.json").is_file() and state is not None and state.position.value != "rope" and not state.native:
        mark(path)  # plain from_pretrained must not load it as the architecture with its own attention
    if tokenizer is not None:

        load_tokenizer(Path(tokenizer)).save_pretrained(path)
    (path / TRAIN_INFO).write_text(json.dumps(info.to_json(), indent=1) + "\n")
