"""The union route of Positional LSH (one attention over the union of each query's blocks, weighted by
log counts) against float64 references, its exact identity C = s M~, and what it must not do
(read the device back while it is built, repeat q per mask)."""
import numpy as np
import pytest
import torch

from poslsh_cli.attention import AttentionSpec, Method, attend, choose, mean_mask_weight, reference_attention
from poslsh_cli.attention.api import Kernel, poslsh_layout
from poslsh_cli.attention.band import BandLayout
from poslsh_cli.attention.union import UnionLayout
from poslsh_cli.numerics.sampling import alibi_sigmas, fixed_block_partitions

from test_attention import naive_tolerance, parts_for, qkv



def dense_counts(band: BandLayout, rows: int = 128) -> torch.Tensor:
    """A band layout's whole (H, n, n) count matrix, from every head group's query chunks (float64 log
    counts: exp rounds back to the integer exactly; -inf gives 0)."""
    n = band.seq_len
    out = torch.zeros(band.heads, n, n, dtype=torch.int64)
    seen = []
    for g in band.groups:
        seen += g.heads
        for a, b, lo, hi in g.chunks(n, rows):
            out[g.index, a:b, lo:hi] = g.bias(a, b, n, torch.float64).exp().round().to(torch.int64)
    assert sorted(seen) == list(range(band.heads))  # every head in one group
    return out

def spec_of(parts, causal, method=Method.POSLSH):
    return AttentionSpec(method, [p.sigma for p in parts], causal, partitions=tuple(parts))


def host_counts(parts):
    """#{k : bin_k(i) = bin_k(j)} per head from the host's bins, (H, n, n) int64."""
    return torch.stack([torch.as_tensor(sum((b[:, None] == b[None, :]).astype(np.int64) for b in p.bins()))
                        for p in parts])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,sigmas,s", [(700, (0.3, 2.0, 9.0, 300.0), 6), (1000, (1.0, 4.0, 16.0, 64.0), 100),
                                        (257, (2e3, 0.05, 7.0, 7.0), 3), (2, (1.0, 1.0, 1.0, 1.0), 2)])
def test_union_counts_are_s_times_the_mean_mask(n, sigmas, s, causal):
    """C_ij = #{k : h_k(i) = h_k(j)} = s M~_ij exactly (M~ from the host's partitions), zero outside
    each query's span and, causal, after the query; the spans are monotone in i."""
    parts = parts_for(n, sigmas, s, seed=n + s)
    lay = poslsh_layout(parts, causal, "union", "cpu", Kernel.FLEX)  # the cell table FlexAttention reads
    i = torch.arange(n)
    want = host_counts(parts)
    if causal:
        want = want.tril()
    assert torch.equal(lay.counts(i, i), want)
    assert bool((lay.lo[:, 1:] >= lay.lo[:, :-1]).all()) and bool((lay.hi[:, 1:] >= lay.hi[:, :-1]).all())
    assert int((lay.hi - lay.lo + 1).max()) <= lay.span
    band = poslsh_layout(parts, causal, "union", "cpu")  # the sorted block ends per position the CPU reads
    assert isinstance(band, BandLayout) and torch.equal(dense_counts(band), want)
    assert torch.equal(dense_counts(band, rows=7), want)  # chunks that do not divide n
    built = BandLayout.build(np.stack([p.widths for p in parts]), np.stack([p.shifts for p in parts]), n, causal)
    assert torch.equal(dense_counts(built), want)  # the device-side build (no host reaches)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1, 8, 100])
def test_union_paths_equal_float64_reference(s, causal):
    """Every kernel of the union route (the CPU chunks fused and by matmuls, FlexAttention uncompiled)
    at n=1300 (11 key tiles of 128), float32 within twice the naive float32 error against float64,
    float64 to 1e-10; fixed blocks (one partition) too."""
    n = 1300
    q, k, v = qkv(B=1, H=4, n=n, d=16, seed=s)
    sigmas = [1.0, 6.0, 40.0, 250.0]
    for method, parts in ((Method.POSLSH, parts_for(n, sigmas, s, seed=s)),
                          (Method.FIXED_BLOCK, fixed_block_partitions(n, sigmas))):
        if method is Method.FIXED_BLOCK and s != 1:
            continue
        w = mean_mask_weight(parts)
        ref, _ = reference_attention(q, k, v, w, causal)
        tol = naive_tolerance(q, k, v, w, causal, torch.float32)
        spec = spec_of(parts, causal, method)
        table = poslsh_layout(parts, causal, "union", "cpu", Kernel.FLEX)
        band = poslsh_layout(parts, causal, "union", "cpu")
        # the CPU's band (flash kernel, matmuls) and the cell table (FlexAttention; chunks as on CUDA)
        for kernel, lay in (("fused", band), ("matmul", band), ("matmul", table), ("flex", table)):
            plan = choose(method, device="cpu", dtype=torch.float32, n=n, causal=causal, grad=False, backend="union",
                          kernel=kernel)
            got = attend(q.float(), k.float(), v.float(), spec, plan=plan, layout=lay)
            err = (got.double() - ref).abs().max().item()
            assert err <= tol, (method, kernel, type(lay).__name__, err, tol)
            if kernel != "flex":
                got64 = attend(q, k, v, spec, plan=plan, layout=lay)
                assert (got64 - ref).abs().max().item() <= 1e-10


@pytest.mark.parametrize("causal", [False, True])
def test_union_chunks_train_with_the_reference_gradients(causal):
    """Gradients of the CPU union route (the flash kernel per query chunk against its band of keys,
    the log-count bias rebuilt in the backward pass; and the chunks by matmuls) equal the float64
    reference's, at n=1300 (11 tiles of 128) with s=100; the heads' bandwidths out of order, so that
    a head group's heads are not consecutive (indexed, not sliced)."""
    n = 1300
    q, k, v = (t.requires_grad_(True) for t in qkv(B=2, H=3, n=n, d=8, seed=4))
    parts = parts_for(n, [60.0, 2.0, 60.0], 100, seed=5)
    groups = poslsh_layout(parts, causal, "union", "cpu").groups
    assert [g.heads for g in groups] == [(1,), (0, 2)] and isinstance(groups[1].index, torch.Tensor)
    spec = spec_of(parts, causal)
    g = torch.randn(2, 3, n, 8, dtype=torch.float64)
    ref, _ = reference_attention(q, k, v, mean_mask_weight(parts), causal)
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for kernel in ("fused", "matmul"):
        plan = choose(Method.POSLSH, device="cpu", dtype=torch.float64, n=n, causal=causal, grad=True,
                      backend="union", kernel=kernel)
        out = attend(q, k, v, spec, plan=plan)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
        got = torch.autograd.grad((out * g).sum(), (q, k, v))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_cpu_training_takes_the_union_band_for_many_masks_past_the_dense_limit(monkeypatch):
    """With gradients on the CPU past the dense bias (causal n >= 512), Positional LSH at s=100 takes
    the union route (its band of keys per query chunk), at s=1 the blocks; below the limit the
    dense bias as before (the language-model presets' L=256 paths do not change); the layout keeps
    the s sorted block starts of each position, O(H s n); and where it would pass its cap
    (UNION_MAX_BYTES, the cap inference keeps to too) training takes the blocks, in the plan and in
    a step through attend()."""
    from poslsh_cli.attention import plan as plan_mod
    from poslsh_cli.attention.api import work_of
    from poslsh_cli.attention.band import band_bytes

    for n, s, label in ((2048, 100, "union/fused"), (2048, 1, "blocks/fused"), (256, 100, "dense")):
        parts = parts_for(n, [64.0] * 8, s, seed=3)
        spec = spec_of(parts, True)
        plan = choose(Method.POSLSH, device="cpu", dtype=torch.float32, n=n, causal=True, grad=True,
                      work=work_of(spec, n), s=s)
        assert plan.label == label, (n, s, plan.label)
    band = poslsh_layout(parts_for(2048, [64.0] * 8, 100, seed=3), True, "union", "cpu")
    assert band.nbytes == 4 * 8 * 2048 * 100  # causal: the sorted starts, int32, O(H s n)
    parts = parts_for(2048, [64.0] * 8, 100, seed=3)
    spec = spec_of(parts, True)
    held = band_bytes(spec.bin_table[0], 2048, True, 100)
    assert band.nbytes < held < band.nbytes + 4 * 8 * 128 * 2048  # and one chunk's log counts
    for cap, label in ((held, "union/fused"), (held - 1, "blocks/fused")):
        monkeypatch.setattr(plan_mod, "UNION_MAX_BYTES", cap)
        plan = choose(Method.POSLSH, device="cpu", dtype=torch.float32, n=2048, causal=True, grad=True,
                      work=work_of(spec, 2048), s=100)
        assert plan.label == label, cap
    q, k, v = (t.float().requires_grad_(True) for t in qkv(1, 8, 2048, 8, seed=2))
    got = []
    attend(q, k, v, spec, on_plan=lambda p: got.append(p.label)).sum().backward()
    assert got == ["blocks/fused"] and q.grad is not None


def test_the_union_layout_is_built_without_reading_the_device(monkeypatch):
    """Nothing of size n comes back to the host while the layout and its BlockMask are built (on
    CUDA every such read is a synchronisation): every Tensor-to-host conversion raises here."""
    n = 2000
    parts = parts_for(n, alibi_sigmas(8), 16, seed=2)
    widths = np.stack([p.widths for p in parts])
    shifts = np.stack([p.shifts for p in parts])

    def refuse(*a, **k):
        raise AssertionError("a tensor was read back to the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for causal in (True, False):
        lay = UnionLayout.build(widths, shifts, n, causal)
        lay.block_mask(q_blocks=False)
    monkeypatch.undo()
    i = torch.arange(n)
    assert torch.equal(lay.counts(i, i), host_counts(parts))


def test_the_union_route_calls_the_kernel_once_per_head_not_per_mask(monkeypatch):
    """The union route runs one FlexAttention call over the H heads; the per-mask route one call per
    mask over the H heads (never q repeated s times: the memory of s outputs at once)."""
    import poslsh_cli.attention.flex as flex

    calls = []
    real = flex.flex_function

    def recording(compiled):
        fn = real(compiled)

        def run(q, k, v, **kw):
            calls.append(tuple(q.shape))
            return fn(q, k, v, **kw)
        return run

    monkeypatch.setattr(flex, "flex_function", recording)
    n, s = 600, 8
    q, k, v = (t.float() for t in qkv(B=1, H=4, n=n, d=16))
    parts = parts_for(n, [1.0, 6.0, 40.0, 250.0], s)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), mean_mask_weight(parts), True)
    plan = choose(Method.POSLSH, device="cpu", dtype=torch.float32, n=n, causal=True, grad=False, backend="union",
                  kernel="flex")
    out = attend(q, k, v, spec_of(parts, True), plan=plan)
    assert calls == [(1, 4, n, 16)]
    calls.clear()
    out2 = attend(q, k, v, spec_of(parts, True), backend="flex")
    assert calls == [(1, 4, n, 16)] * s
    for o in (out, out2):
        assert (o.double() - ref).abs().max().item() < 1e-5


def test_plan_takes_the_union_on_cuda_for_several_masks_and_on_the_cpu_for_many():
    for s, backend in ((100, "union"), (2, "union"), (1, "flex"), (0, "flex")):
        plan = choose(Method.POSLSH, device="cuda", dtype=torch.bfloat16, n=8192, causal=True, grad=True,
                      s=s)
        assert plan.backend.value == backend and plan.compiled
    plan = choose(Method.POSLSH, device="cuda", dtype=torch.bfloat16, n=8192, causal=True, grad=True, s=8)
    assert plan.label == "union/flex/compiled"
    # on the CPU without the masks' work (a bare choose: the commands' memory estimates) the s threshold;
    # attend() weighs the masks drawn (test_cpu_inference_weighs_the_blocks_against_the_union...)
    from poslsh_cli.attention.plan import UNION_MIN_S_CPU

    for s in (UNION_MIN_S_CPU - 1, 1):
        cpu = choose(Method.POSLSH, device="cpu", dtype=torch.float32, n=8192, causal=True, grad=False, s=s)
        assert cpu.label == "blocks/fused"
    for s in (UNION_MIN_S_CPU, 100):
        cpu = choose(Method.POSLSH, device="cpu", dtype=torch.float32, n=8192, causal=True, grad=False, s=s)
        assert cpu.label == "union/fused"


def test_cpu_inference_weighs_the_blocks_against_the_union_and_gives_the_same_output(monkeypatch):
    """What a model's evaluation runs (attend, backend auto, no gradients): the dense bias at training
    lengths, beyond it the forward cost model's path (the cheaper of the two it prices on the masks
    drawn): the union for the official protocol's masks (sigma = L/32 = 8, s = 20 at 4L) and the blocks
    for one mask, the blocks where the union's layout would pass its cap; and each path's output is the
    float64 reference's."""
    from poslsh_cli.attention import plan as plan_mod
    from poslsh_cli.attention.api import work_of
    from poslsh_cli.attention.plan import Backend

    for n, sigma, s, label in ((1024, 8.0, 20, "union/fused"), (1024, 8.0, 4, None), (256, 8.0, 10, "dense"),
                               (1024, 8.0, 1, "blocks/fused"), (2048, 64.0, 100, "union/fused")):
        spec = spec_of(parts_for(n, [sigma] * 4, s, seed=5), True)
        q, k, v = qkv(1, 4, n, 8, seed=1)
        if label is None:  # the model's own argmin on this draw
            work = work_of(spec, n, 8)
            label = min(("blocks/fused", "union/fused"),
                        key=lambda b: work.cost(Method.POSLSH, Backend(b.split("/")[0]), inference=True))
        got = []
        with torch.no_grad():
            out = attend(q.float(), k.float(), v.float(), spec, on_plan=lambda p: got.append(p.label))
        assert got == [label], (n, s, got)
        w = mean_mask_weight(spec.partitions)
        ref, _ = reference_attention(q, k, v, w, True)
        assert (out.double() - ref).abs().max().item() <= naive_tolerance(q, k, v, w, True, torch.float32), (n, s)
    # at training lengths the dense bias whatever the masks: their work is not computed (s=1000 would
    # cost more to weigh than to run)
    from poslsh_cli.attention import api

    monkeypatch.setattr(api, "work_of", lambda *a: pytest.fail("work computed for the dense bias"))
    spec = spec_of(parts_for(256, [8.0] * 4, 1000, seed=5), True)
    q, k, v = qkv(1, 4, 256, 8, seed=1)
    got = []
    with torch.no_grad():
        attend(q.float(), k.float(), v.float(), spec, on_plan=lambda p: got.append(p.label))
    assert got == ["dense"]
    monkeypatch.undo()
    # a band past the cap (a head whose blocks span the sequence, at long n): the blocks, whose memory
    # does not grow with the longest block
    monkeypatch.setattr(plan_mod, "UNION_MAX_BYTES", 1000)
    spec = spec_of(parts_for(1024, [8.0] * 4, 20, seed=5), True)
    q, k, v = qkv(1, 4, 1024, 8, seed=1)
    got = []
    with torch.no_grad():
        attend(q, k, v, spec, on_plan=lambda p: got.append(p.label))
    assert got == ["blocks/fused"]


def test_union_table_holds_one_row_per_cell():
    """The table grows with the cells and the longest block (about s n (ln s + 2) / 2 counts per head
    when sigma >= 1), not with n times the union's width: at n=65536 with the standard slopes of
    8 heads and s=8 it is a fraction of one bfloat16 q of the same size."""
    n, H, s = 65536, 8, 8
    parts = parts_for(n, alibi_sigmas(H), s, seed=9)
    lay = poslsh_layout(parts, True, "union", "cpu", Kernel.FLEX)
    q_bytes = H * n * 64 * 2
    assert lay.table.element_size() == 1
    assert lay.table.numel() < 0.5 * q_bytes, (lay.table.numel(), q_bytes)
    assert lay.offset.dtype == torch.int32
