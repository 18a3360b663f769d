"""Experiment tracking beside a training cell's own ``metrics.csv`` (which stays the record the
reports read): ``logger=tensorboard`` writes TensorBoard event files into ``<cell>/tensorboard/``
(``tensorboard --logdir RUN/work``), ``logger=wandb`` a Weights & Biases run in ``<cell>/wandb/``
(online, or offline when ``WANDB_MODE=offline``: ``wandb sync`` uploads it later).

A resumed stage logs again from its checkpoint's step, as ``metrics.csv`` does: TensorBoard purges
the events after that step; W&B continues the same run (its id is derived from the cell
directory), where the steps logged before the cut are kept as W&B keeps a run's history in step
order (they are the same numbers where training replays exactly: on the CPU). Only rank 0 of a
distributed run writes.
"""
from __future__ import annotations

import enum
import hashlib
import math
from pathlib import Path
from typing import Any

from poslsh_cli.core.errors import ConfigError


class Logger(str, enum.Enum):
    NONE = "none"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"


class Tracker:
    """No tracking: what ``logger=none`` opens."""

    def log(self, step: int, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _scalars(row: dict) -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


class TensorBoardTracker(Tracker):
    def __init__(self, path: Path, start: int, config: dict):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("logger=tensorboard needs the tensorboard package: pip install 'poslsh[tracking]'") \
                from None
        import json

        # purge_step: events of steps after the resumed checkpoint are dropped, as metrics.csv drops them
        self.writer = SummaryWriter(log_dir=str(path), purge_step=start + 1 if start > 0 else None)
        if start == 0:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, step: int, row: dict) -> None:
        for k, v in _scalars(row).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, path: Path, name: str, group: str, project: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError("logger=wandb needs the wandb package: pip install 'poslsh[tracking]'") from None
        path.mkdir(parents=True, exist_ok=True)
        run_id = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=project, name=name, group=group, dir=str(path), id=run_id, resume="allow",
                              config=config, reinit="create_new")

    def log(self, step: int, row: dict) -> None:
        self.run.log(_scalars(row), step=step)

    def close(self) -> None:
        self.run.finish()


def open_tracker(kind: Logger, cell: Path, name: str, group: str, project: str, config: dict, start: int,
                 writer: bool = True) -> Tracker:
    """The tracker ``kind`` for the training stage in ``cell`` (a no-op one for ``none`` and for the
    ranks that do not write), starting after step ``start``."""
    if kind is Logger.NONE or not writer:
        return Tracker()
    if kind is Logger.TENSORBOARD:
        return TensorBoardTracker(Path(cell) / "tensorboard", start, config)
    return WandbTracker(Path(cell), name, group, project, config)


def open_for(spec: Any, work: Any, label: str, info: dict, start: int) -> Tracker:
    """:func:`open_tracker` for a training stage from its spec (``logger``, ``logger_project``) and
    cell work directory."""
    kind = getattr(spec, "logger", Logger.NONE)
    run = Path(work.path).parent.parent
    return open_tracker(kind, Path(work.path), label, run.name, getattr(spec, "logger_project", "poslsh"),
                        info, start, writer=work.writer)

