"""Attention operators against float64 dense references, and exact identities."""
import math
import numpy as np
import pytest
import torch

from poslsh_cli.attention import (AttentionSpec, Backend, BlockLayout, Kernel, Method, Plan, alibi_chunked, attend,
                                  per_sample_block_attention, exact_alibi, laplacian_weight, mean_mask_weight, merge_by_lse,
                                  no_bias_attention, poslsh_attention, reference_attention)
from poslsh_cli.numerics.sampling import alibi_sigmas, fixed_block_partitions, sample_partitions


def qkv(B=2, H=4, n=57, d=8, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(B, H, n, d, generator=g, dtype=dtype) for _ in range(3)]


def naive_tolerance(q, k, v, weight, causal, dtype, scale=None):
    """Twice the max error of the naive dense implementation in ``dtype`` against float64, plus
    one rounding of the output in ``dtype``: what a fast path in that precision may be off by."""
    ref, _ = reference_attention(q, k, v, weight, causal, scale)
    naive, _ = reference_attention(q.to(dtype), k.to(dtype), v.to(dtype), weight, causal, scale, dtype=dtype)
    return 2 * (naive.double() - ref).abs().max().item() + torch.finfo(dtype).eps * ref.abs().max().item()


def parts_for(n, sigmas, s, seed=0):
    g = np.random.default_rng(seed)
    return [sample_partitions(n, float(sg), s, g) for sg in sigmas]


@pytest.fixture(params=[Kernel.FUSED, Kernel.MATMUL])
def blocks(request):
    """Positional-LSH attention on the blocks backend with each kernel forced by its plan: the fused
    CPU flash kernel and the padded matmuls (what the plan picks without and with gradients)."""
    def run(q, k, v, parts, causal, method=Method.POSLSH):
        spec = AttentionSpec(method, [p.sigma for p in parts], causal, partitions=tuple(parts))
        return attend(q, k, v, spec, plan=Plan(method, Backend.BLOCKS, request.param))

    return run


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,s", [(1, 3), (2, 1), (57, 1), (57, 8), (200, 16)])
def test_merged_block_attention_equals_dense_mean_mask(n, s, causal, blocks):
    """T~ = D~^-1 (A o M~) V exactly: the identity the paper's algorithm rests on."""
    sigmas = [0.4, 3.0, 20.0, 1e3]
    q, k, v = qkv(n=n, H=4, scale=1.5)
    parts = parts_for(n, sigmas, s)
    got = blocks(q, k, v, parts, causal)
    ref, _ = reference_attention(q, k, v, mean_mask_weight(parts), causal)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [57, 300])
def test_flex_backend_equals_dense_mean_mask(n, causal):
    """The FlexAttention path (bins as document ids, kernel lse), uncompiled on CPU, in float32:
    at most twice the naive float32 implementation's error against float64."""
    q, k, v = qkv(B=2, H=3, n=n, d=16)
    parts = parts_for(n, [0.5, 6.0, 90.0], 5)
    w = mean_mask_weight(parts)
    ref, _ = reference_attention(q, k, v, w, causal)
    got = poslsh_attention(q.float(), k.float(), v.float(), parts, causal, backend="flex")
    err = (got.double() - ref).abs().max().item()
    assert err <= naive_tolerance(q, k, v, w, causal, torch.float32), err


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_paths_equal_reference(causal):
    """Compiled FlexAttention (exact, windowed per head, Positional LSH on the union and per-mask
    routes) and the block path on CUDA at n=1000 (eight key tiles), within twice the naive float32
    error against float64."""
    from poslsh_cli.numerics import masks

    q64, k64, v64 = qkv(B=1, H=4, n=1000, d=64)
    q, k, v = (t.cuda().float() for t in (q64, k64, v64))
    sig = torch.tensor([1.0, 4.0, 16.0, 64.0], dtype=torch.float64)
    parts = parts_for(1000, sig.tolist(), 8)
    i = torch.arange(1000)

    def tol(weight):
        ref, _ = reference_attention(q64, k64, v64, weight, causal)
        naive, _ = reference_attention(q64.float(), k64.float(), v64.float(), weight, causal, dtype=torch.float32)
        return ref, 2 * (naive.double() - ref).abs().max().item() + 1e-6

    for window in (None, [2, 8, 40, 3000]):
        w = laplacian_weight(1000, sig)
        if window is not None:
            w = w * masks.Window.of(window, 4, "cpu").grid(i, i, 4)
        ref, t = tol(w)
        err = (exact_alibi(q, k, v, sig, causal, window=window).double().cpu() - ref).abs().max().item()
        assert err <= t, (window, err, t)
    ref, t = tol(mean_mask_weight(parts))
    for backend in ("union", "flex", "blocks"):
        err = (poslsh_attention(q, k, v, parts, causal, backend=backend).double().cpu() - ref).abs().max().item()
        assert err <= t, (backend, err, t)


@pytest.mark.parametrize("kernel", list(Kernel))
def test_block_lse_is_the_masked_normaliser(kernel):
    q, k, v = qkv(n=40, H=2)
    parts = parts_for(40, [2.0, 5.0], 3)
    out, lse = per_sample_block_attention(q, k, v, BlockLayout.build(parts), causal=False, kernel=kernel)
    for h, p in enumerate(parts):
        for kk, b in enumerate(p.bins()):
            w = torch.as_tensor((b[:, None] == b[None, :]).astype(float))
            o_ref, l_ref = reference_attention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], w, False)
            torch.testing.assert_close(lse[:, h, kk], l_ref[:, 0], rtol=0, atol=1e-12)
            torch.testing.assert_close(out[:, h, kk], o_ref[:, 0], rtol=0, atol=1e-12)


def test_merging_a_split_equals_attention_over_the_union():
    q, k, v = qkv(n=30, H=3)
    g = np.random.default_rng(1)
    part = torch.as_tensor(g.integers(0, 3, size=30))  # three disjoint key sets
    outs, lses = [], []
    for c in range(3):
        w = (part == c).double()[None, None, :].expand(1, 30, 30)
        o, l = reference_attention(q, k, v, w, causal=False)
        outs.append(o)
        lses.append(l)
    merged, lse = merge_by_lse(torch.stack(outs, 2), torch.stack(lses, 2), dim=2)
    full, full_lse = reference_attention(q, k, v, None, causal=False)
    torch.testing.assert_close(merged, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 0, 5, 40, [0, 3, 9, 70]])
def test_chunked_and_flex_alibi_equal_reference(causal, window):
    from poslsh_cli.numerics import masks

    q, k, v = qkv(n=70, H=4)
    sigmas = torch.tensor([0.5, 2.0, 8.0, 64.0], dtype=torch.float64)
    ref = exact_alibi(q, k, v, sigmas, causal, window=window, backend="reference")
    got = alibi_chunked(q, k, v, sigmas, causal, window=window, chunk=16)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    w = laplacian_weight(70, sigmas)
    if window is not None:
        i = torch.arange(70)
        w = w * masks.Window.of(window, 4, "cpu").grid(i, i, 4)
    flex = exact_alibi(q.float(), k.float(), v.float(), sigmas, causal, window=window, backend="flex")
    assert (flex.double() - ref).abs().max().item() <= naive_tolerance(q, k, v, w, causal, torch.float32)


def _exact_rows(q, k, v, sigmas, causal, rows):
    from poslsh_cli.attention.reference import alibi_rows_reference

    return alibi_rows_reference(q, k, v, sigmas, causal, rows)


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_tiled_rank_one_exact_alibi_keeps_float32_accuracy_to_65536(causal):
    """The inference path of exact ALiBi (the flash kernel with the bias as an extra coordinate,
    re-centred per 512-query tile) in float32 against float64, every standard slope of 8 heads
    (m = 1/2 .. 1/256), at n = 4096 and 65536: rows of the first, middle and last 1024 queries
    (two tiles each, their edges included) against all keys, within 4e-6 (the float32 chunked
    path's own error at n = 2048 is about 1e-6; the sums are longer here). A row range computes
    what the whole call computes for those rows."""
    from poslsh_cli.attention import alibi_rank1_tiled

    sig = torch.as_tensor(alibi_sigmas(8))
    q, k, v = (t.float() for t in qkv(B=1, H=8, n=2048, d=8, seed=20))
    whole = alibi_rank1_tiled(q, k, v, sig, causal)
    assert torch.equal(alibi_rank1_tiled(q, k, v, sig, causal, rows=(512, 1536)), whole[:, :, 512:1536])
    for n in (4096, 65536):
        q, k, v = (t.float() for t in qkv(B=1, H=8, n=n, d=8, seed=21))
        picked = sorted({*range(0, 1024, 16), 1, 511, 512, 513, 1023})  # tile edges included
        for a in (0, n // 2 - 512, n - 1024):
            out = alibi_rank1_tiled(q, k, v, sig, causal, rows=(a, a + 1024))
            ref = _exact_rows(q, k, v, sig, causal, [a + r for r in picked])
            err = (out[:, :, picked].double() - ref).abs().max().item()
            assert err <= 4e-6, (n, causal, a, err)


@pytest.mark.slow
def test_one_coordinate_centred_once_loses_float32_accuracy_at_65536():
    """Why the inference path re-centres: the training path's single coordinate (centred once on
    the whole sequence) is off by more than the tiled path's 4e-6 at n = 65536, m = 1/2."""
    from poslsh_cli.attention import alibi_rank1

    n, sig = 65536, torch.as_tensor(alibi_sigmas(8))
    q, k, v = (t.float() for t in qkv(B=1, H=8, n=n, d=8, seed=21))
    rows = list(range(0, 1024, 16)) + list(range(n - 1024, n, 16))
    err = (alibi_rank1(q, k, v, sig)[:, :, rows].double() - _exact_rows(q, k, v, sig, True, rows)).abs().max().item()
    assert err > 4e-6, err


def test_reference_alibi_is_softmax_with_linear_bias():
    q, k, v = qkv(n=20, H=2)
    sig = torch.tensor([2.0, 7.0], dtype=torch.float64)
    i = torch.arange(20.0, dtype=torch.float64)
    bias = -(i[:, None] - i[None, :]).abs()[None] / sig[:, None, None]
    ref = torch.softmax(q @ k.transpose(-1, -2) / np.sqrt(8) + bias, -1) @ v
    torch.testing.assert_close(exact_alibi(q, k, v, sig, False, backend="reference"), ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(reference_attention(q, k, v, laplacian_weight(20, sig), False)[0], ref)


def test_fixed_block_and_no_bias_baselines(blocks):
    q, k, v = qkv(n=50, H=3)
    sigmas = [1.0, 3.3, 10.0]
    parts = fixed_block_partitions(50, sigmas)
    assert [int(np.diff(p.offsets[0])[0]) for p in parts] == [2, 7, 20]
    got = blocks(q, k, v, parts, True, Method.FIXED_BLOCK)
    ref, _ = reference_attention(q, k, v, mean_mask_weight(parts), causal=True)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    nb = no_bias_attention(q, k, v, causal=False)
    torch.testing.assert_close(nb, reference_attention(q, k, v, None, False)[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("op", ["poslsh", "chunked", "windowed"])
def test_causal_never_looks_ahead(op, blocks):
    q, k, v = qkv(n=64, H=2)
    parts = parts_for(64, [4.0, 16.0], 8)
    sig = torch.tensor([4.0, 16.0], dtype=torch.float64)

    def run(q, k, v):
        if op == "poslsh":
            return blocks(q, k, v, parts, True)
        return alibi_chunked(q, k, v, sig, True, window=None if op == "chunked" else 6, chunk=16)

    base = run(q, k, v)
    t = 40
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1:] = torch.randn_like(k2[:, :, t + 1:]) * 5
    v2[:, :, t + 1:] = torch.randn_like(v2[:, :, t + 1:]) * 5
    after = run(q, k2, v2)
    torch.testing.assert_close(after[:, :, :t + 1], base[:, :, :t + 1], rtol=0, atol=0)
    assert not torch.allclose(after[:, :, t + 1:], base[:, :, t + 1:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_stay_finite_and_close(dtype, blocks):
    """bf16/fp16 inputs: finite, and no further from float64 than twice the naive implementation
    computed entirely in that dtype."""
    q, k, v = qkv(B=1, H=8, n=300, d=32, dtype=torch.float32, scale=3.0)
    q, k, v = (t.to(dtype).double() for t in (q, k, v))  # the inputs as that dtype holds them
    parts = parts_for(300, alibi_sigmas(8), 8)
    w = mean_mask_weight(parts)
    for causal in (False, True):
        ref, _ = reference_attention(q, k, v, w, causal)
        got = blocks(q.to(dtype), k.to(dtype), v.to(dtype), parts, causal)
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert (got.double() - ref).abs().max().item() <= naive_tolerance(q, k, v, w, causal, dtype)
        ex = alibi_chunked(q.to(dtype), k.to(dtype), v.to(dtype), torch.as_tensor(alibi_sigmas(8)), causal,
                           kernel=Kernel.MATMUL)
        assert torch.isfinite(ex).all()


@pytest.mark.parametrize("plan", [Plan(Method.POSLSH, Backend.BLOCKS, Kernel.FUSED),
                                  Plan(Method.POSLSH, Backend.BLOCKS, Kernel.MATMUL),
                                  Plan(Method.POSLSH, Backend.DENSE, Kernel.FUSED)], ids=str)
def test_gradients_flow_and_match_finite_differences(plan):
    """gradcheck (float64 finite differences along random directions) through each backend forced
    by its plan: the recomputing block kernel (MergedBlockAttention, both kernels) and the dense bias."""
    q, k, v = qkv(B=1, H=2, n=40, d=4)
    parts = tuple(parts_for(40, [2.0, 6.0], 4))
    for causal in (True, False):
        spec = AttentionSpec(Method.POSLSH, [2.0, 6.0], causal, partitions=parts)
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        if plan.backend is Backend.BLOCKS:
            assert type(attend(*x, spec, plan=plan).grad_fn).__name__ == "MergedBlockAttentionBackward"
        # fast mode: finite differences along random directions (a full Jacobian costs 960 columns);
        # the gradients' values are compared column-free with float64 autograd in the test below
        assert torch.autograd.gradcheck(lambda a, b, c: attend(a, b, c, spec, plan=plan), x, fast_mode=True)
    out = attend(*(t.float().requires_grad_(True) for t in (q, k, v)), spec, plan=plan)
    out.square().sum().backward()


#: Every path that trains (or runs) with gradients, forced by its plan: (method, backend, kernel, causal only).
GRAD_PATHS = [(Method.POSLSH, Backend.BLOCKS, Kernel.FUSED, False), (Method.POSLSH, Backend.BLOCKS, Kernel.MATMUL, False),
              (Method.POSLSH, Backend.DENSE, Kernel.FUSED, False), (Method.FIXED_BLOCK, Backend.BLOCKS, Kernel.FUSED, False),
              (Method.EXACT, Backend.CHUNKED, Kernel.FUSED, False), (Method.EXACT, Backend.CHUNKED, Kernel.MATMUL, False),
              (Method.EXACT, Backend.DENSE, Kernel.FUSED, False), (Method.EXACT, Backend.RANK1, Kernel.FUSED, True),
              (Method.WINDOWED, Backend.CHUNKED, Kernel.FUSED, False),
              (Method.WINDOWED, Backend.CHUNKED, Kernel.MATMUL, False), (Method.WINDOWED, Backend.DENSE, Kernel.FUSED, False)]


@pytest.mark.parametrize("method,backend,kernel,causal_only", GRAD_PATHS,
                         ids=lambda x: getattr(x, "value", str(x)))
@pytest.mark.parametrize("causal", [True, False])
def test_float64_in_float64_out_forward_and_backward(method, backend, kernel, causal_only, causal):
    """Float64 q, k, v that need gradients, n=600 (five 128-token tiles), non-power-of-two slopes:
    the output and the q, k, v gradients of every path equal float64 autograd of the dense
    reference to 1e-10 of their size (float64 accuracy, not float32's 1e-6)."""
    from poslsh_cli.attention import reference_weight

    if causal_only and not causal:
        pytest.skip("the rank-one path is causal")
    n, sig = 600, [2 ** 0.25, 2 ** 1.75, 2 ** 3.25, 2 ** 6.5]
    q, k, v = qkv(B=1, H=4, n=n, d=8, seed=11)
    extra = {}
    if method is Method.POSLSH:
        extra["partitions"] = tuple(parts_for(n, sig, 5, seed=12))
    elif method is Method.FIXED_BLOCK:
        extra["partitions"] = tuple(fixed_block_partitions(n, sig))
    elif method is Method.WINDOWED:
        extra["window"] = (3, 20, 90, 700)
    spec = AttentionSpec(method, sig, causal, **extra)
    w = reference_weight(spec, n)
    x64 = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*x64, w, causal)[0]
    dT = torch.randn(ref.shape, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    g64 = torch.autograd.grad(ref, x64, dT)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attend(*x, spec, plan=Plan(method, backend, kernel))
    grads = torch.autograd.grad(out, x, dT)
    assert out.dtype == torch.float64 and all(g.dtype == torch.float64 for g in grads)
    assert (out - ref).abs().max().item() <= 1e-10 * ref.abs().max().item()
    for name, g, r in zip("qkv", grads, g64):
        assert (g - r).abs().max().item() <= 1e-10 * r.abs().max().item(), name


def test_alibi_with_non_power_of_two_slopes_is_float64_exact_on_every_path():
    """MPT-style slopes 2^(-h/4) at n=2048: every exact-ALiBi path in float64 equals the float64
    reference to 1e-12 (slopes rounded to float32 anywhere would give about 1e-7)."""
    from poslsh_cli.attention import reference_weight

    n, sig = 2048, [2 ** (h / 4) for h in (1, 3, 5, 7)]
    q, k, v = qkv(B=1, H=4, n=n, d=8, seed=14)
    for causal in (True, False):
        spec = AttentionSpec(Method.EXACT, sig, causal)
        ref = reference_attention(q, k, v, reference_weight(spec, n), causal)[0]
        plans = [Plan(Method.EXACT, Backend.CHUNKED, kk) for kk in (Kernel.FUSED, Kernel.MATMUL)]
        plans += [Plan(Method.EXACT, Backend.DENSE, Kernel.FUSED)]
        plans += [Plan(Method.EXACT, Backend.RANK1, None)]  # inference: the tiled path, both directions
        for plan in plans:
            err = (attend(q, k, v, spec, plan=plan) - ref).abs().max().item()
            assert err <= 1e-12, (causal, plan, err)
        x = [t.clone().requires_grad_() for t in (q, k, v)]  # the banded training path (fused, gradients)
        err = (attend(*x, spec, plan=Plan(Method.EXACT, Backend.CHUNKED, Kernel.FUSED)) - ref).abs().max().item()
        assert err <= 1e-12, (causal, "banded", err)


def test_layout_pads_less_than_twice():
    """Length buckets bound padding, and every (head, sample, position) is in one block."""
    parts = parts_for(4096, alibi_sigmas(8), 8)
    layout = BlockLayout.build(parts)
    assert layout.padded_slots < 2 * 8 * 8 * 4096
    real = torch.cat([dest[ok] for dest, ok in zip(layout.dest, layout.valid)])
    assert torch.equal(torch.sort(real).values, torch.arange(8 * 8 * 4096))  # each slot exactly once


def test_length_buckets_are_each_buckets_count_and_longest_length():
    """buckets() against its definition, one dict pass: per bucket id in order, how many blocks and the
    longest; lengths up to EXACT_BUCKET_MAX are their own bucket, longer ones share a geometric one."""
    from poslsh_cli.attention.blocks import EXACT_BUCKET_MAX, buckets, length_bucket

    rng = np.random.default_rng(0)
    for trial in range(40):
        top = int(rng.choice([3, EXACT_BUCKET_MAX, 200, 5000]))
        lengths = rng.integers(1, top + 1, size=int(rng.integers(1, 3000)))
        want: dict[int, list[int]] = {}
        for length, b in zip(lengths.tolist(), length_bucket(lengths).tolist()):
            count, longest = want.get(b, [0, 0])
            want[b] = [count + 1, max(longest, length)]
        assert buckets(lengths) == [(b, c, m) for b, (c, m) in sorted(want.items())], trial
    assert buckets(np.zeros(0, dtype=np.int64)) == []


def _grad_errors(q, k, v, dT, run, dtype=torch.float32):
    """Max |grad - float64 grad| of q, k, v for ``run`` in ``dtype``."""
    x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(run(*x), x, dT.to(dtype))
    return [g.double() for g in grads]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", [Kernel.FUSED, Kernel.MATMUL])  # the kernels the blocks run (flex: the union's)
def test_block_gradients_equal_float64_autograd_of_the_dense_route(causal, kernel):
    """Issue 18: q, k, v gradients through the recomputing block kernel (n=1500, mixed sigmas,
    s=6, per-head partitions) against float64 autograd of softmax(q k^T / sqrt(d) + log M~) v; the
    tolerance is twice the naive float32 implementation's gradient error plus float32 rounding of
    the gradient itself, as for every fast path, and of its accumulation: the block path adds s
    per-sample partial gradients (each at most the gradient's size) in float32."""
    n, sig = 1500, [0.7, 3.0, 12.0, 48.0, 400.0]
    q, k, v = qkv(B=2, H=len(sig), n=n, d=16, seed=3)
    parts = tuple(parts_for(n, sig, 6, seed=4))
    spec = AttentionSpec(Method.POSLSH, sig, causal, partitions=parts)
    w = mean_mask_weight(parts)
    x64 = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*x64, w, causal)[0]
    dT = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    g64 = torch.autograd.grad(ref, x64, dT)
    naive = _grad_errors(q, k, v, dT, lambda a, b, c: reference_attention(a, b, c, w, causal, dtype=torch.float32)[0])
    fast = _grad_errors(q, k, v, dT, lambda a, b, c: attend(a, b, c, spec, plan=Plan(Method.POSLSH, Backend.BLOCKS,
                                                                                        kernel)))
    for name, r, nv, f in zip("qkv", g64, naive, fast):
        tol = 2 * (nv - r).abs().max().item() + (4 + 6) * torch.finfo(torch.float32).eps * r.abs().max().item()
        err = (f - r).abs().max().item()
        assert err <= tol, (name, err, tol)


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_banded_alibi_gradients_equal_float64_autograd(causal):
    """The banded ALiBi training path (windowed per head, and exact) against float64 autograd."""
    from poslsh_cli.attention import reference_weight

    n, sig = 1500, [0.5, 4.0, 16.0, 300.0]
    q, k, v = qkv(B=2, H=4, n=n, d=16, seed=6)
    for spec in (AttentionSpec(Method.WINDOWED, sig, causal, window=(2, 9, 70, 1600)),
                 AttentionSpec(Method.EXACT, sig, causal)):
        w = reference_weight(spec, n)
        x64 = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = reference_attention(*x64, w, causal)[0]
        dT = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        g64 = torch.autograd.grad(ref, x64, dT)
        naive = _grad_errors(q, k, v, dT, lambda a, b, c: reference_attention(a, b, c, w, causal, dtype=torch.float32)[0])
        fast = _grad_errors(q, k, v, dT, lambda a, b, c: attend(a, b, c, spec, plan=Plan(spec.method, Backend.CHUNKED,
                                                                                            Kernel.FUSED)))
        for name, r, nv, f in zip("qkv", g64, naive, fast):
            tol = 2 * (nv - r).abs().max().item() + 4 * torch.finfo(torch.float32).eps * r.abs().max().item()
            assert (f - r).abs().max().item() <= tol, (spec.method, name)


def test_poslsh_attention_on_blocks_is_differentiable_through_the_recomputing_kernel():
    """poslsh_attention(q, k, v, partitions, causal, backend="blocks") keeps its signature and its
    gradient goes through MergedBlockAttention (no stored block scores)."""
    q, k, v = (t.float().requires_grad_() for t in qkv(B=1, H=2, n=300, d=8))
    parts = parts_for(300, [2.0, 30.0], 4)
    out = poslsh_attention(q, k, v, parts, True, backend="blocks")
    assert type(out.grad_fn).__name__ == "MergedBlockAttentionBackward"
    out.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_attention_dropout_takes_a_path_that_drops_and_is_unbiased():
    """attn_dropout on the CPU: the automatic plan keeps the paths that drop probabilities (rank1 for
    causal exact ALiBi) and sends Positional LSH, which trains on the blocks or the union band from n = 512, to the dense
    bias; the mean output over dropout draws is the output without dropout (kept probabilities are
    scaled by 1/(1-p)): every element within 6 standard errors of the draws' own spread."""
    n, sig = 600, [2.0, 40.0]
    q, k, v = (t.float().requires_grad_() for t in qkv(B=1, H=2, n=n, d=8, seed=9))
    parts = tuple(parts_for(n, sig, 4, seed=2))
    spec = AttentionSpec(Method.POSLSH, sig, True, partitions=parts)
    seen = []
    ref = attend(q, k, v, spec, on_plan=seen.append).detach().double()
    torch.manual_seed(0)
    draws = torch.stack([attend(q, k, v, spec, on_plan=seen.append, dropout=0.1).detach().double()
                         for _ in range(200)])
    assert seen[0].label in ("blocks/fused", "union/fused") and {p.label for p in seen[1:]} == {"dense"}
    assert (draws[0] - ref).abs().max() > 1e-3  # something was dropped
    se = draws.std(dim=0) / math.sqrt(draws.shape[0])
    z = ((draws.mean(dim=0) - ref).abs() / se.clamp_min(1e-12)).max().item()
    assert z < 6.0, z
    exact = []
    attend(q, k, v, AttentionSpec(Method.EXACT, sig, True), on_plan=exact.append, dropout=0.1)
    assert exact[0].label == "rank1"


def test_bidirectional_exact_alibi_with_dropout_and_no_gradient_stays_bidirectional():
    """Dropout without gradients (the inference-time plan) on bidirectional exact ALiBi: the mean over
    dropout draws is the bidirectional output (keys after the query count), never the causal one the
    rank-one training kernel computes; a forced rank-one plan with dropout is refused."""
    from poslsh_cli.attention import choose

    n, sig = 300, [2.0, 40.0]
    q, k, v = qkv(B=1, H=2, n=n, d=8, seed=3)
    spec = AttentionSpec(Method.EXACT, sig, False)
    seen = []
    ref = attend(q, k, v, spec).double()
    causal_ref = attend(q, k, v, AttentionSpec(Method.EXACT, sig, True)).double()
    torch.manual_seed(0)
    draws = torch.stack([attend(q, k, v, spec, on_plan=seen.append, dropout=0.1).double() for _ in range(100)])
    assert {p.backend for p in seen} == {Backend.DENSE}
    se = draws.std(dim=0) / math.sqrt(draws.shape[0])
    assert ((draws.mean(0) - ref).abs() / se.clamp_min(1e-12)).max().item() < 6.0
    assert (draws.mean(0) - causal_ref).abs().max().item() > 0.1
    with pytest.raises(ValueError, match="causal exact ALiBi only"):
        choose(Method.EXACT, device="cpu", dtype=torch.float64, n=n, causal=False, grad=False, backend="rank1",
               dropout=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_dropout_on_cuda_is_planned_on_a_path_that_drops(dtype):
    """On CUDA the automatic plan would take FlexAttention, which has no dropout: with dropout it
    takes the dense bias (SDPA's dropout_p) for every scheme the training loop drops in, at every
    length, so a dropout run never fails inside its first step."""
    from poslsh_cli.attention import choose
    from poslsh_cli.attention.plan import DROPOUT_BACKENDS

    for method in (Method.EXACT, Method.NO_BIAS):
        for n, causal in ((256, True), (4096, True), (512, False)):
            plan = choose(method, device="cuda", dtype=dtype, n=n, causal=causal, grad=True, dropout=True)
            assert plan.backend in DROPOUT_BACKENDS, (method, n, plan)
            assert choose(method, device="cuda", dtype=dtype, n=n, causal=causal, grad=True).backend in (
                Backend.FLEX, Backend.SDPA)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flash_dropout_is_dropout_of_the_softmax_with_its_mask(dtype):
    """FlashDropout (two flash calls each way) against autograd through the float64 dense formula
    ``(softmax(q k^T s + bias) o D / (1-p)) V`` with the same keep mask D: output and q, k, v
    gradients. p = 0.5 with a causal window bias leaves rows that keep no key (their output is 0);
    n = 300 spans several of the kernel's query and key tiles."""
    from poslsh_cli.attention.dense import alibi_bias
    from poslsh_cli.attention.dropout import FlashDropout, keep_mask

    B, H, n, d = 2, 3, 300, 16
    q, k, v = (t.to(dtype).requires_grad_() for t in qkv(B=B, H=H, n=n, d=d, dtype=torch.float64, seed=4))
    bias = alibi_bias(n, torch.tensor([2.0, 8.0, 64.0]), True, window=[5, 40, 300], dtype=dtype)[None]
    torch.manual_seed(1)
    keep, p = keep_mask((B, H, n, n), 0.5)
    assert p == 0.5
    empty = ~(keep & torch.isfinite(bias)).any(-1)
    assert empty.any()  # rows with every key dropped are exercised
    grad = torch.randn(B, H, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out = FlashDropout.apply(q, k, v, bias, keep, p, 0.25)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    prob = torch.softmax(q64 @ k64.transpose(-1, -2) * 0.25 + bias.double(), dim=-1)
    ref = (prob * keep / (1 - p)) @ v64
    want = torch.autograd.grad(ref, (q64, k64, v64), grad)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert (out.double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())
    assert (out[empty] == 0).all()
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max().item() < tol * max(1.0, w.abs().max().item())


def test_keep_mask_drops_each_lane_with_its_probability():
    """keep_mask's four 16-bit lanes per 64-bit draw each drop with probability round(p 2^16)/2^16:
    the drop fraction of every lane within 5 binomial standard errors of it; the same seed gives
    the same mask; p = 0 drops nothing."""
    from poslsh_cli.attention.dropout import keep_mask

    torch.manual_seed(3)
    for p in (0.1, 0.37):
        keep, pe = keep_mask((6, 1000, 100), p)
        assert pe == round(p * 65536) / 65536 and abs(pe - p) <= 2 ** -17
        lanes = (~keep).reshape(-1, 4).double().mean(dim=0)
        se = math.sqrt(pe * (1 - pe) / (keep.numel() / 4))
        assert ((lanes - pe).abs() < 5 * se).all(), (p, lanes.tolist())
    torch.manual_seed(7)
    a, _ = keep_mask((3, 50, 50), 0.2)
    torch.manual_seed(7)
    b, _ = keep_mask((3, 50, 50), 0.2)
    assert torch.equal(a, b)
    assert keep_mask((3, 50, 50), 0.0)[0].all()


def test_a_supplied_plan_is_checked_like_a_chosen_one():
    """A rank-one plan made for bidirectional inference (legal) reused once the inputs need gradients
    (or with dropout) would run the causal training kernel: refused in one line, never run; a plan
    for another method too; a supplied plan that fits runs and equals the reference."""
    from poslsh_cli.attention import choose

    q, k, v = qkv(B=1, H=2, n=96, d=8, seed=3)
    spec = AttentionSpec(Method.EXACT, [4.0, 16.0], False)
    plan = choose(Method.EXACT, device="cpu", dtype=torch.float64, n=96, causal=False, grad=False)
    assert plan.label == "rank1"
    ref = attend(q, k, v, spec, backend="reference")
    torch.testing.assert_close(attend(q, k, v, spec, plan=plan), ref, rtol=0, atol=1e-10)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    with pytest.raises(ValueError, match="rank-one path trains"):
        attend(qg, kg, vg, spec, plan=plan)
    with pytest.raises(ValueError, match="rank-one path trains"):
        attend(q, k, v, spec, plan=plan, dropout=0.1)
    other = choose(Method.NO_BIAS, device="cpu", dtype=torch.float64, n=96, causal=False, grad=False)
    with pytest.raises(ValueError, match="the plan is for no_bias"):
        attend(q, k, v, spec, plan=other)
