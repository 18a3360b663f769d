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

from poslsh_cli.config import ConfigError

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


def check_checkpoint(path: Path) -> None:
    """Refuse what is not a loadable local checkpoint, with one clear reason: missing, no config,
    no safetensors, a file that differs from the manifest poslsh wrote with it, or a safetensors
    file whose header cannot be read (named)."""
    from poslsh_cli.files import MANIFEST, verify_dir

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist")
    if is_adapter(path):
        _check_adapter(path)
        return
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a Hugging Face checkpoint directory (no config.json)")
    if not (path / MANIFEST).exists():  # with a manifest, its hashes name a changed file first
        json_file(path / "config.json")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        extra = f" (found {other[0]}; convert it to safetensors)" if other else ""
        raise ConfigError(f"{path} has no *.safetensors weights{extra}")
    if (path / MANIFEST).exists():
        why = verify_dir(path)
        if why is not None:
            raise ConfigError(f"checkpoint {path} is corrupt: {why}")
    for w in weights:
        why = unreadable_safetensors(w)
        if why:
            raise ConfigError(f"checkpoint weights {w} cannot be read ({why})")


def is_adapter(path: Path) -> bool:
    """A LoRA adapter saved beside its base (adapter_config.json, no config.json of its own)."""
    return (Path(path) / "adapter_config.json").is_file() and not (Path(path) / "config.json").is_file()


def adapter_base(path: Path) -> Path:
    import json

    base = json.loads((Path(path) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    return Path(str(base or ""))


def _check_adapter(path: Path) -> None:
    from poslsh_cli.files import MANIFEST, verify_dir

    if (path / MANIFEST).exists():
        why = verify_dir(path)
        if why is not None:
            raise ConfigError(f"checkpoint {path} is corrupt: {why}")
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{path}: a LoRA adapter without adapter_model.safetensors")
    why = unreadable_safetensors(weights)
    if why:
        raise ConfigError(f"checkpoint weights {weights} cannot be read ({why})")
    base = adapter_base(path)
    if not (base / "config.json").is_file():
        raise ConfigError(f"{path}: the LoRA adapter's base model {base} is not there (it is loaded with the adapter)")
    check_checkpoint(base)


PEFT_HINT = 'pip install peft (or pip install -e ".[finetune]")'


def peft_module() -> Any:
    """peft, or one line saying how to install it."""
    try:
        import peft
    except ImportError:
        raise ConfigError(f"lora_rank= needs peft: {PEFT_HINT}") from None
    return peft


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


def read_config(path: Path) -> dict:
    """A checkpoint's config.json as a dict; for a LoRA adapter, its base's, with the scheme the
    adapter was trained with (``poslsh`` from its poslsh_train.json)."""
    import json

    path = Path(path)
    if is_adapter(path):
        cfg = json_file(adapter_base(path) / "config.json")
        info_file = path / "poslsh_train.json"
        info = json_file(info_file) if info_file.is_file() else {}
        if info.get("scheme"):
            cfg["poslsh"] = info["scheme"]
        return cfg
    return json_file(path / "config.json")


def json_file(path: Path) -> Any:
    """A checkpoint's JSON file (a JSON object), or one error line naming it: missing, not UTF-8, not
    JSON, not an object."""
    import json

    try:
        value = json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror or type(exc).__name__})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text (a checkpoint's JSON file)") from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def unreadable_safetensors(path: Path) -> str | None:
    """Why a safetensors file cannot be opened (header or size wrong), or None. Reads the header
    and the file size only."""
    import json
    import struct

    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return "shorter than its 8-byte header length"
            n = struct.unpack("<Q", head)[0]
            if n > size - 8:
                return "invalid header length (the file is truncated)"
            header = json.loads(fh.read(n))
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    except ValueError:
        return "malformed header"
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        return f"truncated: {size} bytes, its header needs {8 + n + end}"
    return None


def weights_bytes(path: Path, dtype_bytes: int = 4) -> float:
    """Memory of a checkpoint's weights once loaded in a ``dtype_bytes`` float type, from its
    safetensors files and the dtype they are stored in (for memory estimates; 0 if unknown)."""
    import json

    if is_adapter(path):
        return weights_bytes(adapter_base(path), dtype_bytes)
    stored = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    dt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    per = 2 if ("16" in dt) else 8 if "64" in dt else 4
    return float(stored) * dtype_bytes / per


def refuse_rotary_falcon(path: Path, model_type: str | None, alibi: bool) -> None:
    """A Falcon with ``alibi=false`` is a rotary model whose attention is computed inline: refused."""
    if model_type == "falcon" and not alibi:
        raise ConfigError(f"{path}: a Falcon with alibi=false uses rotary embeddings, not ALiBi, and computes "
                          "attention inline; only ALiBi Falcons (alibi=true, e.g. Falcon-RW) are supported")


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

    from poslsh_cli.sampling import alibi_slopes

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
    from poslsh_cli.data import builtin_text as text

    return text()


def read_text(text: str) -> str:
    """``builtin`` (the shipped corpus), ``pydoc-topics`` (this Python's own topics text) or a file."""
    from poslsh_cli.data import PYDOC_TOPICS, pydoc_topics_text

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
