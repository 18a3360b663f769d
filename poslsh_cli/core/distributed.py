"""Several processes on ``torch.distributed``: who this process is, one process group, and the few
collective steps the runner and the training loop need.

A run is distributed when it is started by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT`` in the environment) or as one task of a multi-task submitit job
(a SLURM job with ``tasks_per_node`` > 1 or ``nodes`` > 1, or submitit's local executor): then
submitit's ``TorchDistributedEnvironment`` exports the same variables. Rank 0 is the *main*
process: it owns the run directory and writes everything (cells, logs, checkpoints); the other
ranks compute and write nothing, and learn what the main process decided (the run directory, the
cells still to run, the checkpoint to resume from) by a broadcast.

Backends: NCCL between CUDA devices, gloo on the CPU (how the tests run two processes here).
Everything here is a no-op in one process, so callers need no branches. ``torch`` is imported
inside functions: the command line starts without it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

from poslsh_cli.core.errors import ConfigError

T = TypeVar("T")

#: seconds a rank waits for the others in one collective (rank 0 may tokenise a corpus meanwhile)
TIMEOUT_ENV = "POSLSH_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 7200.0


class FollowerError(ConfigError):
    """An error the main process already reported; the other ranks exit with it silently."""


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int

    @property
    def main(self) -> bool:
        return self.rank == 0


def _submitit_tasks() -> Optional[int]:
    """The number of tasks of the submitit job this process is one of (None outside one)."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    try:
        from submitit import JobEnvironment

        return int(JobEnvironment().num_tasks)
    except Exception:  # not inside a job after all
        return None


def world() -> World:
    """This process's place: from torchrun's variables, else a multi-task submitit job's, else one
    process."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    tasks = _submitit_tasks()
    if tasks and tasks > 1:
        from submitit import JobEnvironment

        env = JobEnvironment()
        return World(int(env.global_rank), tasks, int(env.local_rank))
    return World(0, 1, 0)


def active() -> bool:
    """More than one process takes part."""
    return world().size > 1


def is_main() -> bool:
    return world().main


def rank() -> int:
    return world().rank


def initialized() -> bool:
    import torch.distributed as td

    return td.is_available() and td.is_initialized()


def init() -> World:
    """Join the process group (once; NCCL when CUDA is present, gloo otherwise). In a multi-task
    submitit job the torchrun variables are exported first. Returns this process's place."""
    w = world()
    if w.size <= 1 or initialized():
        return w
    import datetime

    import torch
    import torch.distributed as td

    if "RANK" not in os.environ:  # a submitit task: the same variables torchrun would set
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    if torch.cuda.is_available():
        torch.cuda.set_device(w.local_rank % torch.cuda.device_count())
        td.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
    else:
        td.init_process_group("gloo", timeout=timeout)
    return w


def device(requested: str) -> str:
    """The device this rank trains on: CUDA device ``LOCAL_RANK`` when the run asks for CUDA (or
    auto finds it), the CPU otherwise."""
    import torch

    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise ConfigError(f"device={requested} but CUDA is not available")
    if active():
        return f"cuda:{world().local_rank % torch.cuda.device_count()}"
    return requested if requested.startswith("cuda") else "cuda"


def broadcast(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (picklable objects)."""
    if not active():
        return obj
    import torch.distributed as td

    box = [obj]
    td.broadcast_object_list(box, src=0)
    return box[0]


def decide(fn: Callable[[], T]) -> T:
    """``fn()`` run by the main process only, its result (or its ConfigError) on every rank: the
    other ranks raise :class:`FollowerError` with the same message (printed once, by rank 0)."""
    if not active():
        return fn()
    if is_main():
        try:
            value = fn()
        except ConfigError as exc:
            broadcast(("error", str(exc)))
            raise
        except BaseException as exc:
            broadcast(("error", f"{type(exc).__name__}: {exc}"))
            raise
        broadcast(("ok", value))
        return value
    tag, value = broadcast(None)
    if tag == "error":
        raise FollowerError(value)
    return value


def barrier() -> None:
    if active():
        import torch.distributed as td

        td.barrier()


def all_reduce_mean(value: float, device: Any = "cpu") -> float:
    """The mean of a float over the ranks."""
    if not active():
        return float(value)
    import torch
    import torch.distributed as td

    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    td.all_reduce(t)
    return float(t.item()) / world().size


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not active():
        return [obj]
    import torch.distributed as td

    out: list[Any] = [None] * world().size
    td.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------
# a follower's failure, told to rank 0 at once

#: the key of the process group's store under which a failing follower leaves its error
FAILURE_KEY = "poslsh/follower-failure"


def _store() -> Any:
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # no process group (one process), or a torch without the private helper
        return None


def report_failure(text: str) -> None:
    """(A rank other than 0, about to exit with an error) leave ``text`` in the process group's
    store for rank 0, which then fails at once naming it (:func:`follower_failure`) instead of
    waiting in a collective for the timeout. First come first kept."""
    store = _store() if active() and initialized() else None
    if store is None:
        return
    try:
        store.compare_set(FAILURE_KEY, "", f"rank {rank()}: {text}")
    except Exception:
        pass


def follower_failure() -> Optional[str]:
    """The error a follower reported (:func:`report_failure`), or None."""
    store = _store() if active() and initialized() else None
    if store is None:
        return None
    try:
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode() or None
    except Exception:
        return None
    return None


def watch_followers(every_s: float = 1.0) -> None:
    """(Rank 0) a daemon thread that aborts this process's collectives as soon as a follower reports
    a failure: gloo already fails at once when a peer's connection closes; NCCL would wait for the
    collective timeout, so its communicators are aborted (the waiting collective then raises)."""
    import threading

    if not active() or not is_main() or not initialized():
        return

    def watch() -> None:
        import time

        while initialized():
            if follower_failure() is not None:
                try:
                    from torch.distributed import distributed_c10d as c10d

                    c10d._abort_process_group()
                except Exception:
                    pass
                return
            time.sleep(every_s)

    import torch

    if torch.cuda.is_available():  # only NCCL needs it
        threading.Thread(target=watch, name="poslsh-follower-watch", daemon=True).start()
