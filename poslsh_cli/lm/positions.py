"""A language model's position scheme at run time: :class:`PositionState` is the
:class:`~poslsh_cli.attention.scheme.Scheme` a model's attention layers apply, with the state of a
run (the training step whose masks are drawn, the evaluation key, the plans that ran). The schemes
themselves (none, fixed_block, windowed, alibi, poslsh, rope), their labels and the rule for their
bandwidths are :mod:`poslsh_cli.attention.scheme`'s. Positional-LSH masks for training step t,
layer l, head h come from the seed ``derive_seed(seed, "masks", "step", t, l, h)``: any step's masks
replay. Installing a scheme into a transformers model is :mod:`poslsh_cli.lm.install`; building and
loading models with one, :mod:`poslsh_cli.lm.loading`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from poslsh_cli.attention.scheme import Position, Scheme, method_of, model_label, randomized, sigma_label

__all__ = ["ATTENTION_NAME", "Position", "PositionState", "method_of", "model_label", "randomized", "sigma_label",
           "with_model_columns"]

ATTENTION_NAME = "poslsh"


@dataclass
class PositionState(Scheme):
    """A :class:`~poslsh_cli.attention.scheme.Scheme` as a model's attention layers apply it; one,
    shared by every layer.

    ``step`` is the training step whose masks are drawn (set by the training loop); ``eval_key``
    replaces it for evaluation (fixed masks, so a validation loss replays); ``native``: the
    checkpoint's own attention, untouched (an ALiBi checkpoint's inline attention).
    """

    step: int = 0
    eval_key: str | None = None
    native: bool = False
    #: labels of the attention plans that ran (poslsh_cli.attention.Plan.label), as recorded by attend
    plans: set = field(default_factory=set, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)
    #: the poslsh_cli.lm.kvcache.ForgettingCache decoding with this scheme, if any
    _forgetting: Any = field(default=None, repr=False)

    SAVED_EXTRA: ClassVar[tuple[str, ...]] = ("native",)

    def attention_spec(self, layer: int, n: int, scale: float | None = None, tag: tuple | None = None,
                       causal: bool = True) -> Any:
        """The :class:`~poslsh_cli.attention.AttentionSpec` of ``layer`` at length n, this step
        (``"eval", key`` in place of the step while evaluating); cached per step, layer and length."""
        tag = tag or (("eval", self.eval_key) if self.eval_key is not None else ("step", self.step))
        key = (tag, layer, n, causal)
        spec = self._cache.get(key)
        if spec is None:
            spec = super().attention_spec(layer, n, scale, tag, causal)
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = spec
        return spec

    def to_json(self) -> dict:
        d = super().to_json()
        if self.native:
            d["native"] = True
        return d


def with_model_columns(df: Any) -> Any:
    """A results table with the columns that tell trained models apart besides position, s and seed
    (``attn_dropout``, ``sigmas``); runs written before a column existed get its neutral value (no
    dropout, the standard slopes)."""
    if "attn_dropout" not in df.columns:
        df = df.assign(attn_dropout=0.0)
    if "sigmas" not in df.columns:
        df = df.assign(sigmas="")
    return df.assign(attn_dropout=df.attn_dropout.fillna(0.0),
                     sigmas=df.sigmas.astype(object).where(df.sigmas.notna(), ""))
