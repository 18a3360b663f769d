"""Token windows: the training batches (random windows of L+1 tokens) and the evaluation windows
(non-overlapping by default, or sliding with a stride), in tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np


def train_batch(tokens: np.ndarray, seq_len: int, batch: int, generator: np.random.Generator) -> np.ndarray:
    """(batch, seq_len + 1) int64 windows at uniform random offsets ``0 .. len(tokens) - seq_len - 1``
    (every window of ``seq_len + 1`` tokens, the last one included): inputs ``[:, :-1]``, targets
    ``[:, 1:]``."""
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{len(tokens)} tokens hold no window of {seq_len + 1}")
    starts = generator.integers(0, len(tokens) - seq_len, size=batch)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return np.asarray(tokens)[idx].astype(np.int64)


def spread_sample(tokens: np.ndarray, length: int, max_tokens: int) -> np.ndarray:
    """``max_tokens // length`` spans of ``length`` tokens at evenly spaced offsets over the whole
    of ``tokens``, concatenated: non-overlapping evaluation windows of ``length`` over the result
    are spans of the text. A sample of the training split spread like the validation documents
    (every 10th of the corpus), so training and validation losses compare like with like."""
    if len(tokens) < length:
        raise ValueError(f"{len(tokens)} tokens hold no window of {length}")
    k = max(1, int(max_tokens) // int(length))
    starts = np.linspace(0, len(tokens) - length, k).round().astype(np.int64)
    return np.concatenate([np.asarray(tokens[a:a + length]) for a in starts])


@dataclass(frozen=True)
class Window:
    """One evaluation window: ``tokens`` (length,) int64, the first position whose prediction
    counts (``score_from``; position 0 has none), and the UTF-8 bytes its scored tokens cover."""

    tokens: np.ndarray
    score_from: int
    nbytes: int


def eval_windows(tokens: np.ndarray, length: int, stride: int | None = None, max_tokens: int | None = None,
                 token_bytes: np.ndarray | None = None, tail: bool = False) -> Iterator[Window]:
    """Windows of ``length`` tokens for bits per byte.

    ``stride=None`` (or ``length``): non-overlapping windows, every position but the first of
    each is predicted. ``stride < length``: sliding windows that advance by ``stride``; each
    scores only its last ``stride`` positions (the first window scores all of its own, unless
    ``tail``), so every token after the first is predicted exactly once, with up to
    ``length - stride`` tokens of context before it. ``tail=True`` is the sliding protocol of the
    ALiBi paper and of the Positional-LSH paper's code: every window, the first too, scores only
    its last ``stride`` positions (each scored token has ``length - stride`` tokens of context).
    ``max_tokens`` caps how many tokens the windows cover. ``token_bytes``: bytes each token
    covers (default one).
    """
    n = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    stride = length if stride is None else stride
    if n < length:
        return
    start = 0
    first = not tail or stride >= length
    while start + length <= n:
        score_from = 1 if first else max(1, length - stride)
        nb = (length - score_from) if token_bytes is None else int(np.asarray(
            token_bytes[start + score_from:start + length], dtype=np.int64).sum())
        yield Window(np.asarray(tokens[start:start + length]).astype(np.int64), score_from, nb)
        first = stride == length  # non-overlapping windows all score from position 1
        start += stride


def count_predicted(tokens: np.ndarray, length: int, stride: int | None = None, max_tokens: int | None = None,
                    tail: bool = False) -> int:
    return sum(length - w.score_from for w in eval_windows(tokens, length, stride, max_tokens, tail=tail))
