"""Key masks (causal, window, same block) and the FlexAttention paths built on them, at sizes
with many 128-token tiles, against the float64 reference (FlexAttention runs uncompiled on CPU).

Tolerances follow from the precision: a fast float32 path may be at most twice as far from the
float64 reference as the naive float32 implementation (dense softmax in float32), plus float32
rounding of the output itself.
"""
import numpy as np
import pytest
import torch

from poslsh_cli.numerics import masks
from poslsh_cli.attention import (exact_alibi, laplacian_weight, mean_mask_weight, poslsh_attention,
                                  reference_attention)
from poslsh_cli.numerics.sampling import sample_partitions

SIGMAS = [1.0, 4.0, 16.0, 64.0]


def qkv(n, H=4, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, n, d, generator=g, dtype=torch.float64) for _ in range(3)]


def tolerance(q, k, v, weight, causal):
    """2x the naive float32 error against float64 (max abs), plus output rounding."""
    ref, _ = reference_attention(q, k, v, weight, causal)
    naive, _ = reference_attention(q.float(), k.float(), v.float(), weight, causal, dtype=torch.float32)
    return ref, 2 * (naive.double() - ref).abs().max().item() + 4 * torch.finfo(torch.float32).eps


def dense_tiles(bm, groups, n, tile=128):
    """(partial, full) per (group, q tile, kv tile) from a BlockMask's index lists."""
    tiles = (n + tile - 1) // tile
    out = []
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        d = torch.zeros(groups, tiles, tiles, dtype=torch.bool)
        for g in range(groups):
            for t in range(tiles):
                d[g, t, idx[0, g, t, :num[0, g, t]].long()] = True
        out.append(d)
    return out


def bins_of(parts):
    return torch.as_tensor(np.stack([p.bins() for p in parts]).reshape(-1, parts[0].seq_len))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["window_int", "window_per_head", "same_block", "both", "none"])
def test_block_mask_tiles_cover_the_mask_and_full_tiles_need_none(kind, causal):
    """Every kept (query, key) lies in a listed tile; every full tile keeps all of its pairs;
    and tiles are skipped where the mask keeps nothing (sparsity is real)."""
    n, H = 1000, 4
    parts = [sample_partitions(n, sg, 1, np.random.default_rng(3)) for sg in SIGMAS]
    window = {"window_int": masks.Window.of(40, H, "cpu"), "window_per_head": masks.Window.of([0, 5, 130, 700], H, "cpu"),
              "both": masks.Window.of([3, 9, 27, 81], H, "cpu")}.get(kind)
    block = masks.SameBlock.of(bins_of(parts)) if kind in ("same_block", "both") else None
    keep = masks.combine(causal, window, block)
    if keep is None:
        assert not causal and kind == "none"
        return
    bm = masks.block_mask(keep, H, n, "cpu")
    partial, full = dense_tiles(bm, H, n)
    assert not (partial & full).any()
    i = torch.arange(n)
    grid = keep.grid(i, i, H)  # (H, n, n)
    pad = (-n) % 128
    g = torch.nn.functional.pad(grid, (0, pad, 0, pad)).reshape(H, -1, 128, (n + pad) // 128, 128)
    any_kept = g.any(dim=(2, 4))
    all_kept = torch.nn.functional.pad(grid, (0, pad, 0, pad), value=True).reshape(
        H, -1, 128, (n + pad) // 128, 128).all(dim=(2, 4))
    assert not (any_kept & ~(partial | full)).any()  # nothing kept is skipped
    assert not (full & ~all_kept).any()  # full tiles need no mask
    assert ((partial | full) == any_kept).all()  # and no tile is visited for nothing


@pytest.mark.parametrize("causal", [False, True])
def test_flex_poslsh_equals_reference_with_many_key_tiles(causal):
    """Issue 8.1: n=1000, sigmas 1, 4, 16, 64, s=8 (IndexError before the fix)."""
    n, s = 1000, 8
    q, k, v = qkv(n)
    g = np.random.default_rng(0)
    parts = [sample_partitions(n, sg, s, g) for sg in SIGMAS]
    ref, tol = tolerance(q, k, v, mean_mask_weight(parts), causal)
    got = poslsh_attention(q.float(), k.float(), v.float(), parts, causal, backend="flex")
    err = (got.double() - ref).abs().max().item()
    assert err <= tol, (err, tol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 25, [1, 4, 64, 1500]])
def test_flex_alibi_equals_reference_with_many_key_tiles(causal, window):
    """Issue 8.2: exact and windowed ALiBi on the flex path, one window or one per head."""
    n = 1000
    q, k, v = qkv(n)
    sig = torch.tensor(SIGMAS, dtype=torch.float64)
    w = laplacian_weight(n, sig)
    if window is not None:
        i = torch.arange(n)
        w = w * masks.Window.of(window, 4, "cpu").grid(i, i, 4)
    ref, tol = tolerance(q, k, v, w, causal)
    torch.testing.assert_close(exact_alibi(q, k, v, sig, causal, window=window, backend="reference"), ref,
                               rtol=0, atol=1e-12)
    for backend in ("flex", "chunked"):
        got = exact_alibi(q.float(), k.float(), v.float(), sig, causal, window=window, backend=backend)
        err = (got.double() - ref).abs().max().item()
        assert err <= tol, (backend, err, tol)


def test_window_accepts_int_or_one_per_head_only():
    assert masks.Window.of(3, 4, "cpu").width.tolist() == [3, 3, 3, 3]
    assert masks.Window.of([1, 2, 3, 4], 4, "cpu").width.tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="one per head"):
        masks.Window.of([1, 2], 4, "cpu")
    with pytest.raises(ValueError, match=">= 0"):
        masks.Window.of(-1, 4, "cpu")


def test_same_block_interval_is_the_block():
    doc = torch.tensor([[0, 0, 1, 1, 1, 3, 4, 4]])
    m = masks.SameBlock.of(doc)
    lo, hi = m.interval(torch.arange(8))
    assert lo.tolist() == [[0, 0, 2, 2, 2, 5, 6, 6]] and hi.tolist() == [[1, 1, 4, 4, 4, 5, 7, 7]]


def test_device_bins_equal_the_partition_bins_and_layouts_check_their_use():
    from poslsh_cli.attention import FlexLayout, device_bins

    g = np.random.default_rng(5)
    parts = [sample_partitions(700, sg, 6, g) for sg in (0.3, 2.0, 9.0, 300.0)]
    np.testing.assert_array_equal(device_bins(parts, "cpu").numpy(), np.stack([p.bins() for p in parts]))
    q, k, v = (t.float() for t in qkv(700))
    lay = FlexLayout.build(parts, causal=True)
    torch.testing.assert_close(poslsh_attention(q, k, v, parts, True, layout=lay),
                               poslsh_attention(q, k, v, parts, True, backend="blocks"), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="another causal"):
        poslsh_attention(q, k, v, parts, False, layout=lay)
