"""Language-model evaluation shared by ``train`` and ``perplexity``: the negative log-likelihood of
every predicted position of the evaluation windows, under a position scheme, and optionally the
KL divergence from the model's own next-token distributions when another attention is swapped in.

Windows come from :func:`poslsh_cli.data.eval_windows` (non-overlapping by default: every position
but the first of a window is predicted). Log-probabilities are taken in float64. Positional-LSH
masks are fixed by the evaluation ``key`` (not by a training step), so an evaluation replays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Evaluation:
    """Sums over the predicted positions: ``nll`` (natural log), ``predicted`` (how many), ``kl``
    (nats; KL(own || evaluated), 0 when the model runs under its own scheme)."""

    nll: float
    predicted: int
    kl: float = 0.0

    @property
    def loss(self) -> float:
        """Mean NLL per predicted position (nats)."""
        return self.nll / self.predicted


def fast_cpu_math() -> None:
    """Flush denormal floats to zero for this process, as GPU kernels do: the softmax of a
    biased or masked attention underflows into denormals, which CPUs handle up to 2x slower
    (measured on the backward of the flash kernel); values below 1.2e-38 do not matter here.
    Also keeps transformers' progress bars (checkpoint writes) out of the logs."""
    import torch
    import transformers

    torch.set_flush_denormal(True)
    transformers.utils.logging.disable_progress_bar()


def evaluate(model: Any, state: Any, tokens: Any, length: int, stride: Optional[int] = None,
             max_tokens: Optional[int] = None, batch: int = 8, key: str = "eval", own: Any = None) -> Evaluation:
    """The model under position scheme ``state`` on the evaluation windows of ``tokens``.

    ``own``: the model's own scheme when ``state`` is another one swapped in: the model runs under
    both on the same windows (each installed in turn, ``own`` again at the end) and the KL
    divergence of the next-token distributions is summed. The model runs in eval mode without
    gradients and is left in the mode it was in.
    """
    import numpy as np
    import torch

    from poslsh_cli.data import eval_windows
    from poslsh_cli.positions import install

    windows = list(eval_windows(tokens, length, stride, max_tokens))
    device = next(model.parameters()).device
    swapped = own is not None and state is not own
    states = [state] + ([own] if swapped else [])
    was_training = model.training
    model.eval()
    for st in states:
        st.eval_key = key
    nll_sum, count, kl = 0.0, 0, 0.0

    def logprobs(x: Any, st: Any) -> Any:
        if own is not None:
            install(model, st)
        return torch.log_softmax(model(input_ids=x).logits.double()[:, :-1], dim=-1)  # (b, L-1, V)

    try:
        with torch.no_grad():
            for a in range(0, len(windows), batch):
                group = windows[a:a + batch]
                x = torch.as_tensor(np.stack([w.tokens for w in group]), device=device)
                logp = logprobs(x, state)
                nll = -logp.gather(-1, x[:, 1:, None])[..., 0]  # (b, L-1)
                ref = logprobs(x, own) if swapped else None
                for i, w in enumerate(group):  # target position p >= score_from is predicted at p - 1
                    nll_sum += float(nll[i, w.score_from - 1:].sum())
                    count += length - w.score_from
                    if ref is not None:
                        r, p = ref[i, w.score_from - 1:], logp[i, w.score_from - 1:]
                        kl += float((r.exp() * (r - p)).sum())
    finally:
        if own is not None:
            install(model, own)
        for st in states:
            st.eval_key = None
        model.train(was_training)
    return Evaluation(nll_sum, count, kl)
