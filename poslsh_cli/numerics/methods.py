"""The attention methods every command compares (docs/THEORY.md, "Attention"), each declared once,
in a module without torch at import so that command specs can name them before the numerical
stack is imported (docs/ARCHITECTURE.md, "Adding an attention method").

A method is one :class:`MethodDef` in :data:`DECLARED`; everything else asks it:

- ``score(p, h, qi, kj)``: the additive logit bias of query position ``qi`` and key position ``kj``
  in head ``h`` (tensors that broadcast, FlexAttention's ``score_mod`` convention; ``-inf`` drops
  a pair), from the call's per-head parameters ``p`` (:class:`HeadParams`). The float64 reference,
  the dense bias of the generic kernels, FlexAttention's generic ``score_mod`` and attention at
  explicit positions (cached decoding) all evaluate it. None: no bias.
- ``keep(p, h, qi, kj)``: its key mask (FlexAttention's ``mask_mod``), None: every key (causality
  is the caller's).
- ``params``: what :meth:`AttentionSpec.build <poslsh_cli.attention.AttentionSpec.build>` draws or
  derives for it; ``randomized`` follows (sampled partitions: seeds, trials and s matter).
- ``forget(spec, t)``: how a key/value cache may forget: the earliest key position a query at a
  position >= t may still see (None: every key stays needed; :mod:`poslsh_cli.lm.kvcache`).
- ``kernels``: the backends it runs on, each with the kernel family that implements it there
  (:data:`poslsh_cli.attention.api.KERNELS`); the first is its CPU inference default, and the
  float64 ``reference`` (its score) is always there.

:class:`Method` has one member per declaration in :data:`DECLARED` (a mismatch fails at import),
whose order is the display order of every table and figure: no positional bias first, then the baselines from the coarsest, then exact ALiBi
and Positional LSH. :func:`register` declares a method from outside this module (a test, a
plug-in): it runs on every attention path; the commands list the declared ones. An unknown method
raises (ValueError) wherever it is asked for.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import numpy as np

from poslsh_cli.numerics.sampling import bin_index

#: What a method needs besides q, k, v and one sigma per head.
Params = Literal["none", "sampled_partitions", "fixed_partitions", "window"]
#: Kernel families (:data:`poslsh_cli.attention.api.KERNELS`): ``none`` bias-free SDPA; ``alibi``
#: the ALiBi kernels (-m_h |i-j|, with the spec's window); ``partitions`` the block-diagonal mask
#: kernels (blocks, union, one FlexAttention call per mask, the dense log M~ band); ``score`` the
#: generic ones, built from the method's score and keep (dense bias, FlexAttention score_mod).
Family = Literal["none", "alibi", "partitions", "score"]


@dataclass(frozen=True)
class HeadParams:
    """One call's per-head parameters on its device, what ``score``/``keep`` read (built from an
    :class:`~poslsh_cli.attention.AttentionSpec` by :func:`poslsh_cli.attention.reference.head_params`).

    ``slopes`` (H,) ``m_h = 1 / sigma_h`` in ``dtype`` (the bias dtype); ``window`` (H,) int64 key
    half-widths or None; ``widths``, ``shifts`` (H, s) float64 bin widths and shifts or None."""

    slopes: Any
    dtype: Any
    window: Any = None
    widths: Any = None
    shifts: Any = None


Score = Callable[[HeadParams, Any, Any, Any], Any]
Forget = Callable[[Any, np.ndarray], "np.ndarray | None"]


@dataclass(frozen=True)
class MethodDef:
    """One method, declared once (module docstring). ``name`` is its :class:`Method` value;
    ``scheme`` its name as a position scheme (``position=`` of ``train``, ``attention=`` of
    ``perplexity``); ``baseline``: output-error reports it beside Positional LSH."""

    name: str
    scheme: str
    params: Params
    baseline: bool
    summary: str
    score: Score | None = None
    keep: Score | None = None
    forget: Forget | None = None
    kernels: Mapping[str, Family] = field(default_factory=lambda: {"dense": "score", "flex": "score"})

    @property
    def randomized(self) -> bool:
        """Its masks are drawn at random (seeds, trials, s)."""
        return self.params == "sampled_partitions"

    @property
    def backends(self) -> tuple[str, ...]:
        """Backend names it runs on (the first its CPU inference default), the reference last."""
        return (*self.kernels, "reference")

    def family(self, backend: str) -> Family:
        """The kernel family that runs it on ``backend`` (ValueError: it has none there)."""
        if backend == "reference":
            return "score"
        if backend not in self.kernels:
            raise ValueError(f"method {self.name} has no backend {backend!r} (choose from {', '.join(self.backends)})")
        return self.kernels[backend]


# --- scores, key masks and forgetting rules of the declared methods ----------------------------

def distance_bias(slopes: Any, h: Any, qi: Any, kj: Any, dtype: Any = None) -> Any:
    """The ALiBi logit bias ``-m_h |i - j|`` (the one definition: every ALiBi path calls it), for
    slopes (H,) indexed by ``h`` and positions ``qi``, ``kj`` (broadcasting tensors); the distance
    is taken in ``dtype`` (default the slopes')."""
    return -slopes[h] * abs(qi - kj).to(slopes.dtype if dtype is None else dtype)


def alibi_score(p: HeadParams, h: Any, qi: Any, kj: Any) -> Any:
    return distance_bias(p.slopes, h, qi, kj)


def window_keep(p: HeadParams, h: Any, qi: Any, kj: Any) -> Any:
    """``|i - j| <= w_h`` (:class:`poslsh_cli.numerics.masks.Window`)."""
    from poslsh_cli.numerics.masks import Window

    return Window(p.window)(None, h, qi, kj)


def same_bin_score(p: HeadParams, h: Any, qi: Any, kj: Any) -> Any:
    """``log #{k : bin_k(i) = bin_k(j)} / s`` per head (``log 0 = -inf``): the log of the mean of
    the s block-diagonal masks (docs/THEORY.md, "Mask expectation"), bins from :func:`bin_index`."""
    s = p.widths.shape[-1]
    count = None
    for k in range(s):  # one (.., m, n) comparison at a time: memory independent of s
        w, u = p.widths[h, k], p.shifts[h, k]
        same = (bin_index(qi, w, u) == bin_index(kj, w, u)).to(p.dtype)
        count = same if count is None else count + same
    return (count / s).log()


def forget_window(spec: Any, t: np.ndarray) -> np.ndarray:
    """A window: keys before ``t - max_h w_h`` are never seen again."""
    return t - int(max(spec.window))


def forget_blocks(spec: Any, t: np.ndarray) -> np.ndarray:
    """Contiguous blocks that move forward: keys before the earliest start of t's block, over every
    sample and head (at most the largest block back, O(sigma log s))."""
    widths, shifts = (a.reshape(-1) for a in spec.bin_table)  # (H s,)
    block = bin_index(t.astype(np.float64)[:, None], widths[None], shifts[None])  # t's block, every sample
    # its first position is ceil(block * width - shift); one less keeps the rounding on the safe side
    start = np.floor(block * widths[None] - shifts[None]) - 1
    return start.min(axis=1).astype(np.int64)


#: The declared methods, in display order.
DECLARED: tuple[MethodDef, ...] = (
    MethodDef("no_bias", "none", "none", True, "no positional bias (NoPE)",
              kernels={"sdpa": "none"}),
    MethodDef("fixed_block", "fixed_block", "fixed_partitions", True,
              "one fixed block-diagonal mask per head, blocks of round(2 sigma)",
              score=same_bin_score, forget=forget_blocks,
              kernels={"blocks": "partitions", "flex": "partitions", "union": "partitions", "dense": "partitions"}),
    MethodDef("windowed", "windowed", "window", True, "exact ALiBi within |i-j| <= ceil(c sigma)",
              score=alibi_score, keep=window_keep, forget=forget_window,
              kernels={"chunked": "alibi", "flex": "alibi", "dense": "alibi"}),
    MethodDef("exact", "alibi", "none", False, "exact ALiBi, bias -|i-j|/sigma", score=alibi_score,
              kernels={"chunked": "alibi", "flex": "alibi", "dense": "alibi", "rank1": "alibi"}),
    MethodDef("poslsh", "poslsh", "sampled_partitions", False, "Positional LSH: the mean of s sampled masks",
              score=same_bin_score, forget=forget_blocks,
              kernels={"blocks": "partitions", "union": "partitions", "flex": "partitions", "dense": "partitions"}),
)

_REGISTERED: dict[str, MethodDef] = {}


class Method(str, enum.Enum):
    """The attention methods every command compares, one member per declaration of :data:`DECLARED`
    in its order (checked at import); a method :func:`register` declares from outside is a member
    made on first use. Its scheme name (:attr:`scheme`) is what a language-model command calls it
    (``exact`` runs as ``alibi``, ``no_bias`` as ``none``): the results of matrix-error,
    output-error and bench name methods, those of train, perplexity and the rest name schemes."""

    NO_BIAS = "no_bias"
    FIXED_BLOCK = "fixed_block"
    WINDOWED = "windowed"
    EXACT = "exact"
    POSLSH = "poslsh"

    @property
    def scheme(self) -> str:
        """Its name as a position scheme (:class:`poslsh_cli.attention.scheme.Position`)."""
        return method_def(self).scheme

    @classmethod
    def _missing_(cls, value: object) -> Any:
        if isinstance(value, str) and value in _REGISTERED:  # a method declared by register()
            member = str.__new__(cls, value)
            member._name_, member._value_ = value.upper(), value
            cls._value2member_map_[value] = member
            return member
        return None


if [m.value for m in Method] != [d.name for d in DECLARED]:
    raise ImportError("poslsh_cli.numerics.methods: Method's members must be DECLARED's names, in its order")

#: The declared methods by member.
INFO: dict[Any, MethodDef] = {Method(d.name): d for d in DECLARED}


def method_def(method: Any) -> MethodDef:
    """The declaration of ``method`` (a :class:`Method` or its value); ValueError when unknown."""
    m = Method(method)
    defn = INFO.get(m) or _REGISTERED.get(m.value)
    if defn is None:  # a member of a method taken back (unregister)
        raise ValueError(f"{m.value!r} is not a declared attention method")
    return defn


def register(defn: MethodDef) -> Any:
    """Declare ``defn`` from outside this module; returns its :class:`Method` (not in ``list(Method)``:
    the commands list the declared methods). :func:`unregister` takes it back."""
    if defn.name in {d.name for d in DECLARED}:
        raise ValueError(f"method {defn.name} is declared already")
    _REGISTERED[defn.name] = defn
    return Method(defn.name)


def unregister(name: str) -> None:
    _REGISTERED.pop(name, None)
    Method._value2member_map_.pop(name, None)


def baselines() -> list[Any]:
    """The methods output-error compares with Positional LSH, in display order."""
    return [m for m in Method if INFO[m].baseline]


def of_scheme(scheme: str) -> Any:
    """The method behind a position scheme name (``alibi`` -> ``exact``), declared or registered."""
    for d in (*DECLARED, *_REGISTERED.values()):
        if d.scheme == scheme:
            return Method(d.name)
    raise ValueError(f"no attention method for scheme {scheme!r}")
