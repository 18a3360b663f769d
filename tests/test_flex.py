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
    """Twelve shapes (lengths and head counts) through the compiled FlexAttention paths the CPU
    compiles (exact and windowed ALiBi, one mask as documents), under a recompile limit of 6 so that
    reaching it is exercised: no call runs the unfused fallback (it warns "flex_attention called
    without torch.compile"), each equals the eager kernel. The CPU compiler has no lse output (the
    per-mask merge) and miscompiles the union route's table lookups (C++ errors such as
    "cur_kvSplitSize2 was not declared"): those run compiled in the CUDA tests."""
    import torch._dynamo

    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 6, raising=False)
    torch._dynamo.reset()
    flex._FLEX = None
    shapes = [(256, 4), (384, 4), (512, 4), (640, 2), (768, 4), (896, 4), (1024, 2), (1152, 4), (1280, 4),
              (1408, 4), (1536, 2), (1664, 4)]
    for n, H in shapes:
        q, k, v = (t.float() for t in qkv(B=1, H=H, n=n, d=16, seed=n))
        sig = torch.as_tensor(np.geomspace(1.0, 64.0, H))
        fixed = fixed_block_partitions(n, sig.tolist())
        for causal in (True, False):
            calls = [lambda c, w=w: flex.alibi_flex(q, k, v, sig, causal, window=w, compiled=c) for w in (None, 7)]
            calls += [lambda c: flex.poslsh_flex(q, k, v, fixed, causal, compiled=c)]
            for call in calls:
                want = call(False)  # the eager kernel (it warns: it is the unfused one)
                with warnings.catch_warnings():
                    warnings.filterwarnings("error", message=".*called without torch.compile.*")
                    got = call(True)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    flex._FLEX = None
