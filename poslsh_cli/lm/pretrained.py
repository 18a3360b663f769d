"""Open a local pretrained Hugging Face checkpoint for measurement: config, tokenizer and weights,
offline (``local_files_only``), safetensors only, ``trust_remote_code`` off unless asked; which
architectures poslsh measures (:data:`SUPPORTED`), where the ALiBi ones keep their attention and
what bias convention they use (:data:`ALIBI_ARCHS`), and their own slopes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.checkpoint import (adapter_base, check_checkpoint, hf_config, peft_module, read_config,
                                      refuse_rotary_falcon)
from poslsh_cli.numerics.sampling import standard_alibi_slopes


#: model_type values whose attention goes through ALL_ATTENTION_FUNCTIONS (checked by tests)
SUPPORTED = {"bert": "encoder", "llama": "decoder", "mistral": "decoder", "qwen3": "decoder",
             "llama4_text": "decoder", "llama4": "decoder", "bloom": "decoder", "mpt": "decoder",
             "falcon": "decoder", "baichuan": "decoder"}


@dataclass(frozen=True)
class AlibiArch:
    """Where an ALiBi architecture keeps its attention, and its bias convention (docs/THEORY.md,
    "ALiBi conventions in real checkpoints").

    qkv / out: attribute names of the fused q/k/v projection and of the output projection inside
    each attention module; layout: ``interleaved`` (view (B, T, H, 3, d)) or ``blocks`` ([Q|K|V]);
    before_scale: the bias is added before the 1/sqrt(d) scaling (Falcon), so the effective sigma
    is sqrt(d) / slope instead of 1 / slope. impl: the ``attn_implementation`` the model is
    loaded with (its own inline attention is "eager"; Falcon's eager path adds its ALiBi bias twice
    in this transformers version, mask and logits, its default sdpa path once).
    """

    qkv: str
    out: str
    layout: str
    before_scale: bool
    note: str
    impl: str = "eager"


ALIBI_ARCHS = {
    "bloom": AlibiArch("query_key_value", "dense", "interleaved", False,
                       "bias slope*j added after the 1/sqrt(d) scaling (build_alibi_tensor)"),
    "mpt": AlibiArch("Wqkv", "out_proj", "blocks", False,
                     "bias slope*(j-(T-1)) added after scaling; slopes of the next power of two, reordered"),
    "falcon": AlibiArch("query_key_value", "dense", "interleaved", True,
                        "bias slope*j added before the 1/sqrt(d) scaling, computed in bfloat16", impl="sdpa"),
    "baichuan": AlibiArch("W_pack", "o_proj", "blocks", False,
                          "remote code; bias slope*j after scaling, standard slopes"),
}


def load_adapter(path: Path) -> Any:
    """A LoRA adapter saved beside its base (``poslsh train lora_save=adapter``): the base causal LM
    (float32, from ``adapter_config.json``) with the adapter merged in."""
    import transformers as tf

    check_checkpoint(path)
    peft = peft_module()
    base_dir = adapter_base(path)
    mtype = read_config(base_dir).get("model_type")
    try:
        base = tf.AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True, use_safetensors=True,
                                                       dtype=torch.float32,
                                                       attn_implementation=ALIBI_ARCHS[mtype].impl
                                                       if mtype in ALIBI_ARCHS else "sdpa")
        return peft.PeftModel.from_pretrained(base, path).merge_and_unload()
    except Exception as exc:
        raise ConfigError(f"{path}: cannot load the adapter and its base ({_first_line(exc)})") from None


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    path: Path
    model_type: str
    num_layers: int
    num_heads: int
    max_positions: int | None
    causal: bool
    alibi_sigmas: Any = None  # (H,) the model's own effective sigmas, for ALiBi architectures


def load(path: Path, trust_remote_code: bool = False, device: str = "cpu",
         dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load config, tokenizer and weights from a local directory (offline)."""
    import transformers
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    check_checkpoint(path)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if not trust_remote_code and "auto_map" in read_config(path):
        raise ConfigError(f"{path} ships its own modeling code (auto_map in config.json): pass "
                          "model.trust_remote_code=true to run it")
    try:
        config = hf_config(path) or AutoConfig.from_pretrained(path, local_files_only=True,
                                                               trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ConfigError(f"{path}: cannot read config.json ({_first_line(exc)})") from None
    mtype = getattr(config, "model_type", None)
    if mtype not in SUPPORTED:
        raise ConfigError(f"cannot capture architecture {mtype!r} from {path} "
                          f"(supported: {', '.join(sorted(SUPPORTED))})")
    refuse_rotary_falcon(path, mtype, getattr(config, "alibi", False))
    if mtype == "falcon" and (config.multi_query or config.new_decoder_architecture):
        raise ConfigError(f"{path}: an ALiBi Falcon with multi_query or new_decoder_architecture has no "
                          "per-head q/k/v layout poslsh knows; only the Falcon-RW layout is captured")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ConfigError(f"{path}: cannot load the tokenizer ({_first_line(exc)})") from None
    try:
        if mtype == "llama4":  # multimodal checkpoint: the text decoder only
            from transformers import Llama4ForCausalLM

            model = Llama4ForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                      dtype=dtype, attn_implementation="sdpa")
        else:
            impl = ALIBI_ARCHS[mtype].impl if mtype in ALIBI_ARCHS else "sdpa"
            model = AutoModel.from_pretrained(path, config=config, local_files_only=True, use_safetensors=True, dtype=dtype,
                                              attn_implementation=impl, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ConfigError(f"{path}: cannot load the weights ({_first_line(exc)})") from None
    model.eval().to(device)
    heads = int(text_config.num_attention_heads)
    max_positions = getattr(text_config, "max_position_embeddings", None)
    if mtype in ALIBI_ARCHS:  # positions are unbounded but for MPT's precomputed bias
        max_positions = getattr(text_config, "max_seq_len", None)
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, model_type=mtype,
                       num_layers=int(text_config.num_hidden_layers), num_heads=heads,
                       max_positions=max_positions, causal=SUPPORTED[mtype] == "decoder",
                       alibi_sigmas=alibi_sigmas_of(model, mtype, heads) if mtype in ALIBI_ARCHS else None)


def alibi_slopes_of(model: Any, mtype: str, heads: int) -> Any:
    """The slopes an ALiBi model itself uses, (H,) float64, read from its own bias functions:
    the bias of key position 1 minus that of position 0 (BLOOM and Falcon add ``slope * j``, MPT
    ``slope * (j - (T-1))``). Baichuan's remote code uses the standard slopes."""
    import numpy as np

    inner = getattr(model, "transformer", model)
    if mtype == "bloom":
        b = inner.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)  # (H, 1, 2)
        return (b[:, 0, 1] - b[:, 0, 0]).double().numpy()
    if mtype == "falcon":
        from transformers.models.falcon.modeling_falcon import build_alibi_tensor

        b = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)
        return (b[:, 0, 1] - b[:, 0, 0]).double().numpy()
    if mtype == "mpt":
        b = inner.build_mpt_alibi_tensor(heads, 2)  # (H, 1, 2)
        return (b[:, 0, 1] - b[:, 0, 0]).double().numpy()
    return np.asarray(standard_alibi_slopes(heads))


def alibi_sigmas_of(model: Any, mtype: str, heads: int) -> Any:
    """Effective kernel bandwidths: 1/slope, or sqrt(d)/slope where the bias is added before the
    1/sqrt(d) scaling (Falcon)."""
    import math

    slopes = alibi_slopes_of(model, mtype, heads)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    d = cfg.hidden_size // heads
    return (math.sqrt(d) if ALIBI_ARCHS[mtype].before_scale else 1.0) / slopes


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
