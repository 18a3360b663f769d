"""Language-model evaluation shared by ``train`` and ``perplexity``: the negative log-likelihood of
every predicted position of the evaluation windows, under a position scheme, the paper's accuracy
metrics of the same predictions (top-1/10/100 next-token accuracy, the mean reciprocal rank of the
true token, the mean predictive entropy), and optionally the KL divergence from the model's own
next-token distributions when another attention is swapped in.

Windows come from :func:`poslsh_cli.lm.windows.eval_windows` (non-overlapping by default: every position
but the first of a window is predicted). Log-probabilities are taken in float64. Bits per byte is
the summed NLL over ln 2 over the UTF-8 bytes the predicted tokens cover (one byte per token for
byte models), so models with different tokenizers compare on one scale. Positional-LSH
masks are fixed by the evaluation ``key`` (not by a training step), so an evaluation replays.

The rank of the true token is one plus the number of tokens with a strictly higher probability
(ties count in its favour); top-k accuracy is the share of predictions whose rank is at most k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from poslsh_cli.core import distributed as dist
from poslsh_cli.lm.install import install
from poslsh_cli.lm.windows import eval_windows


@dataclass(frozen=True)
class Metric:
    """One accuracy metric of the predictions, declared once: every evaluation computes it, ``train``
    writes it as ``val_<name>`` (its metrics log, so TensorBoard / W&B, and its results), ``perplexity``
    as ``<name>``, and the perplexity report's accuracy table shows its mean.

    ``window(logp, rank)``: its sum over one window's predicted positions, from their float64
    log-probabilities (T, V) and the rank of the true token (T,); ``total``: the name of that sum
    (:attr:`Evaluation.windows`' column); the metric is the sum over the predicted positions of
    every window divided by their number. ``label``, ``scale`` and ``digits``: how the report
    writes its mean (``f"{scale * mean:.{digits}f}"`` under ``label``)."""

    name: str
    total: str
    window: Callable[[Any, Any], float]
    label: str
    scale: float = 1.0
    digits: int = 4


def _top(k: int) -> Metric:
    return Metric(f"top{k}", f"top{k}", lambda logp, rank: int((rank <= k).sum()), f"top-{k} %", 100.0, 2)


#: top-k next-token accuracies every evaluation reports
TOP_K = (1, 10, 100)
#: the accuracy metrics, in the order of every table and column list
METRICS = (*(_top(k) for k in TOP_K),
           Metric("mrr", "rr", lambda logp, rank: float((1.0 / rank.double()).sum()), "MRR"),
           Metric("entropy", "entropy", lambda logp, rank: float(-(logp.exp() * logp).sum()), "entropy (nats)"))
#: the columns of :attr:`Evaluation.windows`, one row per window: sums over its predicted positions
WINDOW_SUMS = ("nll", "bytes", "predicted", *(m.total for m in METRICS))


def columns(prefix: str = "") -> tuple[str, ...]:
    """The metrics' result columns: ``prefix + name`` (``val_`` in train's rows and metrics log)."""
    return tuple(prefix + m.name for m in METRICS)


@dataclass(frozen=True)
class Evaluation:
    """Sums over the predicted positions: ``nll`` (natural log), ``predicted`` (how many), ``nbytes``
    (UTF-8 bytes of text the predicted tokens cover), ``kl`` (nats; KL(own || evaluated), 0 when
    the model runs under its own scheme), ``sums`` (each of :data:`METRICS`' sums, by its ``total``);
    and per window the same sums (``windows``: (W, len(WINDOW_SUMS)) in the order of
    :data:`WINDOW_SUMS`), for intervals over the evaluation text."""

    nll: float
    predicted: int
    nbytes: int
    kl: float = 0.0
    windows: Any = None
    sums: dict = field(default_factory=dict)

    @property
    def hits(self) -> tuple[int, ...]:
        """Predictions whose rank is within each of :data:`TOP_K`."""
        return tuple(int(self.sums.get(f"top{k}", 0)) for k in TOP_K)

    @property
    def loss(self) -> float:
        """Mean NLL per predicted token (nats)."""
        return self.nll / self.predicted

    @property
    def bits_per_byte(self) -> float:
        """``sum NLL / ln 2 / bytes covered``: one scale for every tokenizer."""
        return self.nll / math.log(2.0) / self.nbytes

    def accuracy(self) -> dict:
        """The paper's metrics (:data:`METRICS`) as means over the predicted positions: ``top1``,
        ``top10``, ``top100`` (fractions), ``mrr`` (mean reciprocal rank) and ``entropy`` (mean nats)."""
        k = max(self.predicted, 1)
        return {m.name: self.sums.get(m.total, 0.0) / k for m in METRICS}


def fast_cpu_math() -> None:
    """Flush denormal floats to zero for this process, as GPU kernels do: the softmax of a
    biased or masked attention underflows into denormals, which CPUs handle up to 2x slower
    (measured on the backward of the flash kernel); values below 1.2e-38 do not matter here.
    Also keeps transformers' progress bars (checkpoint writes) out of the logs."""
    import torch
    import transformers

    torch.set_flush_denormal(True)
    transformers.utils.logging.disable_progress_bar()


def vocab_size(model: Any) -> int:
    """The output vocabulary of ``model``, also when wrapped (DDP's ``.module``; a peft model or an
    FSDP-sharded one keeps its ``config``), else the size of its output embeddings."""
    base = getattr(model, "module", model)
    config = getattr(base, "config", None)
    if getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    out = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if out is None:
        raise ValueError(f"cannot tell the vocabulary of a {type(base).__name__}")
    return int(out.weight.shape[0])


def eval_batch(model: Any, length: int, batch: int) -> int:
    """Windows per forward pass: at most ``batch``, and few enough that their float32 logits
    (``batch x length x vocabulary``) stay under 1 GiB."""
    return max(1, min(batch, int(2**30 // max(1, 4 * length * vocab_size(model)))))


def evaluate(model: Any, state: Any, tokens: Any, length: int, stride: Optional[int] = None,
             max_tokens: Optional[int] = None, batch: int = 8, key: str = "eval", own: Any = None,
             token_bytes: Any = None, shard: tuple[int, int] = (0, 1), tail: bool = False,
             progress: Optional[Any] = None) -> Evaluation:
    """The model under position scheme ``state`` on the evaluation windows of ``tokens``.

    ``own``: the model's own scheme when ``state`` is another one swapped in: the model runs under
    both on the same windows (each installed in turn, ``own`` again at the end) and the KL
    divergence of the next-token distributions is summed. The model runs in eval mode without
    gradients and is left in the mode it was in. ``shard=(rank, world)``: in a distributed run
    each rank scores every world-th window (all ranks run the same number of forward passes, so
    a sharded model stays in step) and every rank gets the sums over all windows, in window
    order. The batch shrinks so that a batch's float32 logits stay under 1 GiB (large
    vocabularies); log-probabilities are taken in float64 per window. ``progress(done, total)`` is
    called after every forward pass with the windows scored so far (a long evaluation says how far
    it is).
    """
    import numpy as np
    import torch

    windows = list(eval_windows(tokens, length, stride, max_tokens, token_bytes, tail=tail))
    rank, world = shard
    mine = list(range(rank, len(windows), world))
    device = next(model.parameters()).device
    batch = eval_batch(model, length, batch)
    passes = -(-(-(-len(windows) // world)) // batch)  # forward passes per rank
    swapped = own is not None and state is not own
    states = [state] + ([own] if swapped else [])
    was_training = model.training
    model.eval()
    for st in states:
        st.eval_key = key
    scored: list[tuple] = []  # (window, kl, *WINDOW_SUMS)

    def logits(x: Any, st: Any) -> Any:
        if own is not None:
            install(model, st)
        return model(input_ids=x, use_cache=False).logits[:, :-1]  # (b, L-1, V)

    try:
        with torch.no_grad():
            for p in range(passes):
                group = mine[p * batch:(p + 1) * batch]
                idx = group or [0]  # a rank with no window left still runs the pass
                x = torch.as_tensor(np.stack([windows[i].tokens for i in idx]), dtype=torch.long, device=device)
                out = logits(x, state)
                ref = logits(x, own) if swapped else None
                for j, i in enumerate(group):  # target position p >= score_from is predicted at p - 1
                    w = windows[i]
                    logp = torch.log_softmax(out[j, w.score_from - 1:].double(), dim=-1)
                    true = logp.gather(-1, x[j, w.score_from:, None])  # (T, 1)
                    rank = (logp > true).sum(-1) + 1  # (T,)
                    kl = 0.0
                    if ref is not None:
                        r = torch.log_softmax(ref[j, w.score_from - 1:].double(), dim=-1)
                        kl = float((r.exp() * (r - logp)).sum())
                    scored.append((i, kl, -float(true.sum()), int(w.nbytes), length - w.score_from,
                                   *(m.window(logp, rank) for m in METRICS)))
                if progress is not None:
                    progress(min(len(windows), (p + 1) * batch * world), len(windows))
    finally:
        if own is not None:
            install(model, own)
        for st in states:
            st.eval_key = None
        model.train(was_training)
    if world > 1:
        scored = sorted(x for part in dist.gather(scored) for x in part)
    per_window = np.asarray([x[2:] for x in scored], dtype=np.float64).reshape(-1, len(WINDOW_SUMS))
    tot = dict(zip(WINDOW_SUMS, (float(sum(x[2 + c] for x in scored)) for c in range(len(WINDOW_SUMS)))))
    return Evaluation(tot["nll"], int(tot["predicted"]), int(tot["bytes"]), float(sum(x[1] for x in scored)),
                      per_window, {m.total: tot[m.total] for m in METRICS})
