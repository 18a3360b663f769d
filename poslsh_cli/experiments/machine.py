"""What this machine lets a process use, read from the kernel: the memory still available
(``/proc/meminfo``, capped by a cgroup limit; free memory on a CUDA device) and the cores
(affinity, capped by a cgroup CPU quota). Memory estimates are checked against the first
(:func:`poslsh_cli.experiments.base.check_memory`), timings record the second
(:mod:`poslsh_cli.experiments.measure`)."""
from __future__ import annotations

from pathlib import Path

#: Where this process's cgroup limits are read (v2 files at its root, v1 under a controller folder)
CGROUP = Path("/sys/fs/cgroup")


def available_memory(device: str = "cpu") -> float:
    """Bytes that can still be allocated: free CUDA memory on a GPU; otherwise the kernel's
    MemAvailable, capped by a cgroup limit (a container, a SLURM job) when one is set."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
            return float(torch.cuda.mem_get_info(index)[0])
    avail = float("inf")
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = float(line.split()[1]) * 1024
    except OSError:
        try:
            import os

            avail = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            pass
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (CGROUP / limit_file).read_text().strip()
            if limit.isdigit() and int(limit) < 2**60:
                avail = min(avail, float(int(limit) - int((CGROUP / usage_file).read_text().strip())))
            break
        except (OSError, ValueError):
            continue
    return avail


def usable_cores() -> float:
    """CPUs this process may run on: its affinity set (``os.sched_getaffinity``), capped by a cgroup
    CPU quota when one is set (a container, a SLURM job): ``cpu.max`` (v2) or ``cpu.cfs_quota_us``
    over ``cpu.cfs_period_us`` (v1). A quota may be a fraction of a core."""
    import os

    cores = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            fields = (CGROUP / quota_file).read_text().split()
            if period_file is not None:
                fields = fields[:1] + (CGROUP / period_file).read_text().split()[:1]
            if fields[0] not in ("max", "-1") and float(fields[1]) > 0:
                cores = min(cores, float(fields[0]) / float(fields[1]))
            break
        except (OSError, ValueError, IndexError):
            continue
    return cores
