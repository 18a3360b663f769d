"""Where the time of one training step goes, per position scheme: the step-bench model (or the
paper's 13.8M-parameter size) under torch.profiler, the operators that take the most device time.

    python scripts/profile_step.py --seq-len 8192 --sigma 256 --s 100 --precision bf16 \
        --positions rope alibi poslsh --hidden 512 --layers 4 --head-dim 64 --intermediate 1536 --batch 2

Prints, per scheme: the median step time of the timed steps and the ten operators with the largest
self time on the device (CPU time on the CPU), with their share of the profiled step.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import numpy as np
    import torch

    from poslsh_cli.experiments.devices import synchronize
    from poslsh_cli.experiments.devices import Precision, autocast
    from poslsh_cli.lm.data import VOCAB
    from poslsh_cli.attention.scheme import SchemeKeys
    from poslsh_cli.lm.loading import Arch, build_model
    from poslsh_cli.lm.positions import PositionState

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--positions", nargs="+", default=["rope", "alibi", "poslsh"])
    ap.add_argument("--s", type=int, default=100)
    ap.add_argument("--sigma", type=float, default=None, help="one sigma for every head (default: standard slopes)")
    ap.add_argument("--precision", default="bf16", choices=[p.value for p in Precision])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    device = torch.device(a.device)
    arch = Arch(a.hidden, a.layers, a.heads, a.heads, a.intermediate, a.head_dim, max(8192, a.seq_len))
    x = torch.as_tensor(np.random.default_rng(0).integers(0, VOCAB, size=(a.batch, a.seq_len + 1)), device=device)
    for position in a.positions:
        state = PositionState.from_keys(SchemeKeys(position, s=a.s, sigma=a.sigma), a.heads)
        model = build_model(arch, state, 0).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(t: int) -> float:
            state.step = t
            synchronize(device)
            t0 = time.perf_counter()
            with autocast(Precision(a.precision), device):
                logits = model(input_ids=x[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            synchronize(device)
            return time.perf_counter() - t0

        step(0)
        step(1)
        times = [step(2 + t) for t in range(a.steps)]
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda"
                                                         else [])
        with torch.profiler.profile(activities=acts) as prof:
            step(100)
        attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        events = list(prof.key_averages())
        if device.type == "cuda":  # the kernels alone: an operator's device time repeats its kernels'
            from torch.autograd import DeviceType

            events = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA] or events
        events = sorted(events, key=lambda e: getattr(e, attr, 0.0), reverse=True)
        total = sum(getattr(e, attr, 0.0) for e in events) or 1.0
        print(f"== {position} (L={a.seq_len}, {a.precision}, paths {sorted(state.plans)}): median step "
              f"{statistics.median(times):.4f} s over {a.steps}; profiled {total / 1e6:.4f} s "
              f"({'device' if device.type == 'cuda' else 'CPU'} self time)")
        for e in events[:10]:
            t = getattr(e, attr, 0.0)
            print(f"  {t / total:6.1%}  {t / 1e3:9.2f} ms  x{e.count:<5d} {e.key[:90]}")
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
