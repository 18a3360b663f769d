"""Load a local Hugging Face checkpoint, tokenise text, capture per-layer Q/K/V.

The tensors are captured at the model's attention function itself (the ``sdpa`` entry of
transformers' ``ALL_ATTENTION_FUNCTIONS``, patched for the duration of one forward pass), so
they are exactly what attention uses: after RoPE, after any q/k norm, with the model's own
``scaling``. Key/value heads of grouped-query attention are expanded to one per query head the
way ``repeat_kv`` does. Loading is offline (``local_files_only``), safetensors only, and
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
             "llama4_text": "decoder", "llama4": "decoder"}


def check_checkpoint(path: Path) -> None:
    """Refuse what is not a loadable local checkpoint, with one clear reason."""
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a Hugging Face checkpoint directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        extra = f" (found {other[0]}; convert it to safetensors)" if other else ""
        raise ConfigError(f"{path} has no *.safetensors weights{extra}")


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


def load(path: Path, trust_remote_code: bool = False, device: str = "cpu",
         dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load config, tokenizer and weights from a local directory (offline)."""
    import transformers
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    check_checkpoint(path)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ConfigError(f"{path}: cannot read config.json ({_first_line(exc)})") from None
    mtype = getattr(config, "model_type", None)
    if mtype not in SUPPORTED:
        raise ConfigError(f"cannot capture architecture {mtype!r} from {path} "
                          f"(supported: {', '.join(sorted(SUPPORTED))})")
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
            model = AutoModel.from_pretrained(path, local_files_only=True, use_safetensors=True, dtype=dtype,
                                              attn_implementation="sdpa", trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ConfigError(f"{path}: cannot load the weights ({_first_line(exc)})") from None
    model.eval().to(device)
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, model_type=mtype,
                       num_layers=int(text_config.num_hidden_layers), num_heads=int(text_config.num_attention_heads),
                       max_positions=getattr(text_config, "max_position_embeddings", None),
                       causal=SUPPORTED[mtype] == "decoder")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def builtin_text() -> str:
    """Real English prose every CPython ships: the documentation topics of ``pydoc_data``."""
    import re

    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return re.sub(r"(?m)^[ \t]*[*=~^\-]{3,}[ \t]*$\n?", "", text)  # drop reST underlines


def read_text(text: str) -> str:
    if text == "builtin":
        return builtin_text()
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
