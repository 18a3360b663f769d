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
its config), what a command's keys build (:meth:`Scheme.from_keys`, the one constructor from keys:
:class:`SchemeKeys` holds them as a command read them), what names it in tables
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
from poslsh_cli.numerics.sampling import SAMPLER_HELP, Sampler, alibi_sigmas, bandwidths, derive_seed
from poslsh_cli.attention.plan import plan_for
from poslsh_cli.core.errors import ConfigError


class Position(str, enum.Enum):
    """The position schemes, in the display order of every table and figure: one per declared
    attention method, under its scheme name (:attr:`poslsh_cli.numerics.methods.Method.scheme`; a
    mismatch fails at import), then ``rope``. A scheme of a method registered from outside is a
    member made on first use."""

    NONE = "none"
    FIXED_BLOCK = "fixed_block"
    WINDOWED = "windowed"
    ALIBI = "alibi"
    POSLSH = "poslsh"
    ROPE = "rope"

    @property
    def method(self) -> Method:
        """The attention method it runs (ValueError for rope, which runs the model's own)."""
        return method_of(self)

    @property
    def draws(self) -> bool:
        """Whether its masks are drawn at random (s, seeds and trials matter)."""
        return randomized(self)

    @classmethod
    def _missing_(cls, value: object) -> Any:
        try:  # the scheme of a method registered from outside (poslsh_cli.numerics.methods.register)
            of_scheme(value)  # type: ignore[arg-type]
        except (ValueError, TypeError):
            return None
        member = str.__new__(cls, value)
        member._name_, member._value_ = str(value).upper(), value
        return member


if [p.value for p in Position] != [INFO[m].scheme for m in Method] + ["rope"]:
    raise ImportError("poslsh_cli.attention.scheme: Position's members must be the declared methods' scheme "
                      "names, in their order, then rope")


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
    sigmas = np.asarray([] if sigmas is None else list(sigmas), dtype=np.float64)
    if sigmas.size == 0:
        return ""
    if np.allclose(sigmas, alibi_sigmas(sigmas.size), rtol=1e-6):
        return "standard"
    if np.allclose(sigmas, sigmas[0], rtol=1e-9):
        return f"sigma={sigmas[0]:g} every head"
    return f"sigma {sigmas.min():g}..{sigmas.max():g} ({sigmas.size} heads)"


def model_label(position: str, s: Any = 0, dropout: Any = 0.0, sigmas: Any = "") -> str:
    """A scheme as tables and legends print it: position, s, attention dropout and, when not the
    standard slopes, its bandwidths (the training seed is shown or counted apart)."""
    s = int(s) if s == s and s else 0
    dropout = float(dropout) if dropout == dropout and dropout else 0.0
    sigmas = sigmas if isinstance(sigmas, str) else ""
    return (str(position) + (f" s={s}" if s else "") + (f" +dropout {dropout:g}" if dropout else "")
            + (f" ({sigmas})" if sigmas and sigmas != "standard" else ""))


@dataclass(frozen=True)
class SchemeKeys:
    """The keys that choose a scheme (:data:`SCHEME_KEYS`) as a command read them, before a model says
    how many heads it has: what :meth:`Scheme.from_keys` builds a scheme from. ``sigma`` None: the
    model's own slopes or the standard ones, by ``alibi``."""

    position: Position
    s: int = 0
    sigma: float | None = None
    alibi: str = "auto"
    window_sigmas: float = 4.0
    sampler: str = "iid"
    seed: int = 0
    backend: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "position", Position(self.position))
        object.__setattr__(self, "sampler", Sampler(getattr(self.sampler, "value", self.sampler)).value)
        object.__setattr__(self, "alibi", str(getattr(self.alibi, "value", self.alibi)))

    @classmethod
    def of(cls, spec: Any, **given: Any) -> "SchemeKeys":
        """The keys of a command's ``spec`` (each field it declares under the same name: a command
        without ``alibi`` or ``sampler`` takes the default), ``given`` overriding them (one cell's
        position and s, the seed of the cell)."""
        names = [f.name for f in fields(cls)]
        found = {n: v for n in names if (v := getattr(spec, n, None)) is not None and not isinstance(v, (list, tuple))}
        return cls(**{**found, **given})


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
        self.s = int(self.s)
        self.sampler = Sampler(self.sampler).value

    @classmethod
    def from_keys(cls, keys: "SchemeKeys", heads: int, model_sigmas: "np.ndarray | None" = None,
                  **state: Any) -> Any:
        """The scheme a command's keys name, the one place a scheme is built from keys: the position,
        ``s`` where it draws masks (0 otherwise), the bandwidths by the one rule (``keys.sigma`` for
        every head; else a model's own slopes ``model_sigmas`` under ``keys.alibi`` auto/model; else the
        standard slopes of ``heads``), the window, sampler, seed and path; ``state``: a subclass's own
        fields (:class:`~poslsh_cli.lm.positions.PositionState`'s ``native``)."""
        position = Position(keys.position)
        return cls(position, bandwidths(heads, keys.sigma, model_sigmas, keys.alibi),
                   s=keys.s if position.draws else 0, window_sigmas=keys.window_sigmas, seed=keys.seed,
                   backend=keys.backend, sampler=Sampler(keys.sampler).value, **state)

    def swapped(self, position: "Position | str", s: int, seed: int, **fields_: Any) -> Any:
        """This scheme's bandwidths and window under another ``position`` (a scheme swapped into a
        checkpoint): ``s`` masks where it draws them, fresh state, ``fields_`` (sampler, backend) as given."""
        position = Position(position)
        return type(self)(position, self.sigmas, s=s if position.draws else 0, window_sigmas=self.window_sigmas,
                          seed=seed, **{"sampler": self.sampler, **fields_})

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
        return plan_for(self.method, q, k, v, causal, backend=self.backend, dropout=dropout, s=self.s)

    def to_json(self) -> dict:
        """What a checkpoint saves (its config.json's ``poslsh``), in layout :data:`SCHEME_LAYOUT`:
        every field, the sampler only when not iid."""
        d = {"layout": SCHEME_LAYOUT, **{f.name: getattr(self, f.name) for f in fields(Scheme)}}
        if self.sampler == "iid":
            d.pop("sampler")  # the default
        d["position"] = self.position.value
        d["sigmas"] = [float(x) for x in self.sigmas]
        return d

    @classmethod
    def from_json(cls, d: dict, where: object = "the saved scheme") -> Any:
        """The scheme a checkpoint saved (:meth:`to_json`), of any layout (:func:`migrate`)."""
        d = migrate(d, where)
        known = {f.name for f in fields(Scheme)} | set(cls.SAVED_EXTRA)
        return cls(**{k: v for k, v in d.items() if k in known})


#: The layout of a saved scheme (its ``layout``; none: 1, which named ``s`` ``num_samples`` in the
#: oldest checkpoints)
SCHEME_LAYOUT = 2


def migrate(d: dict, where: object = "the saved scheme") -> dict:
    """A saved scheme of any layout in this version's (the one migration every reader goes through):
    layout 1 (no ``layout``) may name ``s`` ``num_samples``; a layout newer than this version reads is
    one error line naming ``where``."""
    layout = d.get("layout", 1)
    if not isinstance(layout, int) or layout > SCHEME_LAYOUT:
        raise ConfigError(f"{where}: the scheme has layout {layout!r}, newer than this poslsh reads "
                          f"({SCHEME_LAYOUT}): upgrade poslsh")
    if layout == 1:
        d = {("s" if k == "num_samples" else k): v for k, v in d.items()}
    return {k: v for k, v in d.items() if k != "layout"}
