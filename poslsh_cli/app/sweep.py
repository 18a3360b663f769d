"""One table from a Hydra multirun: ``poslsh collect SWEEP_DIR``, also run at the end of every
multirun by :class:`CollectCallback`.

A multirun writes one run directory per job (``SWEEP_DIR/<job number>/``) beside Hydra's
``multirun.yaml``. :func:`collect` recomputes the list of jobs the sweep asked for from
``multirun.yaml``, checks that each has a complete run directory, and concatenates their
``results.csv`` into ``SWEEP_DIR/results.csv`` with the job number and the job's own overrides as
columns (``job``, ``job.<key>``), so the sweep reads as one experiment. Jobs that are missing or
unfinished are named; no cell appears twice (each job's cells are unique by construction, and a
job that is started again resumes its own directory).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.core.files import atomic_write_text
from poslsh_cli.store.readers import results, status
from poslsh_cli.app.registry import experiment_of

COLLECTED = "results.csv"
#: Columns that are measurements of a run, not part of a row's identity.
MEASURED = ("seconds", "peak_mem_mb", "sample_seconds", "attention_seconds", "gflops", "tokens_per_s",
            "step_seconds")


@dataclass
class Collected:
    path: Path  # the table written
    jobs: int  # jobs the sweep asked for
    rows: int
    problems: list[str] = field(default_factory=list)  # missing or unfinished jobs, one line each
    notes: list[str] = field(default_factory=list)  # tables repaired from their cells, one line each

    @property
    def complete(self) -> bool:
        return not self.problems


def expected_jobs(sweep: Path) -> list[list[str]]:
    """The override list of every job of the sweep, in job-number order, from multirun.yaml."""
    import yaml
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    mr = sweep / "multirun.yaml"
    if not mr.exists():
        raise ConfigError(f"{sweep} is not a multirun directory (no multirun.yaml)")
    data = yaml.safe_load(mr.read_text()) or {}
    task = (((data.get("hydra") or {}).get("overrides") or {}).get("task")) or []
    parsed = OverridesParser.create().parse_overrides([o for o in task if not o.startswith(("hydra.", "hydra/"))])
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def collect(sweep: Path) -> Collected:
    """Write ``sweep/results.csv`` from every job's results; see the module docstring."""
    import pandas as pd

    sweep = Path(sweep)
    jobs = expected_jobs(sweep)
    frames, problems, notes = [], [], []
    for num, overrides in enumerate(jobs):
        where = sweep / str(num)
        what = " ".join(o for o in overrides if not o.startswith("out="))
        if not (where / "config.yaml").exists():
            problems.append(f"job {num} ({what}) has no run directory")
            continue
        try:
            exp, _, meta, df = _job_table(where, notes)
        except ConfigError as exc:
            problems.append(f"job {num} ({what}): {exc}")
            continue
        st = status(where, meta)
        if st != "complete":
            state = "died (its process was killed)" if st == "died" else f"is {st}"
            problems.append(f"job {num} ({what}) {state}: {meta.get('cells_done')}/"
                            f"{meta.get('cells_total')} cells; run the same command again to finish it")
        if df.empty:
            continue
        identity = [c for c in df.columns if c not in MEASURED]
        if df.duplicated(subset=identity).any():
            problems.append(f"job {num} ({what}) holds {int(df.duplicated(subset=identity).sum())} rows twice")
        columns = {"job": num}
        for o in overrides:
            key, _, value = o.partition("=")
            if key != "out":
                columns[f"job.{key}"] = value
        frames.append(df.assign(**columns))
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if len(out):  # the same cell run by two jobs (e.g. a value listed twice in the sweep)
        identity = [c for c in out.columns if c not in MEASURED and c != "job" and not c.startswith("job.")]
        twice = out[out.duplicated(subset=identity, keep=False)]
        if len(twice):
            problems.append(f"{int(out.duplicated(subset=identity).sum())} cells were run by more than one job "
                            f"(jobs {', '.join(map(str, sorted(twice.job.unique())))})")
    atomic_write_text(sweep / COLLECTED, out.to_csv(index=False))
    return Collected(sweep / COLLECTED, len(jobs), len(out), problems, notes)


def _job_table(where: Path, notes: list[str]) -> tuple:
    """(experiment, config, meta, rows) of one job, its rows read from its cells (see
    :func:`poslsh_cli.store.readers.results`)."""
    exp, cfg, meta = experiment_of(where)
    return exp, cfg, meta, results(where, exp.columns, notes.append)


class CollectCallback(Callback):
    """Hydra callback: collect the sweep's table when a multirun ends (any launcher)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        import sys

        sweep = Path(config.hydra.sweep.dir)
        try:
            res = collect(sweep)
        except ConfigError as exc:
            sys.stderr.write(f"poslsh collect: {exc}\n")
            return
        sys.stdout.write(f"collected {res.rows} rows of {res.jobs} jobs: {res.path}\n")
        for p in res.notes + res.problems:
            sys.stderr.write(f"poslsh collect: {p}\n")
