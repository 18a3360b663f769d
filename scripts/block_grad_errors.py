"""Print the gradient errors of the recomputing block kernel (issue 18's check, as in
tests/test_attention.py::test_block_gradients_equal_float64_autograd_of_the_dense_route).

q, k, v gradients of Positional-LSH attention on the blocks backend (n=1500, 5 heads with sigmas
0.7..400, s=6 per-head partitions, both kernels, causal and bidirectional) in float32, against
float64 autograd of softmax(q k^T / sqrt(d) + log M~) v, beside the naive float32 implementation's
error and the test's tolerance. Usage: python scripts/block_grad_errors.py
"""
import numpy as np
import torch

from poslsh_cli.attention import (AttentionSpec, Backend, Kernel, Method, Plan, attend, mean_mask_weight,
                                  reference_attention)
from poslsh_cli.numerics.sampling import sample_partitions


def grads(q, k, v, dT, run, dtype=torch.float32):
    x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    return [g.double() for g in torch.autograd.grad(run(*x), x, dT.to(dtype))]


def main() -> None:
    n, sig, s = 1500, [0.7, 3.0, 12.0, 48.0, 400.0], 6
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, len(sig), n, 16, generator=g, dtype=torch.float64) for _ in range(3))
    rng = np.random.default_rng(4)
    parts = tuple(sample_partitions(n, sg, s, rng) for sg in sig)
    w = mean_mask_weight(parts)
    eps = torch.finfo(torch.float32).eps
    for causal in (True, False):
        x64 = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = reference_attention(*x64, w, causal)[0]
        dT = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        g64 = torch.autograd.grad(ref, x64, dT)
        naive = grads(q, k, v, dT, lambda a, b, c: reference_attention(a, b, c, w, causal, dtype=torch.float32)[0])
        spec = AttentionSpec(Method.POSLSH, sig, causal, partitions=parts)
        for kernel in Kernel:
            fast = grads(q, k, v, dT, lambda a, b, c: attend(a, b, c, spec, plan=Plan(Method.POSLSH, Backend.BLOCKS,
                                                                                        kernel)))
            cells = []
            for name, r, nv, f in zip("qkv", g64, naive, fast):
                tol = 2 * (nv - r).abs().max().item() + (4 + s) * eps * r.abs().max().item()
                cells.append(f"d{name} {(f - r).abs().max().item():.2e} (naive float32 "
                             f"{(nv - r).abs().max().item():.2e}, tolerance {tol:.2e})")
            print(f"{'causal' if causal else 'bidirectional'} blocks/{kernel.value}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
