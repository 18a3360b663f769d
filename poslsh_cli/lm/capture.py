"""Load a local Hugging Face checkpoint, tokenise text, capture per-layer Q/K/V.

For models whose attention goes through transformers' ``ALL_ATTENTION_FUNCTIONS`` (BERT, Llama,
Mistral, Qwen3, Llama-4) the tensors are captured at the ``sdpa`` entry itself (patched for one
forward pass), so they are exactly what attention uses: after RoPE, after any q/k norm, with the
model's own ``scaling``. Key/value heads of grouped-query attention are expanded to one per
query head the way ``repeat_kv`` does.

ALiBi models compute attention inline (BLOOM, MPT, Falcon with ``alibi=True``, Baichuan's remote
code): their q, k, v are taken from the output of the fused projection (BLOOM and Falcon
interleave q/k/v per head, MPT and Baichuan stack [Q|K|V]) and their own attention context from
the input of the output projection, by forward hooks; their slopes come from the model's own
functions (:data:`ALIBI_ARCHS`). Loading is offline (``local_files_only``), safetensors only, and
``trust_remote_code`` is off unless asked.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from poslsh_cli.core.config import ConfigError
from poslsh_cli.lm.checkpoint import adapter_base, check_checkpoint, peft_module, read_config, refuse_rotary_falcon

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
    if not trust_remote_code and '"auto_map"' in (path / "config.json").read_text():
        raise ConfigError(f"{path} ships its own modeling code (auto_map in config.json): pass "
                          "model.trust_remote_code=true to run it")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
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
            model = AutoModel.from_pretrained(path, local_files_only=True, use_safetensors=True, dtype=dtype,
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

    from poslsh_cli.numerics.sampling import alibi_slopes

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
    return np.asarray(alibi_slopes(heads))


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


def builtin_text() -> str:
    """The builtin corpus (the Python 3.11 documentation shipped with the package) as one text."""
    from poslsh_cli.lm.documents import builtin_text as text

    return text()


def read_text(text: str) -> str:
    """``builtin`` (the shipped corpus), ``pydoc-topics`` (this Python's own topics text) or a file."""
    from poslsh_cli.lm.documents import PYDOC_TOPICS, pydoc_topics_text

    if text == "builtin":
        return builtin_text()
    if text == PYDOC_TOPICS:
        return pydoc_topics_text()
    p = Path(os.path.expanduser(text))
    if not p.is_file():
        raise ConfigError(f"text={text}: no such file (use text=builtin or a path)")
    try:
        return p.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"text={text}: cannot read ({exc.strerror})") from None


def tokenize(tokenizer: Any, text: str, n: int) -> torch.Tensor:
    """The first ``n`` tokens of ``text`` (with the tokenizer's special tokens), shape (1, n)."""
    chars = max(4096, 12 * n)
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=True, return_attention_mask=False)["input_ids"]
        if len(ids) >= n or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise ConfigError(f"the text has only {len(ids)} tokens, fewer than n={n}")
    ids = ids[:n]
    return torch.tensor([ids], dtype=torch.long)


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
        loaded.model(input_ids=input_ids.to(device))
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
        loaded.model(input_ids=input_ids.to(device))
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
