"""Byte-level text corpora for training and evaluation: any text works offline.

Tokens are bytes (vocabulary 256). ``data=builtin`` is real English prose that every Python
install ships (the pydoc topics text), ``data=PATH`` a text file or a folder of text files
(e.g. a local WikiText-103). The corpus is split deterministically: the first
``1 - val_fraction`` of the bytes train, the rest validate. Its SHA-256 identifies it in
meta.json and in every checkpoint.

Training batches are random windows whose offsets come from a generator seeded by (run seed,
step), so any step's batch replays; evaluation uses fixed windows of the validation bytes.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from poslsh_cli.config import ConfigError

VOCAB = 256
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".raw", ".tokens", "")


@dataclass(frozen=True, eq=False)
class Corpus:
    """A byte corpus split into train and validation.

    Attributes:
        train, val: (bytes,) uint8 arrays.
        sha256: hex digest of the whole corpus (train + val), as read.
        source: ``builtin`` or the resolved path.
    """

    train: np.ndarray
    val: np.ndarray
    sha256: str
    source: str


def _read(data: str) -> tuple[bytes, str]:
    if data == "builtin":
        from poslsh_cli.capture import builtin_text

        return builtin_text().encode("utf-8"), "builtin"
    path = Path(os.path.expanduser(data)).resolve()
    if not path.exists():
        raise ConfigError(f"data={data}: no such file or folder (use data=builtin or a path)")
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                       and not p.name.startswith("."))
        if not files:
            raise ConfigError(f"data={data}: the folder holds no text files ({', '.join(s or 'no suffix' for s in TEXT_SUFFIXES)})")
    else:
        raise ConfigError(f"data={data}: {path} is neither a regular file nor a folder")
    try:
        raw = b"\n\n".join(p.read_bytes() for p in files)
    except OSError as exc:
        raise ConfigError(f"data={data}: cannot read ({exc.strerror})") from None
    return raw, str(path)


def load_corpus(data: str, val_fraction: float = 0.1, min_bytes: int = 0) -> Corpus:
    """Read ``data`` and split it; refuses an empty corpus or one with fewer than ``min_bytes``
    validation bytes (one evaluation window)."""
    raw, source = _read(data)
    if not raw.strip():
        raise ConfigError(f"data={data}: the text is empty" + ("" if raw else f" ({source} has 0 bytes)"))
    arr = np.frombuffer(raw, dtype=np.uint8)
    cut = int(round(len(arr) * (1 - val_fraction)))
    corpus = Corpus(arr[:cut], arr[cut:], hashlib.sha256(raw).hexdigest(), source)
    if len(corpus.val) < min_bytes or len(corpus.train) < min_bytes:
        raise ConfigError(f"data={data}: {len(raw)} bytes leave {len(corpus.train)} for training and "
                          f"{len(corpus.val)} for validation, fewer than one window of {min_bytes} bytes")
    return corpus


def train_batch(tokens: np.ndarray, seq_len: int, batch: int, generator: np.random.Generator) -> np.ndarray:
    """(batch, seq_len + 1) int64 windows at random offsets: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
    starts = generator.integers(0, len(tokens) - seq_len - 1, size=batch)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return tokens[idx].astype(np.int64)


@dataclass(frozen=True)
class Window:
    """One evaluation window: ``tokens`` (length,) int64 and the first position whose
    prediction counts (``score_from``; position 0 has none)."""

    tokens: np.ndarray
    score_from: int


def eval_windows(tokens: np.ndarray, length: int, stride: int | None = None,
                 max_tokens: int | None = None) -> Iterator[Window]:
    """Windows of ``length`` bytes for bits per byte.

    ``stride=None`` (or ``length``): non-overlapping windows, every position but the first of
    each is predicted. ``stride < length``: sliding windows that advance by ``stride``; each
    scores only its last ``stride`` positions (the first window scores all of its own), so every
    byte after the first is predicted exactly once, with up to ``length - stride`` bytes of
    context before it. ``max_tokens`` caps how many bytes the windows cover.
    """
    n = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    stride = length if stride is None else stride
    if n < length:
        return
    start = 0
    first = True
    while start + length <= n:
        yield Window(tokens[start:start + length].astype(np.int64), 1 if first else length - stride)
        first = stride == length  # non-overlapping windows all score from position 1
        start += stride


def count_predicted(tokens: np.ndarray, length: int, stride: int | None = None, max_tokens: int | None = None) -> int:
    return sum(length - w.score_from for w in eval_windows(tokens, length, stride, max_tokens))
