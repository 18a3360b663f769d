"""Position schemes for a decoder-only language model built by transformers (Qwen3 architecture).

Every declared attention method is a scheme under its scheme name (:mod:`poslsh_cli.numerics.methods`), plus
the architecture's own rotary embedding:

    none          no positional information (NoPE): causal attention, no bias, no rotary
    fixed_block   one deterministic partition per head, width round(2 sigma_h)
    windowed      exact ALiBi within |i-j| <= ceil(c sigma_h)
    alibi         exact ALiBi, bias -|i-j| / sigma_h with the standard slopes
    poslsh        Positional LSH: s masks per head, drawn anew at every step (docs/THEORY.md,
                  "Training identity")
    rope          the architecture's own rotary embedding and SDPA attention

The enum order is the display order of every table and figure. :class:`PositionState` is what a
model's attention layers need to apply a scheme; Positional-LSH masks for training step t, layer
l, head h come from the seed ``derive_seed(seed, "masks", "step", t, l, h)``: any step's masks
replay. Installing a scheme into a transformers model is :mod:`poslsh_cli.lm.install`; building
and loading models with one, :mod:`poslsh_cli.lm.loading`.
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from poslsh_cli.numerics.methods import INFO, Method, method_def, of_scheme
from poslsh_cli.numerics.sampling import Sampler, alibi_sigmas, derive_seed

ATTENTION_NAME = "poslsh"


class _Schemes(str, enum.Enum):
    """Position schemes (generated below from the declared methods)."""

    @classmethod
    def _missing_(cls, value: object) -> Any:
        try:  # the scheme of a method registered from outside (poslsh_cli.numerics.methods.register)
            of_scheme(value)  # type: ignore[arg-type]
        except (ValueError, TypeError):
            return None
        member = str.__new__(cls, value)
        member._name_, member._value_ = str(value).upper(), value
        return member


#: Position schemes: one per declared attention method (its scheme name), then ``rope``.
Position = _Schemes("Position", [(INFO[m].scheme.upper(), INFO[m].scheme) for m in Method] + [("ROPE", "rope")],
                    module=__name__, qualname="Position")


def method_of(position: "Position | str") -> Method:
    """The attention method a scheme runs (every scheme but rope)."""
    position = Position(position)
    if position is Position.ROPE:
        raise ValueError("rope uses the model's own attention")
    return of_scheme(position.value)


def randomized(position: "Position | str") -> bool:
    """Whether a scheme's masks are drawn at random (s, seeds and trials matter): its method's
    declaration says (rope: no)."""
    position = Position(position)
    return position is not Position.ROPE and method_def(method_of(position)).randomized


def sigma_label(sigmas: Any) -> str:
    """A short name for a model's per-head bandwidths, the part of a trained scheme that tables and
    legends must tell apart: ``standard`` (the standard ALiBi slopes for its head count), ``sigma=V
    every head`` (one bandwidth, as the official code's sigma = 256), else the range and count."""
    sig = np.asarray([] if sigmas is None else list(sigmas), dtype=np.float64)
    if sig.size == 0:
        return ""
    if np.allclose(sig, alibi_sigmas(sig.size), rtol=1e-6):
        return "standard"
    if np.allclose(sig, sig[0], rtol=1e-9):
        return f"sigma={sig[0]:g} every head"
    return f"sigma {sig.min():g}..{sig.max():g} ({sig.size} heads)"


def model_label(position: str, s: Any = 0, dropout: Any = 0.0, sigmas: Any = "") -> str:
    """A trained model's scheme as tables and legends print it: position, s, attention dropout and,
    when not the standard slopes, its bandwidths (the training seed is shown or counted apart)."""
    s = int(s) if s == s and s else 0
    dropout = float(dropout) if dropout == dropout and dropout else 0.0
    sigmas = sigmas if isinstance(sigmas, str) else ""
    return (str(position) + (f" s={s}" if s else "") + (f" +dropout {dropout:g}" if dropout else "")
            + (f" ({sigmas})" if sigmas and sigmas != "standard" else ""))


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


@dataclass
class PositionState:
    """What a model's attention layers need to apply a scheme; shared by every layer.

    ``step`` is the training step whose masks are drawn (set by the training loop);
    ``eval_key`` replaces it for evaluation (fixed masks, so a validation loss replays).
    """

    position: Position
    sigmas: np.ndarray  # (H,) float64
    s: int = 0  # masks per head per step (the user's key s), 0 for a scheme that draws none
    window_sigmas: float = 4.0
    seed: int = 0
    step: int = 0
    backend: str = "auto"
    #: how the s masks of a head are drawn (poslsh_cli.numerics.sampling.Sampler)
    sampler: str = "iid"
    eval_key: str | None = None
    #: the checkpoint's own attention, untouched (an ALiBi checkpoint's inline attention)
    native: bool = False
    #: labels of the attention plans that ran (poslsh_cli.attention.Plan.label), as recorded by attend
    plans: set = field(default_factory=set, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)
    #: the poslsh_cli.lm.kvcache.ForgettingCache decoding with this scheme, if any
    _forgetting: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.position = Position(self.position)
        self.sigmas = np.asarray(self.sigmas, dtype=np.float64).reshape(-1)
        self.sampler = Sampler(self.sampler).value

    @classmethod
    def standard(cls, position: Position | str, heads: int, **kw: Any) -> "PositionState":
        """One sigma per head from the standard ALiBi slopes."""
        return cls(Position(position), alibi_sigmas(heads), **kw)

    def attention_spec(self, layer: int, n: int, scale: float | None) -> Any:
        """The :class:`~poslsh_cli.attention.AttentionSpec` of ``layer`` at length n, this step.
        Positional-LSH masks of head h come from ``derive_seed(seed, "masks", "step", t, layer, h)``
        (``"eval", key`` in place of the step while evaluating)."""
        from poslsh_cli.attention import AttentionSpec

        key = (self.step, self.eval_key, layer, n)
        spec = self._cache.get(key)
        if spec is not None:
            return spec
        method = method_of(self.position)
        tag = ("eval", self.eval_key) if self.eval_key is not None else ("step", self.step)
        rngs = [np.random.default_rng(derive_seed(self.seed, "masks", *tag, layer, h))
                for h in range(len(self.sigmas))] if method_def(method).randomized else None
        spec = AttentionSpec.build(method, self.sigmas, n, True, s=self.s, rng=rngs,
                                   window_sigmas=self.window_sigmas, scale=scale, sampler=self.sampler)
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[key] = spec
        return spec

    @property
    def label(self) -> str:
        """The scheme as a line names it: position, s where it draws masks, and a sampler other than iid
        (:func:`model_label`)."""
        return model_label(self.position.value, self.s if randomized(self.position) else 0) + (
            f" {self.sampler}" if randomized(self.position) and self.sampler != "iid" else "")

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items()
             if not k.startswith("_") and k not in ("step", "eval_key", "native", "plans")}
        if self.native:
            d["native"] = True
        if self.sampler == "iid":
            d.pop("sampler")  # the default: a checkpoint's position.json reads as before
        d["position"] = self.position.value
        d["sigmas"] = [float(x) for x in self.sigmas]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "PositionState":
        """The state a checkpoint saved (:meth:`to_json`); one saved before ``s`` had its name keeps it
        under ``num_samples``."""
        d = {("s" if k == "num_samples" else k): v for k, v in d.items()}
        return cls(**{k: v for k, v in d.items() if k in ("position", "sigmas", "s", "window_sigmas", "seed", "backend",
                                                          "native", "sampler")})

    @staticmethod
    def saved_s(d: dict) -> int:
        """The masks per head a checkpoint's saved scheme (its config's ``poslsh``) draws, under either name."""
        return int((d or {}).get("s", (d or {}).get("num_samples", 0)) or 0)


