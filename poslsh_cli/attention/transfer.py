"""Host-to-device copies of the drawn scalars and the small host-computed tables of the attention
paths: one non-blocking copy from pinned memory, so building a layout never synchronises the device
(docs/ARCHITECTURE.md, "Attention")."""
from __future__ import annotations

import numpy as np
import torch


def to_device(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host array on ``device`` in one non-blocking copy from pinned memory (no synchronisation)."""
    t, device = torch.from_numpy(np.ascontiguousarray(a)), torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


__all__ = ["to_device"]
