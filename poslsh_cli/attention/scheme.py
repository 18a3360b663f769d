"""The scheme: an attention method with everything that fixes what it computes, from the user's keys
to the kernel (docs/ARCHITECTURE.md, "One scheme").

Every declared attention method is a scheme under its scheme name (:mod:`poslsh_cli.numerics.methods`),
plus a model's own rotary embedding:

    none          no positional information (NoPE): causal attention, no bias, no rotary
    fixed_block   one deterministic partition per head, width round(2 sigma_h)
    windowed      exact ALiBi within |i-j| <= ceil(c sigma_h)
    alibi         exact ALiBi, bias -|i-j| / sigma_h
    poslsh        Positional LSH: s masks per head
    rope          the architecture's own rotary embedding and attention

A :class:`Scheme` holds the position, ``s`` (the user's key, the masks per head), the per-head
bandwidths (the one rule: :func:`poslsh_cli.numerics.sampling.bandwidths`), the window, the sampler,
the seed and the attention path. It is what a checkpoint saves (``to_json``, the ``poslsh`` entry of
its config), what a command's keys build (:meth:`Scheme.of`), what names it in tables
(:attr:`Scheme.label`) and what gives the attention layer its spec (:meth:`Scheme.attention_spec`)
and plan (:meth:`Scheme.plan`). Masks of head h in layer l under the tag t come from
``derive_seed(seed, "masks", *t, l, h)``, so any step's or evaluation's masks replay.

Importing this module does not import torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from poslsh_cli.core.config import key
from poslsh_cli.numerics.methods import INFO, Method, method_def, of_scheme
from poslsh_cli.numerics.sampling import SAMPLER_HELP, Sampler, Slopes, alibi_sigmas, bandwidths, derive_seed


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


#: Position schemes: one per declared attention method (its scheme name), then ``rope``. The order
#: is the display order of every table and figure.
Position = _Schemes("Position", [(INFO[m].scheme.upper(), INFO[m].scheme) for m in Method] + [("ROPE", "rope")],
                    module=__name__, qualname="Position")


#: The ALiBi slopes a scheme takes when no sigma is given (the ``alibi`` key)
ALIBI_HELP = ("slopes when sigma=null: model = the model's own (ALiBi checkpoints only), standard = the ALiBi paper's, one per head (m_h = 2^(-8h/H) when H is a power of two; "
              "otherwise those of the next lower power of two, then every other slope of the next higher one, "
              "as HF get_alibi_slopes), auto = model where the model has ALiBi, else standard")

#: The keys that choose a scheme, declared once: what each means, the bound on its values and the noun
#: of one value in messages. A command declares such a key with :func:`scheme_key`, choosing only its
#: default, whether it sweeps (a tuple type) and a note on what it does in that command
#: (``tests/test_architecture.py`` holds every command's key of these names to this table).
SCHEME_KEYS: dict[str, tuple[str, dict[str, Any]]] = {
    "position": ("position schemes: " + ", ".join(p.value for p in Position), {"noun": "position"}),
    "s": ("Positional-LSH masks per head", {"ge": 1}),
    "sigma": ("bandwidth sigma = 1/slope, > 0", {"gt": 0}),
    "sampler": (SAMPLER_HELP, {"noun": "sampler"}),
    "window_sigmas": ("windowed ALiBi's half-width c in units of sigma: keys with |i-j| <= ceil(c sigma_h)",
                      {"gt": 0}),
    "alibi": (ALIBI_HELP, {}),
}


def scheme_key(name: str, default: Any, note: str = "", **bounds: Any) -> Any:
    """The spec field of the scheme key ``name`` (:data:`SCHEME_KEYS`): its declared meaning, then the
    command's ``note``; ``bounds`` widen a bound where the command gives a value a meaning of its own
    (``s=0``: the checkpoint's own)."""
    meaning, declared = SCHEME_KEYS[name]
    return key(f"{meaning}; {note}" if note else meaning, default, **{**declared, **bounds})


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
    """A short name for per-head bandwidths, the part of a trained scheme that tables and legends
    must tell apart: ``standard`` (the standard ALiBi slopes for its head count), ``sigma=V every
    head`` (one bandwidth, as the official code's sigma = 256), else the range and count."""
    sig = np.asarray([] if sigmas is None else list(sigmas), dtype=np.float64)
    if sig.size == 0:
        return ""
    if np.allclose(sig, alibi_sigmas(sig.size), rtol=1e-6):
        return "standard"
    if np.allclose(sig, sig[0], rtol=1e-9):
        return f"sigma={sig[0]:g} every head"
    return f"sigma {sig.min():g}..{sig.max():g} ({sig.size} heads)"


def model_label(position: str, s: Any = 0, dropout: Any = 0.0, sigmas: Any = "") -> str:
    """A scheme as tables and legends print it: position, s, attention dropout and, when not the
    standard slopes, its bandwidths (the training seed is shown or counted apart)."""
    s = int(s) if s == s and s else 0
    dropout = float(dropout) if dropout == dropout and dropout else 0.0
    sigmas = sigmas if isinstance(sigmas, str) else ""
    return (str(position) + (f" s={s}" if s else "") + (f" +dropout {dropout:g}" if dropout else "")
            + (f" ({sigmas})" if sigmas and sigmas != "standard" else ""))


#: masks per head of a Positional-LSH scheme swapped into a checkpoint that draws none of its own
#: (``s=0``: the checkpoint's own s, else this)
SWAP_S = 8

@dataclass
class Scheme:
    """An attention method with its s, bandwidths, window, sampler, seed and attention path.

    ``position`` is the scheme's name (:data:`Position`); ``sigmas`` one bandwidth per head (H,)
    float64; ``s`` the masks per head (the user's key; 0 for a scheme that draws none);
    ``window_sigmas`` the windowed scheme's c in ``w = ceil(c sigma_h)``; ``seed`` the root of the
    masks' seeds; ``backend`` the attention path (``auto``: the plan chooses); ``sampler`` how a
    head's s masks are drawn (:class:`~poslsh_cli.numerics.sampling.Sampler`)."""

    position: Position
    sigmas: np.ndarray
    s: int = 0
    window_sigmas: float = 4.0
    seed: int = 0
    backend: str = "auto"
    sampler: str = "iid"

    #: keys a subclass saves besides the scheme's fields (``to_json`` / ``from_json``)
    SAVED_EXTRA: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        self.position = Position(self.position)
        self.sigmas = np.asarray(self.sigmas, dtype=np.float64).reshape(-1)
        self.sampler = Sampler(self.sampler).value

    @classmethod
    def of(cls, position: "Position | str", heads: int, *, sigma: float | None = None,
           model_sigmas: "np.ndarray | None" = None, alibi: "Slopes | str" = Slopes.AUTO, s: int = 0,
           **keys: Any) -> Any:
        """The scheme a command's keys name: ``position``, ``s``, the bandwidths by the one rule (``sigma`` for every head; else a model's own slopes
        ``model_sigmas`` under ``alibi`` auto/model; else the standard slopes of ``heads``) and the
        other fields (window_sigmas, seed, backend, sampler) as given."""
        return cls(Position(position), bandwidths(heads, sigma, model_sigmas, alibi), s=s, **keys)

    @classmethod
    def standard(cls, position: "Position | str", heads: int, **kw: Any) -> Any:
        """One sigma per head from the standard ALiBi slopes."""
        return cls(Position(position), alibi_sigmas(heads), **kw)

    @property
    def method(self) -> Method:
        """The attention method it runs (ValueError for rope)."""
        return method_of(self.position)

    @property
    def draws(self) -> bool:
        """Whether its masks are drawn at random (s, seeds and trials matter)."""
        return randomized(self.position)

    @property
    def label(self) -> str:
        """The scheme as a line names it: position, s where it draws masks, and a sampler other than iid
        (:func:`model_label`)."""
        return model_label(self.position.value, self.s if self.draws else 0) + (
            f" {self.sampler}" if self.draws and self.sampler != "iid" else "")

    def attention_spec(self, layer: int, n: int, scale: float | None = None, tag: tuple = ("step", 0),
                       causal: bool = True) -> Any:
        """The :class:`~poslsh_cli.attention.AttentionSpec` of ``layer`` at length n: the masks of
        head h from ``derive_seed(seed, "masks", *tag, layer, h)``."""
        from poslsh_cli.attention.api import AttentionSpec

        method = self.method
        rngs = [np.random.default_rng(derive_seed(self.seed, "masks", *tag, layer, h))
                for h in range(len(self.sigmas))] if method_def(method).randomized else None
        return AttentionSpec.build(method, self.sigmas, n, causal, s=self.s, rng=rngs,
                                   window_sigmas=self.window_sigmas, scale=scale, sampler=self.sampler)

    def plan(self, q: Any, k: Any, v: Any, causal: bool = True, dropout: bool = False) -> Any:
        """The :class:`~poslsh_cli.attention.Plan` this scheme's attention takes for these tensors
        (its ``backend``, or the plan's choice for ``auto`` before any masks are drawn: at CPU
        inference past the dense bias :func:`~poslsh_cli.attention.attend` weighs the blocks against
        the union by the masks themselves)."""
        from poslsh_cli.attention.plan import plan_for

        return plan_for(self.method, q, k, v, causal, backend=self.backend, dropout=dropout, s=self.s)

    def to_json(self) -> dict:
        """What a checkpoint saves: every field, the sampler only when not iid."""
        d = {f.name: getattr(self, f.name) for f in fields(Scheme)}
        if self.sampler == "iid":
            d.pop("sampler")  # the default: a checkpoint's position.json reads as before
        d["position"] = self.position.value
        d["sigmas"] = [float(x) for x in self.sigmas]
        return d

    @classmethod
    def from_json(cls, d: dict) -> Any:
        """The scheme a checkpoint saved (:meth:`to_json`); one saved before ``s`` had its name keeps it
        under ``num_samples``."""
        d = {("s" if k == "num_samples" else k): v for k, v in d.items()}
        known = {f.name for f in fields(Scheme)} | set(cls.SAVED_EXTRA)
        return cls(**{k: v for k, v in d.items() if k in known})

    @staticmethod
    def saved_s(d: dict) -> int:
        """The masks per head a saved scheme (a checkpoint config's ``poslsh``) draws, under either name."""
        return int((d or {}).get("s", (d or {}).get("num_samples", 0)) or 0)
