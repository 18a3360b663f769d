"""Host-to-device copies of the drawn scalars and the small host-computed tables of the attention
paths: one non-blocking copy from pinned memory, so building a layout never synchronises the device
(docs/ARCHITECTURE.md, "Attention")."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from poslsh_cli.numerics.sampling import Partitions


def to_device(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host array on ``device`` in one non-blocking copy from pinned memory (no synchronisation)."""
    t, device = torch.from_numpy(np.ascontiguousarray(a)), torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def drawn_scalars(partitions: Sequence[Partitions], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The widths and shifts of every (head, sample), (H, s) float64 each, on ``device`` in one copy."""
    widths, shifts = to_device(np.stack([np.stack([p.widths for p in partitions]),
                                         np.stack([p.shifts for p in partitions])]), device)
    return widths, shifts


__all__ = ["to_device", "drawn_scalars"]
