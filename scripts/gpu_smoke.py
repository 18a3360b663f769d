"""The compiled FlexAttention paths once each (exact ALiBi, the union and per-mask routes of Positional
LSH; forward, and backward on CUDA) at n=1000 against float64: a few seconds that tell whether the
kernels compile here before the long GPU check runs. Exits non-zero when one is off by more than 1e-4.

    python scripts/gpu_smoke.py [cuda|cpu]
"""
import sys

import numpy as np
import torch

from poslsh_cli.attention import exact_alibi, laplacian_weight, mean_mask_weight, poslsh_attention, reference_attention
from poslsh_cli.numerics.sampling import sample_partitions

dev = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
print(torch.__version__, torch.cuda.get_device_name(0) if dev == "cuda" else "cpu")
g = np.random.default_rng(0)
n, sig = 1000, [1.0, 4.0, 16.0, 64.0]
parts = [sample_partitions(n, s, 8, g) for s in sig]
q, k, v = (torch.randn(1, 4, n, 64, dtype=torch.float64) for _ in range(3))
worst = 0.0
for causal in (True, False):
    for name, w, fn in (
            ("exact", laplacian_weight(n, torch.tensor(sig)), lambda a, b, c: exact_alibi(a, b, c, sig, causal)),
            ("union", mean_mask_weight(parts), lambda a, b, c: poslsh_attention(a, b, c, parts, causal, backend="union")),
            ("flex", mean_mask_weight(parts), lambda a, b, c: poslsh_attention(a, b, c, parts, causal, backend="flex"))):
        ref = reference_attention(q, k, v, w, causal)[0]
        x = [t.to(dev).float().requires_grad_(dev == "cuda") for t in (q, k, v)]
        out = fn(*x)
        if dev == "cuda":
            out.sum().backward()
        err = float((out.double().cpu() - ref).abs().max())
        worst = max(worst, err)
        print(f"{name} {'causal' if causal else 'bidirectional'}: max |out - float64| {err:.2e}")
sys.exit(0 if worst < 1e-4 else 1)
