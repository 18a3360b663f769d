"""Where a run was made: the source commit, the package versions and the machine, as meta.json
records them, and the one line a report shows for the machine."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def git_commit() -> dict[str, Any]:
    """Commit of the poslsh source tree, when it is a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        return {"commit": commit, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("poslsh", "numpy", "scipy", "torch", "pandas", "hydra-core", "omegaconf",
                 "transformers", "matplotlib", "typer"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                            "cpu": cpu_name(), "cpu_count": os.cpu_count()}
    import sys

    torch = sys.modules.get("torch")  # only when the experiment used it: importing it costs seconds
    if torch is not None:
        try:
            info["torch_threads"] = torch.get_num_threads()
            if torch.cuda.is_available():
                info["cuda"] = torch.cuda.get_device_name(0)
        except Exception:
            pass
    return info


def cpu_name() -> str | None:
    """The processor's model name (Linux's /proc/cpuinfo; else what :mod:`platform` knows), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    name = platform.processor()
    return name if name and name.lower() not in ("unknown", platform.machine().lower()) else None


def machine_text(device: dict[str, Any] | None) -> str:
    """The machine of a run's meta.json ``device`` in words: the GPU's name, else the CPU's (or its
    architecture, for runs recorded without it) and its core count."""
    dev = device or {}
    if dev.get("cuda"):
        return str(dev["cuda"])
    cpu = dev.get("cpu") or (f"{dev['machine']} CPU" if dev.get("machine") else "unknown CPU")
    n = dev.get("cpu_count")
    return f"{cpu}, {n} cores" if n else cpu


def preset_of(meta: Any) -> str | None:
    """The preset (``experiment=NAME``) a run was made with, as its meta.json records it (``preset``);
    for a run written before meta.json had the field, read from its recorded command. None: no preset."""
    if not isinstance(meta, dict):
        return None
    if meta.get("preset"):
        return str(meta["preset"])
    import re

    # a job of a multirun: its own overrides, not the sweep's command
    said = " ".join(map(str, meta.get("job_overrides") or [])) or str(meta.get("argv") or "")
    found = re.search(r"experiment=([^\s,]+)", said)
    return found.group(1) if found else None
