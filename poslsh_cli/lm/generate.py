"""Text from a checkpoint (``poslsh generate CKPT prompt=... max_new_tokens=... attention=...``):
transformers' ``generate`` on the model :func:`~poslsh_cli.lm.loading.load_model` gives, under its
own position scheme or another one swapped in, decoding through a key/value cache that forgets
what the scheme can no longer see (:class:`~poslsh_cli.lm.kvcache.ForgettingCache`; each step at
its own position: :mod:`poslsh_cli.attention.positioned`) or, with ``cache=false``, by full
forwards (the same tokens; a check, and the slow way).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.checkpoint import expand_checkpoints, load_tokenizer
from poslsh_cli.lm.convert import has_tokenizer
from poslsh_cli.lm.trained import train_info
from poslsh_cli.attention.scheme import Position, method_of
from poslsh_cli.lm.loading import load_model, with_scheme
from poslsh_cli.numerics.methods import method_def

#: the keys ``poslsh generate`` takes after the checkpoint, with their defaults
DEFAULTS: dict[str, Any] = {"prompt": "The ", "max_new_tokens": 64, "attention": "own", "s": 0, "seed": 0,
                            "sampler": "own", "do_sample": False, "temperature": 1.0, "top_k": 0, "cache": True}


@dataclass(frozen=True)
class Generated:
    text: str  # the prompt and what was generated
    new_tokens: int
    seconds: float
    scheme: str  # the position scheme that ran (e.g. "poslsh s=8")
    paths: tuple[str, ...]  # the attention paths that ran

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


def parse(args: list[str]) -> dict[str, Any]:
    """``key=value`` arguments into typed settings (:data:`DEFAULTS`); an unknown key, a missing
    ``=`` or a value of the wrong type is one ConfigError."""
    out = dict(DEFAULTS)
    for a in args:
        key, eq, value = a.partition("=")
        if not eq:
            raise ConfigError(f"expected key=value, got {a!r} (keys: {', '.join(DEFAULTS)})")
        if key not in DEFAULTS:
            raise ConfigError(f"unknown key {key!r} (keys: {', '.join(DEFAULTS)})")
        default = DEFAULTS[key]
        try:
            if isinstance(default, bool):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[key] = value.lower() in ("true", "1")
            else:
                out[key] = type(default)(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r}: expected {type(default).__name__}") from None
    if out["max_new_tokens"] < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {out['max_new_tokens']}")
    if out["temperature"] <= 0:
        raise ConfigError(f"temperature must be > 0, got {out['temperature']}")
    if out["top_k"] < 0:
        raise ConfigError(f"top_k must be >= 0 (0: every token), got {out['top_k']}")
    if not out["do_sample"] and (out["temperature"] != DEFAULTS["temperature"] or out["top_k"] != DEFAULTS["top_k"]):
        raise ConfigError("temperature= and top_k= shape sampling: add do_sample=true (greedy decoding ignores them)")
    if out["s"] < 0:
        raise ConfigError(f"s must be >= 0 (0: the checkpoint's own), got {out['s']}")
    return out


def generate(path: Path, prompt: str, max_new_tokens: int, attention: str = "own", s: int = 0, seed: int = 0,
             sampler: str = "own", do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
             cache: bool = True, stream: Optional[Callable[[str], None]] = None,
             notice: Optional[Callable[[str], None]] = None, memory_bytes: Optional[float] = None) -> Generated:
    """Continue ``prompt`` by ``max_new_tokens`` tokens (greedy unless ``do_sample``); Positional-LSH
    masks drawn by ``sampler`` (``own``: the checkpoint's); ``stream`` gets the text as it comes (the
    prompt, then each new piece), ``notice`` a line when the text goes past the length the model was
    trained at. A rotary model refuses more tokens than it has positions (:func:`check_length`); a
    key/value cache that keeps every key refuses to grow past ``memory_bytes`` (:func:`check_cache`)."""
    import torch

    if not prompt:
        raise ConfigError("prompt= is empty: give the text to continue")
    _refuse_a_run(Path(path))
    model, own = load_model(Path(path))
    state = with_scheme(model, own, attention, s, seed=None if attention == "own" else seed, path=Path(path),
                        sampler=None if sampler == "own" else sampler)
    encode, decode = codec(Path(path))
    ids = torch.as_tensor(encode(prompt), dtype=torch.long)[None]
    label = state.label
    forgets = cache and state.position is not Position.ROPE and not state.native and forgetting(state.position)
    checks = [lambda: check_cache(model, label, int(ids.shape[1]) + max_new_tokens, forgets, memory_bytes, notice),
              lambda: check_length(Path(path), model, state, label, int(ids.shape[1]), max_new_tokens, notice)]
    for check in checks[::-1] if state.position is Position.ROPE else checks:  # a rotary model's positions first
        check()
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, use_cache=cache, do_sample=do_sample,
                                  pad_token_id=getattr(model.config, "pad_token_id", None) or 0)
    if cache and state.position is not Position.ROPE and not state.native:
        from poslsh_cli.lm.kvcache import ForgettingCache

        kwargs["cache"] = ForgettingCache(model)  # keeps only the keys the scheme can still see
    if do_sample:
        kwargs.update(temperature=temperature, top_k=top_k or None)
    if stream is not None:
        kwargs["streamer"] = Streamer(decode, stream)
    state.plans.clear()
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    seconds = time.perf_counter() - t0
    return Generated(decode(out[0].tolist()), int(out.shape[1] - ids.shape[1]), seconds, label,
                     tuple(sorted(state.plans)))


def _refuse_a_run(path: Path) -> None:
    """A train run directory holds several models: name them instead of saying it has no config.json."""
    if (path / "config.json").is_file() or not ((path / "config.yaml").is_file() and (path / "work").is_dir()):
        return
    try:
        models = [p for p, _ in expand_checkpoints(str(path))]
    except ConfigError:
        models = []
    shown = ", ".join(str(p) for p in models[:3]) + (f" (and {len(models) - 3} more)" if len(models) > 3 else "")
    raise ConfigError(f"{path} is a train run; generate continues one checkpoint: give one of its models"
                      + (f": {shown}" if shown else " (work/<cell>/final)"))


def check_length(path: Path, model: Any, state: Any, label: str, prompt_tokens: int, max_new_tokens: int,
                 notice: Optional[Callable[[str], None]] = None) -> None:
    """A rotary model (RoPE) has ``max_position_embeddings`` positions: more prompt and new tokens
    than that is one ConfigError saying how many new tokens fit. A scheme without a position limit
    (ALiBi, Positional LSH, windowed, fixed blocks, none) goes on past the length the model was
    trained at (``poslsh_train.json``, else its configured positions), and ``notice`` says so."""
    total = prompt_tokens + max_new_tokens
    positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if state.position is Position.ROPE:
        if positions and total > positions:
            room = positions - prompt_tokens
            raise ConfigError(f"max_new_tokens={max_new_tokens}: the prompt ({prompt_tokens} tokens) and the new tokens "
                              f"need {total} positions, the model has {positions} positions (max_position_embeddings): "
                              + (f"at most {room} new tokens" if room > 0 else "the prompt alone fills them"))
        return

    try:
        trained = train_info(path).seq_len
    except (ConfigError, ValueError, AttributeError, TypeError):
        trained = 0
    trained = trained or positions
    if trained and total > trained and notice is not None:
        notice(f"the prompt and the new tokens reach position {total}, past the length the model was trained at "
               f"({trained}): {label} has no position limit and extrapolates")


def forgetting(position: Any) -> bool:
    """Whether a scheme's key/value cache forgets keys it can no longer see (its method declares a
    forgetting rule: Positional LSH, fixed blocks, windowed ALiBi), so the cache stays bounded."""
    try:
        return method_def(method_of(position)).forget is not None
    except (ValueError, KeyError):
        return False


def cache_bytes_per_token(model: Any) -> int:
    """Bytes the key/value cache holds per token: layers x (key + value) x key/value heads x head
    width x the element size of the model's weights."""
    cfg = model.config
    layers = int(getattr(cfg, "num_hidden_layers", 0) or getattr(cfg, "n_layer", 0) or 1)
    heads = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 0) or 1)
    kv = int(getattr(cfg, "num_key_value_heads", 0) or heads)
    width = int(getattr(cfg, "head_dim", 0) or (int(getattr(cfg, "hidden_size", 0) or 0) // heads) or 1)
    element = next(model.parameters()).element_size()
    return layers * 2 * kv * width * element


def check_cache(model: Any, label: str, total: int, forgets: bool, memory_bytes: Optional[float],
                notice: Optional[Callable[[str], None]] = None) -> None:
    """What decoding ``total`` tokens costs, said before it starts when it is long, and refused when
    a cache that keeps every key would outgrow ``memory_bytes``: one decoding step a token; a
    forgetting cache keeps only the keys the scheme can still see, any other grows by
    :func:`cache_bytes_per_token` a token (every step then attends to all of them)."""
    per_token = cache_bytes_per_token(model)
    grown = per_token * total
    if not forgets and memory_bytes is not None and grown > memory_bytes:
        raise ConfigError(f"{total:,} tokens: {label}'s key/value cache keeps every key and would grow to "
                          f"{_bytes(grown)} ({_bytes(per_token)} a token), more than the {_bytes(memory_bytes)} "
                          "available: ask for fewer new tokens")
    positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if notice is not None and positions and total > positions:
        notice(f"{total:,} tokens, one decoding step each: " + (
            f"the cache keeps only the keys {label} can still see, so each step costs about the same"
            if forgets else f"the cache grows to {_bytes(grown)} and each step attends to every token before it, "
                            "so steps slow down as it grows") + " (Ctrl-C stops it)")


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


class Streamer:
    """transformers' streamer protocol (``put``, ``end``): ``write`` gets the text as the tokens come,
    first the prompt, then each new piece. The tokens since the last line break are decoded whole
    (a token may be part of a character or of a word), and a piece that ends in an incomplete
    character waits for the next token."""

    def __init__(self, decode: Callable[[list[int]], str], write: Callable[[str], None]):
        self.decode, self.write = decode, write
        self.tokens: list[int] = []
        self.shown = 0  # characters of decode(tokens) already written

    def put(self, value: Any) -> None:
        self.tokens += [int(t) for t in value.reshape(-1).tolist()]
        text = self.decode(self.tokens)
        if text.endswith("\ufffd"):
            return
        self._flush(text)

    def end(self) -> None:
        self._flush(self.decode(self.tokens))

    def _flush(self, text: str) -> None:
        if len(text) > self.shown:
            self.write(text[self.shown:])
        if text.endswith("\n"):  # a line is done: decode from here on
            self.tokens, self.shown = [], 0
        else:
            self.shown = max(self.shown, len(text))


def codec(path: Path) -> tuple[Any, Any]:
    """Text to token ids and back: the checkpoint's tokenizer, or UTF-8 bytes for a byte model."""
    if not has_tokenizer(path):
        return (lambda text: list(text.encode("utf-8")),
                lambda ids: bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace"))

    tok = load_tokenizer(path)
    return (lambda text: tok(text, add_special_tokens=False)["input_ids"],
            lambda ids: tok.decode(ids, skip_special_tokens=True))
