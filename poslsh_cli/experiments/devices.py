"""Devices and dtypes as commands name them: the ``device=`` key (:class:`Device`, checked when the
spec is built) and the torch device it resolves to, why a CUDA preset cannot run here, the
``dtype=`` key and its torch dtype, and waiting for queued CUDA work before a clock is read."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Optional

from poslsh_cli.core.errors import ConfigError

if TYPE_CHECKING:  # annotations only: importing this module does not import torch
    import contextlib

    import torch


class Device(str):
    """A device key: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, checked once when the spec is built
    (:func:`poslsh_cli.core.config.build_spec` calls :meth:`coerce`)."""

    @classmethod
    def coerce(cls, value: Any, name: str) -> "Device":
        import re

        if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ConfigError(f"{name} must be auto, cpu or cuda[:N], got {value!r}")
        return cls(value)

    @property
    def is_cuda(self) -> bool:
        return self.startswith("cuda")


def resolve_device(name: str) -> Any:
    """``auto`` -> CUDA when present, else CPU; refuses CUDA where there is none."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(name).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available")
    return torch.device(name)


def cuda_skip_reason(device: str) -> Optional[str]:
    """Why a preset asking for CUDA cannot run here (reproduce skips it and says so), or None."""
    if str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return f"device={device} but this machine has no CUDA GPU"
    return None


class Dtype(str, enum.Enum):
    """Compute dtypes a command accepts (``dtype=``)."""
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


def torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


def synchronize(device: Any) -> None:
    """Wait for queued CUDA work, so wall-clock timings are honest."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Precision(str, enum.Enum):
    """Arithmetic of the forward and backward passes (autocast); weights and optimizer stay float32."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context of ``precision`` on ``device`` (nothing for fp32)."""
    import contextlib

    import torch

    if precision is Precision.FP32:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision is Precision.BF16 else torch.float16
    return torch.autocast(device.type, dtype=dtype)
