"""Print what one padding token costs a batch without a key/value cache: the time of a batch of
two n-token sequences with the first token of the second one marked as padding, over the time of
the same batch unpadded (the goal: at most 1.5).

Two levels, Positional LSH with s masks per head, 4 heads of dimension 16 (sigmas of the standard
ALiBi slopes), float32 on the CPU:

    attention  attend(q, k, v) on (2, 4, n, 16) against attend_each_sequence with the padding mask
               (what a padded batch runs: each sequence's real tokens alone, from position 0)
    model      a one-layer Qwen3 with the scheme installed (hidden 64): model(ids) against
               model(ids, attention_mask=mask), logits only (use_cache=False)

The two are timed interleaved (unpadded, padded, unpadded, ...; the median of each), after one
warm-up call each. Timings mean something only on a machine with nothing else running: measure
alone, or with OMP_NUM_THREADS set to the cores left free.

Usage: python scripts/padded_batch_bench.py [--sizes 2048:8,4096:32] [--repeats 5] [--level both]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from poslsh_cli.attention import AttentionSpec, attend
from poslsh_cli.attention.positioned import attend_each_sequence
from poslsh_cli.lm.loading import Arch, build_model
from poslsh_cli.attention.scheme import SchemeKeys
from poslsh_cli.lm.positions import PositionState

HEADS, HEAD_DIM = 4, 16


def interleaved(calls: dict, repeats: int) -> dict:
    """Median wall time (s) of each call, timed in turn (A B A B ...) after one warm-up each."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def attention_calls(n: int, s: int) -> dict:
    state = PositionState.from_keys(SchemeKeys("poslsh", s=s), HEADS)
    spec_at = lambda r: state.attention_spec(0, r, None)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, n, HEAD_DIM, generator=g) for _ in range(3))
    padding = torch.ones(2, n, dtype=torch.bool)
    padding[1, 0] = False  # one padding token
    with torch.no_grad():
        return {"unpadded": lambda: attend(q, k, v, spec_at(n)),
                "padded": lambda: attend_each_sequence(q, k, v, padding, spec_at)}


def model_calls(n: int, s: int) -> dict:
    arch = Arch(hidden=HEADS * HEAD_DIM, layers=1, heads=HEADS, kv_heads=HEADS, intermediate=128, head_dim=HEAD_DIM,
                max_positions=n)
    model = build_model(arch, PositionState.from_keys(SchemeKeys("poslsh", s=s), HEADS), seed=0).eval()
    ids = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, 0] = 0  # one padding token

    def run(**kw):
        with torch.no_grad():
            return model(ids, use_cache=False, **kw).logits

    return {"unpadded": run, "padded": lambda: run(attention_mask=mask)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2048:8,4096:32", help="n:s pairs, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--level", choices=("attention", "model", "both"), default="both")
    args = parser.parse_args()
    levels = ("attention", "model") if args.level == "both" else (args.level,)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"threads {torch.get_num_threads()}, cores {os.cpu_count()}, load average {load:.2f} at the start")
    for size in args.sizes.split(","):
        n, s = (int(x) for x in size.split(":"))
        for level in levels:
            calls = attention_calls(n, s) if level == "attention" else model_calls(n, s)
            t = interleaved(calls, args.repeats)
            print(f"{level:9s} n={n} s={s}: unpadded {t['unpadded']:.3f} s, padded {t['padded']:.3f} s, "
                  f"padded/unpadded {t['padded'] / t['unpadded']:.2f}")
    if hasattr(os, "getloadavg"):
        print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
