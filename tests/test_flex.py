"""The FlexAttention wrapper every CUDA path goes through: compiled calls that meet many shapes never
fall back to the unfused kernel, narrow heads are padded exactly, an uncompiled call on CUDA that
would materialise its scores is refused, and the per-mask route keeps one mask's work at a time."""
import warnings

import numpy as np
import pytest
import torch

import poslsh_cli.attention.flex as flex
from poslsh_cli.attention import (AttentionSpec, Method, attend, choose, exact_alibi, laplacian_weight,
                                  mean_mask_weight, poslsh_attention, reference_attention)
from poslsh_cli.attention.api import poslsh_layout
from poslsh_cli.numerics import masks
from poslsh_cli.numerics.sampling import fixed_block_partitions

from test_attention import naive_tolerance, parts_for, qkv


def recording(monkeypatch, check=None):
    """Replace the kernel by a recording wrapper of the real one; ``check(q)`` runs on each call."""
    calls = []
    real = flex.flex_function

    def wrapped(compiled):
        fn = real(compiled)

        def run(q, k, v, **kw):
            calls.append(tuple(q.shape))
            if check is not None:
                check(q)
            return fn(q, k, v, **kw)
        return run

    monkeypatch.setattr(flex, "flex_function", wrapped)
    return calls


@pytest.mark.parametrize("d", [4, 8])
def test_heads_narrower_than_the_cuda_minimum_are_padded_exactly(d, monkeypatch):
    """The CUDA kernel refuses head_dim < 16; every flex path (exact, windowed, per-mask Positional
    LSH, its union route, fixed blocks) pads q, k, v with zeros to 16 (no q.k changes, the extra
    output columns are cut) and equals the float64 reference."""
    def cuda_rule(q):
        assert q.shape[-1] >= 16, "NYI: embedding dimension must be at least 16"

    recording(monkeypatch, cuda_rule)
    n = 300
    q, k, v = qkv(B=1, H=4, n=n, d=d, seed=d)
    qf, kf, vf = (t.float() for t in (q, k, v))
    sig = torch.tensor([1.0, 4.0, 16.0, 64.0], dtype=torch.float64)
    for causal in (True, False):
        w = laplacian_weight(n, sig)
        ref, _ = reference_attention(q, k, v, w, causal)
        got = exact_alibi(qf, kf, vf, sig, causal, backend="flex")
        assert got.shape == q.shape
        assert (got.double() - ref).abs().max().item() <= naive_tolerance(q, k, v, w, causal, torch.float32)
        i = torch.arange(n)
        ww = w * masks.Window.of(5, 4, "cpu").grid(i, i, 4)
        ref, _ = reference_attention(q, k, v, ww, causal)
        got = exact_alibi(qf, kf, vf, sig, causal, window=5, backend="flex")
        assert (got.double() - ref).abs().max().item() <= naive_tolerance(q, k, v, ww, causal, torch.float32)
        for parts in (parts_for(n, sig.tolist(), 5), fixed_block_partitions(n, sig.tolist())):
            w = mean_mask_weight(parts)
            ref, _ = reference_attention(q, k, v, w, causal)
            tol = naive_tolerance(q, k, v, w, causal, torch.float32)
            for backend in ("flex", "union"):
                spec = AttentionSpec(Method.POSLSH, sig.numpy(), causal, partitions=tuple(parts))
                plan = choose(Method.POSLSH, device="cpu", dtype=torch.float32, n=n, causal=causal, grad=False,
                              backend=backend, kernel="flex" if backend == "union" else "auto")
                got = attend(qf, kf, vf, spec, plan=plan)
                assert got.shape == q.shape
                assert (got.double() - ref).abs().max().item() <= tol, backend


def test_an_uncompiled_call_on_cuda_that_would_materialise_its_scores_is_refused():
    class Cuda(torch.Tensor):  # a CPU tensor that says it is on CUDA: the check reads only that and the shape
        @property
        def is_cuda(self):
            return True

    q = torch.zeros(1, 8, 2**14, 16).as_subclass(Cuda)
    with pytest.raises(ValueError, match="GiB of scores"):
        flex.flex_call(q, q, q, scale=0.25, compiled=False)


def test_the_per_mask_route_runs_one_mask_at_a_time(monkeypatch):
    """One call over the H heads per mask (q is never repeated s times) and, without gradients, a
    running merge: two outputs in memory whatever s is; equal to the reference."""
    calls = recording(monkeypatch)
    n, s = 500, 6
    q, k, v = qkv(B=1, H=3, n=n, d=16)
    parts = parts_for(n, [0.5, 6.0, 90.0], s)
    ref, _ = reference_attention(q, k, v, mean_mask_weight(parts), True)
    got = poslsh_attention(q.float(), k.float(), v.float(), parts, True, backend="flex")
    assert calls == [(1, 3, n, 16)] * s
    assert (got.double() - ref).abs().max().item() <= naive_tolerance(q, k, v, mean_mask_weight(parts), True,
                                                                      torch.float32)


def test_the_per_mask_layout_is_built_without_reading_the_device(monkeypatch):
    """The bins and each sample's BlockMask are sized from the host's widths: no tensor comes back."""
    parts = parts_for(1500, [1.0, 8.0, 64.0, 700.0], 5, seed=1)

    def refuse(*a, **k):
        raise AssertionError("a tensor was read back to the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for causal in (True, False):
        lay = poslsh_layout(parts, causal, "flex", "cpu")
        lay.block_mask(0, q_blocks=False)


@pytest.mark.slow
def test_compiled_flex_meets_many_shapes_without_an_unfused_call(monkeypatch):
    """Eight shapes (lengths and head counts) through the compiled FlexAttention paths the CPU
    compiles (exact causal and windowed bidirectional ALiBi, one mask as documents), the first four
    shapes of each at static shapes and the rest with dynamic ones, under a recompile limit of 8 so
    that reaching it is exercised (three kinds at four static shapes pass it) (the kind that meets it goes dynamic; the compiles stay bounded): no call runs the unfused fallback (it warns "flex_attention called
    without torch.compile"), each equals the eager kernel. The CPU compiler has no lse output (the
    per-mask merge) and miscompiles the union route's table lookups (C++ errors such as
    "cur_kvSplitSize2 was not declared"): those run compiled in the CUDA tests."""
    import torch._dynamo

    from torch._dynamo.utils import counters

    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 8)
    monkeypatch.setattr(flex, "STATIC_CALLS", 4)
    torch._dynamo.reset()
    _forget_compiled()
    counters.clear()
    graphs = 0
    shapes = [(256, 4), (384, 4), (512, 4), (640, 2), (768, 4), (896, 4), (1024, 4), (1152, 2)]
    for n, H in shapes:
        q, k, v = (t.float() for t in qkv(B=1, H=H, n=n, d=16, seed=n))
        sig = torch.as_tensor(np.geomspace(1.0, 64.0, H))
        fixed = fixed_block_partitions(n, sig.tolist())
        calls = [lambda c: flex.alibi_flex(q, k, v, sig, True, compiled=c),
                 lambda c: flex.alibi_flex(q, k, v, sig, False, window=7, compiled=c),
                 lambda c: flex.poslsh_flex(q, k, v, fixed, True, compiled=c)]
        for call in calls:
            want = call(False)  # the eager kernel (it warns: it is the unfused one)
            before = counters["stats"]["unique_graphs"]
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*called without torch.compile.*")
                got = call(True)
            graphs += counters["stats"]["unique_graphs"] - before  # what the compiled calls compiled
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert graphs <= 8 + 3 * 3, graphs  # the static kernels up to the limit, then a few dynamic ones a kind
    torch._dynamo.reset()
    _forget_compiled()



def _forget_compiled() -> None:
    """Forget every compiled variant of flex (its compile caches and which kinds went dynamic)."""
    for fn in flex._COMPILED.values():
        torch._C._dynamo.eval_frame.reset_code(flex._code_of(fn))
    flex._COMPILED.clear()
    flex._STATIC.clear()
    flex._DYNAMIC_KINDS.clear()

# ---------------------------------------------------------------------------------------------
# CUDA (skipped without it): what the CPU cannot check of the compiled kernels


def _grads(out_fn, q, k, v, g):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = out_fn(q, k, v)
    return (out.detach(),) + torch.autograd.grad((out * g.to(out.dtype)).sum(), (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("causal,d", [(True, 64), (False, 64), (True, 8)])
def test_cuda_routes_train_with_the_reference_gradients(causal, d):
    """Compiled on CUDA at n=1000 (eight key tiles): the union route, the per-mask route and exact
    ALiBi, forward and the gradients of q, k, v, each within twice the naive float32 implementation's
    error against float64 (head_dim 8 runs padded to the kernel's 16)."""
    n, H, s = 1000, 4, 8
    q64, k64, v64 = qkv(B=1, H=H, n=n, d=d, seed=d)
    g64 = torch.randn(1, H, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sig = torch.tensor([1.0, 4.0, 16.0, 64.0], dtype=torch.float64)
    parts = parts_for(n, sig.tolist(), s)
    cuda = [t.cuda().float() for t in (q64, k64, v64, g64)]
    for name, weight, run in (
            ("exact", laplacian_weight(n, sig), lambda q, k, v: exact_alibi(q, k, v, sig, causal)),
            ("union", mean_mask_weight(parts), lambda q, k, v: poslsh_attention(q, k, v, parts, causal, backend="union")),
            ("flex", mean_mask_weight(parts), lambda q, k, v: poslsh_attention(q, k, v, parts, causal, backend="flex"))):
        def ref_fn(q, k, v, dtype, w=weight):
            return reference_attention(q, k, v, w.to(q.device), causal, dtype=dtype)[0]
        want = _grads(lambda q, k, v: ref_fn(q, k, v, torch.float64), q64, k64, v64, g64)
        naive = _grads(lambda q, k, v: ref_fn(q, k, v, torch.float32), *(t.float() for t in (q64, k64, v64)), g64)
        got = _grads(run, *cuda)
        for what, a, b, c in zip(("out", "dq", "dk", "dv"), got, want, naive):
            tol = 2 * (c.double() - b).abs().max().item() + 1e-6 * b.abs().max().item()
            err = (a.double().cpu() - b).abs().max().item()
            assert err <= tol, (name, what, err, tol)


@pytest.mark.gpu
def test_cuda_union_layout_is_built_without_synchronising():
    """CUDA's sync debug mode raises on every device-to-host read while the union layout and its
    BlockMask are built (the masks are drawn on the device, from the host's few scalars)."""
    from poslsh_cli.attention.union import UnionLayout
    from poslsh_cli.numerics.sampling import alibi_sigmas

    n = 65536
    parts = parts_for(n, alibi_sigmas(8), 8, seed=3)
    widths, shifts = np.stack([p.widths for p in parts]), np.stack([p.shifts for p in parts])
    UnionLayout.build(widths, shifts, n, True, "cuda").block_mask(q_blocks=False)  # warm the allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for causal in (True, False):
            UnionLayout.build(widths, shifts, n, causal, "cuda").block_mask(q_blocks=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_cuda_per_mask_layout_is_built_without_synchronising():
    """The per-mask route's layout (the drawn scalars, one pinned non-blocking copy) and each
    sample's BlockMask (its bins on the device, sized from the host's widths) under CUDA's sync
    debug mode: no device-to-host read."""
    from poslsh_cli.numerics.sampling import alibi_sigmas

    n = 65536
    parts = parts_for(n, alibi_sigmas(8), 4, seed=3)
    poslsh_layout(parts, True, "flex", "cuda").block_mask(0, q_blocks=False)  # warm the allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for causal in (True, False):
            lay = poslsh_layout(parts, causal, "flex", "cuda")
            for sample in range(4):
                lay.block_mask(sample, q_blocks=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_cuda_compiled_routes_meet_many_shapes_without_an_unfused_call():
    """Twelve lengths through the compiled union route (both directions), the per-mask route (its lse
    merge) and exact ALiBi on CUDA: no unfused fallback (it warns), each equal to float32 math."""
    from poslsh_cli.numerics.sampling import alibi_sigmas

    sig = alibi_sigmas(4)
    for i, n in enumerate(range(640, 640 + 12 * 160, 160)):
        q, k, v = (t.cuda().float() for t in qkv(B=1, H=4, n=n, d=64, seed=i))
        parts = parts_for(n, sig.tolist(), 4, seed=i)
        for causal in (True, False):
            ref = reference_attention(q, k, v, mean_mask_weight(parts).cuda(), causal, dtype=torch.float32)[0]
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*called without torch.compile.*")
                outs = [poslsh_attention(q, k, v, parts, causal, backend=b) for b in ("union", "flex")]
                exact_alibi(q, k, v, sig, causal)
            for o in outs:
                assert (o - ref).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("backward", [False, True])
def test_cuda_memory_of_positional_lsh_follows_exact_alibi(backward):
    """Peak allocator memory of one call at n=65536 (bfloat16, 8 heads, d=64, causal, masks drawn in
    the call): the union route and the per-mask route at s=8 and 32 each at most 1.5x exact ALiBi's
    plus the masks' integers (4 H s n bytes)."""
    from poslsh_cli.attention import AttentionSpec, layout_for
    from poslsh_cli.experiments.measure import peak_memory_mb
    from poslsh_cli.numerics.sampling import alibi_sigmas

    n, H = 65536, 8
    dev = torch.device("cuda")
    sig = alibi_sigmas(H)
    q, k, v = (torch.randn(1, H, n, 64, device=dev, dtype=torch.bfloat16).requires_grad_(backward) for _ in range(3))

    def call(fn):
        def run():
            out = fn()
            if backward:
                out.float().sum().backward()
            return out
        run()  # compile and warm
        return peak_memory_mb(run, dev)[0]

    exact = call(lambda: exact_alibi(q, k, v, sig, True))
    for s in (8, 32):
        for backend in ("union", "flex"):
            if backend == "flex" and backward:
                continue  # the per-mask route keeps s outputs for its backward; training takes the union
            def draw_and_attend(s=s, backend=backend):
                spec = AttentionSpec.build(Method.POSLSH, sig, n, True, s=s, rng=np.random.default_rng(s))
                plan = choose(Method.POSLSH, device=dev, dtype=q.dtype, n=n, causal=True, grad=backward,
                              backend=backend, s=s)
                return attend(q, k, v, spec, plan=plan, layout=layout_for(spec, plan, dev))
            mem = call(draw_and_attend)
            assert mem <= 1.5 * exact + 4 * H * s * n / 2**20, (s, backend, mem, exact)


def test_an_uncompiled_call_prints_no_notice():
    """The CPU (and the tests) run FlexAttention uncompiled on purpose: PyTorch's multi-line notice
    that such a call materialises its scores is not printed."""
    import warnings

    import torch
    import torch.nn.attention.flex_attention as fa

    from poslsh_cli.attention.flex import flex_function

    q = torch.randn(1, 2, 16, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        getattr(fa, "_WARNINGS_SHOWN", set()).discard("flex_attention_performance")
        flex_function(False)(q, q, q)
    assert not [w for w in seen if "without torch.compile" in str(w.message)]


def test_the_per_mask_merge_is_as_accurate_as_one_float32_attention_at_many_masks():
    """The per-mask route merges s FlexAttention passes by their lse: at s = 100 with logits of about
    +-30 (large q, k), float32 inputs, the merged output is within twice the naive float32 attention's
    error of the float64 reference (the running merge adds no rounding of its own), at n = 300."""
    import torch

    from poslsh_cli.attention import AttentionSpec, Method, attend, choose, mean_mask_weight
    from test_attention import naive_tolerance, parts_for, qkv

    n = 300
    q, k, v = qkv(B=1, H=2, n=n, d=16, seed=11)
    q, k = q * 3.0, k * 3.0  # logits q.k / 4 of about +-30
    parts = parts_for(n, [6.0, 40.0], 100, seed=4)
    w = mean_mask_weight(parts)
    from poslsh_cli.attention import reference_attention

    ref, _ = reference_attention(q, k, v, w, True)
    assert (q @ k.transpose(-1, -2) / 4).abs().max() > 25
    tol = naive_tolerance(q, k, v, w, True, torch.float32)
    spec = AttentionSpec(Method.POSLSH, [6.0, 40.0], True, partitions=tuple(parts))
    plan = choose(Method.POSLSH, device="cpu", dtype=torch.float32, n=n, causal=True, grad=False, backend="flex")
    got = attend(q.float(), k.float(), v.float(), spec, plan=plan)
    assert (got.double() - ref).abs().max().item() <= tol


def test_one_tensor_as_q_k_and_v_after_a_call_whose_mask_held_tensors():
    """q, k, v as one tensor, after a call whose block mask read tensors (sampled blocks): PyTorch's
    recompile-reason check evaluates the old call's guard sources on the new mask and raised
    AttributeError; the call runs and equals the same call on distinct copies."""
    from poslsh_cli.numerics import masks as m

    n = 256
    q, k, v = qkv(B=1, H=2, n=n, d=16, seed=3)
    doc = torch.arange(n).div(16, rounding_mode="floor").expand(2, n).contiguous()
    blocks = m.block_mask(m.Intersection((m.Causal(), m.SameBlock.of(doc))), 2, n, torch.device("cpu"))
    flex.flex_call(q, k, v, scale=0.25, compiled=False, block_mask=blocks)
    causal = m.block_mask(m.Causal(), 1, n, torch.device("cpu"))
    got = flex.flex_call(q, q, q, scale=0.25, compiled=False, block_mask=causal)
    want = flex.flex_call(q, q.clone(), q.clone(), scale=0.25, compiled=False, block_mask=causal)
    assert torch.equal(got, want)


def test_the_eager_bound_counts_what_an_uncompiled_call_holds():
    """The refusal of a large uncompiled call on CUDA counts what the eager path holds at once (scores,
    modified scores, softmax, mask, index grid), not one float32 score matrix: measured on the CPU, the
    peak memory of an uncompiled causal call stays within the bound and well above one score matrix."""
    from poslsh_cli.numerics import masks as m
    from poslsh_cli.experiments.measure import peak_memory_mb

    B, H, n, d = 1, 4, 1536, 16
    q = torch.randn(B, H, n, d)
    bm = m.block_mask(m.Causal(), 1, n, torch.device("cpu"))
    def call():
        return flex.flex_call(q, q, q, scale=0.25, compiled=False, block_mask=bm,
                              score_mod=lambda s, b, h, i, j: s - (i - j))

    call()  # the first call of a process also sets up what every later one reuses
    peak, _ = peak_memory_mb(call, torch.device("cpu"))
    bound = flex.eager_bytes(B, H, n, n, torch.float32) / 2**20
    one_matrix = 4 * B * H * n * n / 2**20
    assert 2.5 * one_matrix < peak <= bound, (peak, one_matrix, bound)
