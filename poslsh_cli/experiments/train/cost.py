"""What a training session will cost, said after its first steps: the models it still has to train
times their steps times the median step time measured on the first of them."""
from __future__ import annotations

import statistics

from poslsh_cli.experiments.train.spec import TrainSpec

#: the training steps of the session's first model whose median time says what the run will cost
PACE_STEPS = 10


def say_cost(seconds: list[float], steps: int, spec: TrainSpec, models: int) -> str:
    """What a training session will cost, from the median of its first steps (the first is left out
    where there are more: it warms up): this model's ``steps`` and the session's ``models`` at their
    longest training, evaluations and saving not counted."""
    pace = statistics.median(seconds[1:] if len(seconds) > 2 else seconds)
    longest = max(spec.steps)
    return (f"train: {pace:.3g} s a step (the median of the first {len(seconds)}): this model about "
            f"{_duration(pace * steps)}; the session's {models} model{'s' * (models != 1)} of up to {longest} steps "
            f"about {_duration(pace * longest * models)} at this pace (evaluations not counted; schemes differ in "
            "cost, and so does a shared machine)")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
