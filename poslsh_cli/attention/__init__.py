"""Attention with ALiBi, Positional-LSH attention, and the baselines (docs/THEORY.md, "Attention").

With ``A_ij = exp(q_i . k_j / sqrt(d))``, tensors (batch, heads, seq_len, head_dim) and one kernel
bandwidth per head ``sigma_h = 1 / slope_h``:

    exact ALiBi        T* = D^-1 (A o L*) V   = softmax(q k^T / sqrt(d) - |i-j| / sigma) V
    Positional LSH     T~ = D~^-1 (A o M~) V,  M~ = (1/s) sum_k M(h_k)

Modules, one job each:

    plan       the one place a path is chosen: Backend, Kernel, Plan, choose/plan_for
    api        AttentionSpec (one factory, AttentionSpec.build), attend, exact_alibi, poslsh_attention
    reference  the dense float64 oracle, L* and M~ as dense weights
    alibi      exact / windowed ALiBi by query chunks, the rank-one causal path, no bias
    dense      one attention with an (H, n, n) additive bias (ALiBi or log M~): training lengths
    blocks     block layouts, block-local attention with lse per sample, merged (MergedBlockAttention
               recomputes the block probabilities in the backward pass)
    merge      the merge of attention over disjoint key sets by their lse
    dropout    attention dropout on the CPU flash kernel (FlashDropout) and its keep mask
    flex       FlexAttention: ALiBi score_mod, Positional LSH with bins as documents
    union      one attention over the union of each query's s blocks, the counts C_ij as a log bias
               (UnionLayout: the counts table; FlexAttention and chunked routes)
    band       the union route on the CPU: each position's sorted block ends, heads grouped by band (BandLayout)
    positioned every method at explicit positions (a decoding step through a key/value cache, a
               padded batch)
    scheme     Scheme: a method with everything that fixes what it computes, from the keys to the kernel
    transfer   one non-blocking host-to-device copy of the drawn scalars and small tables
"""
from typing import Any

_WHERE = {
    "CHUNK_ELEMENTS": "poslsh_cli.attention.alibi",
    "alibi_chunked": "poslsh_cli.attention.alibi",
    "alibi_rank1": "poslsh_cli.attention.alibi",
    "alibi_rank1_tiled": "poslsh_cli.attention.alibi",
    "no_bias_attention": "poslsh_cli.attention.alibi",
    "AttentionSpec": "poslsh_cli.attention.api",
    "attend": "poslsh_cli.attention.api",
    "exact_alibi": "poslsh_cli.attention.api",
    "poslsh_attention": "poslsh_cli.attention.api",
    "poslsh_layout": "poslsh_cli.attention.api",
    "layout_for": "poslsh_cli.attention.api",
    "reference_weight": "poslsh_cli.attention.api",
    "BLOCK_BATCH_BYTES": "poslsh_cli.attention.blocks",
    "BlockLayout": "poslsh_cli.attention.blocks",
    "per_sample_block_attention": "poslsh_cli.attention.blocks",
    "merged_block_attention": "poslsh_cli.attention.blocks",
    "device_bins": "poslsh_cli.attention.blocks",
    "merge_by_lse": "poslsh_cli.attention.merge",
    "alibi_bias": "poslsh_cli.attention.dense",
    "dense_bias_attention": "poslsh_cli.attention.dense",
    "poslsh_bias": "poslsh_cli.attention.dense",
    "FlexLayout": "poslsh_cli.attention.flex",
    "alibi_flex": "poslsh_cli.attention.flex",
    "poslsh_flex": "poslsh_cli.attention.flex",
    "backends_of": "poslsh_cli.attention.plan",
    "DENSE_MAX_N": "poslsh_cli.attention.plan",
    "RANK1_MIN_N": "poslsh_cli.attention.plan",
    "INFER_DENSE_MAX_N": "poslsh_cli.attention.plan",
    "Backend": "poslsh_cli.attention.plan",
    "Kernel": "poslsh_cli.attention.plan",
    "Plan": "poslsh_cli.attention.plan",
    "choose": "poslsh_cli.attention.plan",
    "needs_grad": "poslsh_cli.attention.plan",
    "plan_for": "poslsh_cli.attention.plan",
    "laplacian_weight": "poslsh_cli.attention.reference",
    "mean_mask_weight": "poslsh_cli.attention.reference",
    "reference_attention": "poslsh_cli.attention.reference",
    "Method": "poslsh_cli.numerics.methods",
}


def __getattr__(name: str) -> Any:
    """Names are loaded from their module on first use, so importing ``poslsh_cli.attention.plan``
    (the CLI names backends in specs) does not import torch."""
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_WHERE))


__all__ = ["AttentionSpec", "attend", "exact_alibi", "poslsh_attention", "poslsh_layout", "layout_for", "reference_weight",
           "Method", "Backend", "Kernel", "Plan", "choose", "plan_for", "needs_grad", "backends_of", "DENSE_MAX_N",
           "RANK1_MIN_N", "INFER_DENSE_MAX_N", "CHUNK_ELEMENTS", "BLOCK_BATCH_BYTES", "alibi_chunked", "alibi_rank1", "alibi_rank1_tiled", "no_bias_attention",
           "BlockLayout", "per_sample_block_attention", "merged_block_attention", "device_bins", "merge_by_lse", "alibi_bias",
           "dense_bias_attention", "poslsh_bias", "FlexLayout", "alibi_flex", "poslsh_flex", "laplacian_weight",
           "mean_mask_weight", "reference_attention"]
