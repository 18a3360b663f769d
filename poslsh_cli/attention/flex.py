"""FlexAttention paths: exact or windowed ALiBi with a ``score_mod``, any method from its declared
score and key mask (:func:`score_flex`), Positional LSH one mask at a time with the sampled bins as document ids (the per-mask route; the union route is
:mod:`poslsh_cli.attention.union`). Block masks come from the key intervals of
:mod:`poslsh_cli.numerics.masks`, never from an n x n grid. Compiled on CUDA; uncompiled they run
anywhere (densely), which is how the tests check them on the CPU at sizes with many 128-token tiles.

Every call goes through :func:`flex_call`, which

- compiles ``flex_attention`` at static shapes for the first :data:`STATIC_CALLS` distinct shapes
  of each kind of call in a process (kernels specialised to their sizes) and with dynamic shapes
  beyond them (lengths and head counts symbolic: a workload of many shapes compiles a bounded
  number of times), each under
  a recompile limit that fails loudly instead of running the unfused fallback (which materialises
  every score: 256 GiB at n = 131072): at the static limit that kind of call moves to the dynamic
  kernels, at the dynamic limit their cache starts afresh;
- refuses an uncompiled call on CUDA at a size where the dense fallback would materialise more
  than :data:`EAGER_MAX_BYTES` of scores;
- zero-pads heads narrower than :data:`MIN_HEAD_DIM` (the CUDA kernel's minimum): zero coordinates
  change no ``q . k`` and give zero output columns, which are cut off, so the result is exact.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from poslsh_cli.attention.merge import merge_by_lse
from poslsh_cli.attention.plan import needs_grad
from poslsh_cli.attention.reference import slopes_from_sigmas, scale_of
from poslsh_cli.numerics import masks
from poslsh_cli.numerics.methods import HeadParams, Score, distance_bias
from poslsh_cli.attention.transfer import drawn_scalars
from poslsh_cli.numerics.sampling import Partitions, bin_index, longest_block

#: The CUDA kernel's smallest head dimension: narrower heads are zero-padded to it (exact).
MIN_HEAD_DIM = 16
#: Bytes an uncompiled (dense) FlexAttention call may hold on CUDA before it is refused
#: (:func:`eager_bytes`).
EAGER_MAX_BYTES = 2**31


def eager_bytes(batch: int, heads: int, n: int, m: int, dtype: torch.dtype) -> int:
    """What an uncompiled FlexAttention call holds at once for (batch, heads, n queries, m keys): per
    (query, key) pair the scores, the scores after ``score_mod`` and their softmax (each in the
    score dtype: float32, float64 for float64 inputs), the mask's bool and an int64 index grid."""
    elem = torch.promote_types(dtype, torch.float32).itemsize
    return batch * heads * n * m * (3 * elem + 1 + 8)
#: Compiled variants of each compiled ``flex_attention`` kept at once; reaching it drops that
#: function's variants and compiles afresh (never the unfused fallback).
RECOMPILE_LIMIT = 64
#: Distinct shapes (of q, k and the tables a score_mod reads) compiled at static shapes per kind of
#: call (path, dtype, lse, autograd): kernels specialised to their sizes (tiles known to divide the
#: length, no bounds checks; faster than the dynamic-shape kernel at long n). Further shapes of a
#: kind share one kernel compiled with dynamic shapes, so a workload of many lengths (evaluation at
#: several lengths, padded batches) compiles a bounded number of times.
STATIC_CALLS = 8

_COMPILED: dict[bool, Any] = {}
_STATIC: dict[tuple, set] = {}
_DYNAMIC_KINDS: set = set()


def flex_function(compiled: bool, dynamic: bool = False) -> Any:
    """``flex_attention``, plain, or compiled once per process (``fullgraph``) at static shapes or
    with dynamic shapes (a copy of the function, so the two keep separate compile caches)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return _uncompiled(flex_attention)
    if dynamic not in _COMPILED:
        _COMPILED[dynamic] = torch.compile(_twin(flex_attention) if dynamic else flex_attention, fullgraph=True,
                                           dynamic=dynamic)
    return _COMPILED[dynamic]


def _uncompiled(fn: Any) -> Any:
    """``fn`` without PyTorch's multi-line notice that an uncompiled call materialises its scores: the
    uncompiled calls here are the CPU's and the tests', meant as the dense reference path (CUDA refuses
    the large ones, :func:`flex_call`)."""
    import functools
    import warnings

    @functools.wraps(fn)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return fn(*args, **kwargs)

    return quiet


def _twin(fn: Any) -> Any:
    """The same function under a code object of its own (dynamo keeps one compile cache per code)."""
    import types

    code = fn.__code__.replace(co_name=fn.__name__ + "_dynamic")
    twin = types.FunctionType(code, fn.__globals__, fn.__name__ + "_dynamic", fn.__defaults__, fn.__closure__)
    twin.__kwdefaults__ = fn.__kwdefaults__
    return twin


class FlexTooLarge(ValueError):
    """An uncompiled FlexAttention call on CUDA that would materialise its scores."""


def flex_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, compiled: bool,
              score_mod: Any = None, block_mask: Any = None, lse: bool = False,
              enable_gqa: bool = False, sizes: tuple = ()) -> Any:
    """One FlexAttention call (see the module docstring for what it guards).

    Args:
        q: (B, Hq, n, d); k, v: (B, Hkv, m, d) (``enable_gqa`` when Hq is a multiple of Hkv).
        scale: the logit scale (explicit: padding must not change it).
        compiled: the compiled kernel (CUDA) or the dense eager implementation (tests).
        lse: also return the natural-log normaliser.
        sizes: the sizes of tensors ``score_mod`` or the mask read that a static kernel is
            specialised to (the union route's table), telling calls apart.

    Returns ``out`` (B, Hq, n, d) in q's dtype, or ``(out, lse (B, Hq, n) float32)``.
    """
    B, Hq, n, d = q.shape
    need = eager_bytes(B, Hq, n, k.shape[-2], q.dtype)
    if not compiled and q.is_cuda and need > EAGER_MAX_BYTES:
        raise FlexTooLarge(f"uncompiled FlexAttention would materialise {need / 2**30:.1f} GiB of scores, masks and "
                           f"indices (B={B}, heads={Hq}, n={n}); it runs compiled on CUDA")
    if d < MIN_HEAD_DIM:
        pad = (0, MIN_HEAD_DIM - d)
        q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
    # One tensor passed as two of q, k, v after a call whose mask held tensors makes PyTorch's
    # recompile-reason check read that old mask's fields on the new one and raise; distinct views of
    # the same storage cost nothing and keep the calls apart.
    if k is q:
        k = k.view(k.shape)
    if v is q or v is k:
        v = v.view(v.shape)
    kw: dict[str, Any] = {"score_mod": score_mod, "block_mask": block_mask, "scale": float(scale),
                          "enable_gqa": enable_gqa}
    if lse:
        from torch.nn.attention.flex_attention import AuxRequest

        kw["return_aux"] = AuxRequest(lse=True)
    res = _compiled(q, k, v, kw, sizes) if compiled else flex_function(False)(q, k, v, **kw)
    out, aux = res if lse else (res, None)
    if d < MIN_HEAD_DIM:
        out = out[..., :d]
    return (out, aux.lse) if lse else out


def _compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict, sizes: tuple = ()) -> Any:
    """The compiled call: at static shapes for the first :data:`STATIC_CALLS` distinct shapes of its
    kind, with dynamic shapes beyond them; under a recompile limit that raises instead of falling
    back unfused: at the static function's limit this kind moves to the dynamic kernels for good (the
    other kinds keep their static ones), at the dynamic function's limit its variants are dropped
    and this call compiles afresh."""
    import torch._dynamo

    kind = (q.dtype, q.device, _describe(kw["score_mod"]), _describe(getattr(kw["block_mask"], "mask_mod", None)),
            "return_aux" in kw, kw["enable_gqa"],
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    shapes = _STATIC.setdefault(kind, set())
    call = (tuple(q.shape), tuple(k.shape), sizes)
    if call not in shapes and len(shapes) < STATIC_CALLS and kind not in _DYNAMIC_KINDS:
        shapes.add(call)
    dynamic = call not in shapes
    if torch.compiler.is_compiling():  # inside a caller's own torch.compile: it traces the call
        return flex_function(True, dynamic)(q, k, v, **kw)
    cfg = {name: value for name, value in (("recompile_limit", RECOMPILE_LIMIT), ("fail_on_recompile_limit_hit", True))
           if hasattr(torch._dynamo.config, name)}
    limit_hit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", RuntimeError)
    with torch._dynamo.config.patch(**cfg):
        try:
            return flex_function(True, dynamic)(q, k, v, **kw)
        except limit_hit:
            if not dynamic:  # the static kernels are full: this kind goes dynamic, the others keep theirs
                _DYNAMIC_KINDS.add(kind)
                shapes.discard(call)
                return flex_function(True, True)(q, k, v, **kw)
            torch._C._dynamo.eval_frame.reset_code(_code_of(flex_function(True, True)))  # dynamic ones: afresh
            return flex_function(True, True)(q, k, v, **kw)


def _describe(fn: Any) -> Any:
    """What dynamo specialises a score or mask function on: its code and the types of what it closes
    over (a causal mask and a window are different kernels with the same mask function)."""
    if fn is None:
        return None
    cells = tuple(_kind_of(c.cell_contents) for c in (getattr(fn, "__closure__", None) or ()))
    return getattr(fn, "__code__", None), cells


def _kind_of(obj: Any) -> Any:
    parts = getattr(obj, "parts", None)
    return (type(obj).__name__, tuple(_kind_of(p) for p in parts)) if parts is not None else type(obj).__name__


def _code_of(compiled: Any) -> Any:
    """The code object a ``torch.compile``d function's cache hangs on."""
    orig = getattr(compiled, "_torchdynamo_orig_callable", compiled)
    return orig.__code__


@functools.lru_cache(maxsize=4)
def _static_block_mask(causal: bool, window: tuple[int, ...] | None, heads: int, n: int, device: str,
                       q_blocks: bool) -> Any:
    """The ``BlockMask`` of exact or windowed ALiBi: it depends only on these arguments, so it is
    built once (one group for the causal mask alone, one per head with per-head windows)."""
    win = None if window is None else masks.Window.of(list(window), heads, device)
    keep = masks.combine(causal, win)
    if keep is None:
        return None
    return masks.block_mask(keep, heads if win is not None else 1, n, device, q_blocks=q_blocks)


@functools.lru_cache(maxsize=16)
def _slopes(sigmas: tuple[float, ...], device: str) -> torch.Tensor:
    return slopes_from_sigmas(sigmas, torch.float32, device)  # the scores are float32 inside the kernel


def alibi_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, causal: bool,
               window: int | Sequence[int] | None = None, scale: float | None = None,
               compiled: bool = True) -> torch.Tensor:
    """Exact (or windowed) ALiBi with FlexAttention: a ``score_mod`` adds ``-m_h |i-j|``
    (:func:`~poslsh_cli.numerics.methods.distance_bias`, per element).

    Args:
        q, k, v: (B, H, n, d), float16/bfloat16/float32; queries, keys, values.
        sigmas: (H,) kernel bandwidths.
        causal: drop keys j > i.
        window: None, one half-width for every head or one per head (keys with ``|i-j| > w_h``
            are dropped).
        compiled: run ``torch.compile``d (CUDA); uncompiled it runs anywhere (tests).

    Returns (B, H, n, d) in q's dtype.
    """
    B, H, n, d = q.shape
    dev = str(q.device)
    slopes = _slopes(tuple(float(x) for x in torch.as_tensor(sigmas).reshape(-1).tolist()), dev)

    def score_mod(score, b, h, qi, kj):  # noqa: ANN001
        return score + distance_bias(slopes, h, qi, kj, score.dtype)

    win = None if window is None else tuple(int(w) for w in torch.as_tensor(window).reshape(-1).expand(H).tolist())
    bm = _static_block_mask(bool(causal), win, H, n, dev, needs_grad(q, k, v))
    return flex_call(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale_of(d, scale), compiled=compiled)


def score_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: HeadParams, score: Score | None,
               keep: Score | None, causal: bool, scale: float | None = None, compiled: bool = True) -> torch.Tensor:
    """A method from its declaration (:class:`~poslsh_cli.numerics.methods.MethodDef`) with
    FlexAttention: the ``score_mod`` adds ``score(params, h, qi, kj)`` and drops (``-inf``) the keys
    ``keep`` drops; the block mask is causality alone (``keep`` must keep the diagonal).

    Args:
        q, k, v: (B, H, n, d), float16/bfloat16/float32; queries, keys, values.
        params: per-head parameters (slopes in float32, the kernel's score dtype).
        compiled: run ``torch.compile``d (CUDA); uncompiled it runs anywhere (tests).

    Returns (B, H, n, d) in q's dtype.
    """
    B, H, n, d = q.shape

    def score_mod(s, b, h, qi, kj):  # noqa: ANN001
        if score is not None:
            s = s + score(params, h, qi, kj).to(s.dtype)
        if keep is not None:
            s = torch.where(keep(params, h, qi, kj), s, torch.full_like(s, float("-inf")))
        return s

    bm = _static_block_mask(bool(causal), None, H, n, str(q.device), needs_grad(q, k, v))
    return flex_call(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale_of(d, scale), compiled=compiled)


@dataclass(frozen=True)
class FlexLayout:
    """Sampled partitions as the per-mask FlexAttention route sees them: sample k is one call over
    the H heads whose ``BlockMask`` keeps keys in the same bin (and causal, when asked).

    ``widths``, ``shifts`` (H, s) float64 on the device (one non-blocking copy of the drawn
    scalars); ``longest[k]`` bounds sample k's blocks (host), so each ``BlockMask`` is sized without
    reading the device. A sample's bins (H, n) and ``BlockMask`` are built when the sample runs
    (:meth:`block_mask`): memory O(H n + H tiles^2) for one sample, not s.
    """

    heads: int
    num_samples: int
    seq_len: int
    causal: bool
    widths: torch.Tensor
    shifts: torch.Tensor
    longest: tuple[int, ...]

    @classmethod
    def build(cls, partitions: Sequence[Partitions], causal: bool,
              device: torch.device | str = "cpu") -> "FlexLayout":
        H, s, n = len(partitions), partitions[0].num_samples, partitions[0].seq_len
        widths = np.stack([p.widths for p in partitions])  # (H, s)
        w, u = drawn_scalars(partitions, device)
        return cls(H, s, n, causal, w, u, tuple(int(x) for x in longest_block(widths.max(0), n)))

    def block_mask(self, sample: int, q_blocks: bool = True) -> Any:
        """The ``BlockMask`` of one sample (H groups, the heads), from its bins (H, n)."""
        i = torch.arange(self.seq_len, dtype=torch.float64, device=self.widths.device)
        doc = bin_index(i, self.widths[:, sample, None], self.shifts[:, sample, None]).to(torch.int64)
        keep = masks.combine(self.causal, block=masks.SameBlock.of(doc, self.longest[sample]))
        return masks.block_mask(keep, self.heads, self.seq_len, self.widths.device, q_blocks=q_blocks)


def poslsh_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partitions: Sequence[Partitions] | None,
                causal: bool, scale: float | None = None, compiled: bool | None = None,
                layout: FlexLayout | None = None) -> torch.Tensor:
    """Positional-LSH attention with FlexAttention, one mask at a time: sample k is one call over the
    H heads with the sampled bins as document ids, its ``lse`` returned by the kernel, and the
    samples merged by lse. Without gradients the merge runs as the samples come (a running
    log-sum-exp), so memory is two outputs whatever s is; with gradients the s outputs are kept for
    the backward pass (the plan trains on the union route, :mod:`poslsh_cli.attention.union`).

    Args:
        q, k, v: (B, H, n, d), float16/bfloat16/float32; queries, keys, values.
        partitions: H partitions with the same s (ignored when ``layout`` is given).
        layout: a prepared :class:`FlexLayout` for the same H, n and causal flag.
        compiled: default: compiled on CUDA; uncompiled (dense, slow) elsewhere, which is how the
            tests check it.

    Returns (B, H, n, d) in q's dtype.
    """
    B, H, n, d = q.shape
    if layout is None:
        layout = FlexLayout.build(partitions, causal, q.device)
    if layout.causal != causal or layout.heads != H or layout.seq_len != n:
        raise ValueError("the FlexLayout was built for another causal flag, head count or length")
    comp = q.is_cuda if compiled is None else compiled
    grad = needs_grad(q, k, v)
    sc = scale_of(d, scale)

    def one(sample: int, lse: bool = True) -> Any:
        return flex_call(q, k, v, block_mask=layout.block_mask(sample, grad), scale=sc, compiled=comp, lse=lse)

    if layout.num_samples == 1:  # one mask: no merge, no lse
        return one(0, lse=False)
    if grad:
        outs, lses = zip(*(one(j) for j in range(layout.num_samples)))
        return merge_by_lse(torch.stack(outs, 2), torch.stack(lses, 2).float(), dim=2)[0]
    # the running state in float64: each step rounds the running log-normaliser (about 30 at logits of
    # +-30) and rescales the output, and in float32 s such roundings add up (1.2e-4 at s = 60, where one
    # float32 attention errs by 3e-6); in float64 the merge adds nothing to the kernel's own rounding
    acc = torch.float64
    out, total = None, None
    for j in range(layout.num_samples):  # running merge: out = sum_k exp(lse_k - LSE) O_k
        o, l = one(j)
        l = l.to(acc)
        if out is None:
            out, total = o.to(acc), l
            continue
        new = torch.logaddexp(total, l)
        out.mul_(torch.exp(total - new)[..., None]).addcmul_(o, torch.exp(l - new)[..., None])  # o widened on the fly
        total = new
    return out.to(q.dtype)
