"""From a command's argv to its run: the overrides parsed and every job composed and validated
into a frozen spec (bad input fails here, before anything is written), the run directory named
(the default one reserved), the launcher checked, then Hydra's task, which runs the cell loop
(:mod:`poslsh_cli.app.runner`). Errors become one line (:func:`fail`).
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

from poslsh_cli.app import registry
from poslsh_cli.core.config import build_spec
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.base import Experiment
from poslsh_cli.lm import models
from poslsh_cli.app.runner import RunFailed, Terminated, execute
from poslsh_cli.core import distributed as dist
from poslsh_cli.core.distributed import FollowerError
from poslsh_cli.store import ownership, rundir
from poslsh_cli.store.rundir import check_writable, missing_top, remove_created, reserve_default


_HYDRA_PREFIXES = ("hydra.", "hydra/", "+hydra", "++hydra", "~hydra")


#: launcher -> (Python module of its plugin, what else it needs). local, joblib and slurm are the
#: presets in conf/hydra/launcher/; basic, submitit_local and submitit_slurm the plugins' own.
LAUNCHERS = {"basic": (None, None), "local": (None, None), "joblib": ("hydra_plugins.hydra_joblib_launcher", None),
             "submitit_local": ("hydra_plugins.hydra_submitit_launcher", None),
             "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "sbatch"),
             "slurm": ("hydra_plugins.hydra_submitit_launcher", "sbatch")}


#: what each launcher name does, in the order --help, the guide and the error line give them
LAUNCHER_WORDS = {"basic": "one job after another (the default)", "local": "the same as basic",
                  "joblib": "jobs in parallel on this machine",
                  "slurm": "a SLURM array with this project's settings (requeued jobs resume)",
                  "submitit_slurm": "a SLURM array with the plugin's own defaults",
                  "submitit_local": "SLURM's code path on this machine"}


def launcher_help() -> str:
    """The launchers in one line: each name and what it does (the last four need the launchers extra)."""
    return ("; ".join(f"{name}: {LAUNCHER_WORDS[name]}" for name in LAUNCHERS)
            + "; joblib, slurm, submitit_slurm and submitit_local need pip install -e \".[launchers]\"")


def fail(command: str, message: "str | BaseException", code: int = 2) -> None:
    """The error on stderr, never a traceback, then exit non-zero. A message written for the user
    (a :class:`ConfigError`, or text) is kept whole: one line, or a first line and the lines it
    gives to act on (the markers to put in a file); any other exception by its first line. Under
    torchrun only rank 0 says what rank 0 decided (the other ranks exit with the same code,
    silently)."""
    if isinstance(message, FollowerError):
        raise SystemExit(code)
    text = str(message).strip()
    if isinstance(message, BaseException) and not isinstance(message, ConfigError):
        text = " ".join(text.splitlines()[:1])
    sys.stderr.write(f"poslsh {command}: error: {text or type(message).__name__}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def _parse(exp: Experiment, overrides: list[str], multirun: bool) -> list[list[str]]:
    """Check overrides and expand them into one list per job (one job unless ``-m``)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    for o in overrides:
        if o.startswith("-"):
            raise ConfigError(f"unknown option {o!r} (see poslsh {exp.name} --help)")
        if "=" not in o:
            raise ConfigError(f"expected KEY=VALUE, got {o!r} (see poslsh {exp.name} --help)")
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise ConfigError(f"cannot parse overrides: {str(exc).splitlines()[0]}") from None
    for p in parsed:
        key = p.key_or_group
        if key == "hydra/launcher":
            check_launcher(str(p.value()), multirun)
        if key.startswith(_HYDRA_PREFIXES) or key == "hydra":
            continue
        if p.is_sweep_override():
            if not multirun:
                raise ConfigError(f"{p.input_line!r} is a sweep: add -m for a Hydra multirun, "
                                  f"or write '{key}=[a,b]' to sweep inside one run")
            if key == "out":
                raise ConfigError("out= cannot be swept; each multirun job gets out/<job number>")
    user = [p for p in parsed if not p.key_or_group.startswith(_HYDRA_PREFIXES)]
    if not multirun:
        return [[p.input_line for p in user]]
    try:
        return [job for batch in BasicSweeper.split_arguments(user, None) for job in batch]
    except HydraException as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None


def _positional(exp: Experiment, args: list[str]) -> list[str]:
    """Plain arguments (paths) become the experiment's positional key: ``key=['a','b']``."""
    if exp.positional is None:
        return args
    plain = [a for a in args if not a.startswith("-") and ("=" not in a or os.path.exists(a))]
    if not plain:
        return args
    if any(a.startswith(f"{exp.positional}=") for a in args):
        raise ConfigError(f"give {exp.positional} either as plain arguments or as {exp.positional}=, not both")
    for a in plain:
        if "'" in a:
            raise ConfigError(f"cannot pass a path with a quote: {a!r}")
    quoted = ",".join(f"'{a}'" for a in plain)
    return [a for a in args if a not in plain] + [f"{exp.positional}=[{quoted}]"]


def check_launcher(name: str, multirun: bool) -> None:
    """One line for a launcher that cannot run here, before Hydra prints its own pages."""
    import importlib.util
    import shutil

    if name not in LAUNCHERS:
        raise ConfigError(f"unknown launcher {name!r} (choose from {launcher_help()})")
    if not multirun:
        raise ConfigError(f"hydra/launcher={name} applies to a multirun: add -m")
    module, program = LAUNCHERS[name]
    try:
        missing = module is not None and importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # not even the hydra_plugins namespace
        missing = True
    if missing:
        raise ConfigError(f"hydra/launcher={name} needs the launcher plugins: pip install -e \".[launchers]\"")
    if program and shutil.which(program) is None:
        raise ConfigError(f"hydra/launcher={name} needs SLURM ({program} is not on PATH); "
                          "hydra/launcher=submitit_local runs the same code path on this machine")


def _out_of(job: list[str]) -> Optional[str]:
    for o in job:
        if o.startswith("out="):
            v = o[4:]
            return None if v in ("null", "") else v
    return None


def launch(exp: Experiment, args: list[str], multirun: bool) -> None:
    """Validate every job, then run ``exp`` through ``hydra.main``.

    Nothing is created before the task has checked its input: a single run gives Hydra a
    scratch directory of its own (the run directory is made by the runner once the spec, the
    memory estimate, the data and the checkpoints are checked); a multirun's sweep directory is
    owned by this process for the sweep (a second sweep on it is refused), and everything it
    created is removed again when no job made a run there.
    """
    args = models.shorthand(list(args)) if "model" in exp.groups else list(args)
    try:
        if dist.active():  # torchrun: every rank runs this; rank 0 names the run directory
            if multirun:
                raise ConfigError("a multirun (-m) cannot run under torchrun: start one torchrun per job, or "
                                  "a SLURM sweep with hydra.launcher.tasks_per_node")
            if not exp.distributed:
                raise ConfigError(f"poslsh {exp.name} runs in one process; only train runs under torchrun "
                                  f"(WORLD_SIZE={dist.world().size})")
            dist.init()
        args = _positional(exp, args)
        jobs = _parse(exp, args, multirun)
        given = _out_of(jobs[0])
        out = dist.broadcast(given or str(Path("runs") / exp.name / rundir.timestamp()))
        out = str(Path(out).expanduser().resolve())
        for job in jobs:
            job = [o for o in job if not o.startswith("out=")] + [f"out={out}"]
            registry.compose_spec(exp, job)

        def where() -> None:
            check_writable(Path(out))
            ownership.check_free(Path(out))

        dist.decide(where)
        if not given:  # the default directory, made here so two launches in one second get two
            if dist.is_main():
                made, reserved = reserve_default(Path(out).parent, Path(out).name)
                out = str(made)
            out = dist.broadcast(out)
    except ConfigError as exc:
        fail(exp.name, exc)
        return
    argv, scratch = _hydra_argv(exp, args, out, multirun)
    replay = " ".join(["poslsh", exp.name] + (["-m"] if multirun else []) + list(args))
    top = reserved if not given and dist.is_main() else missing_top(Path(out))
    try:
        if multirun:
            try:
                ownership.acquire(Path(out), replay)
            except ConfigError as exc:
                fail(exp.name, str(exc))
            try:
                _run_hydra(exp, argv, replay, multirun)
            finally:
                _remove_if_no_run(Path(out), top)
                ownership.release(Path(out))
        else:
            try:
                _run_hydra(exp, argv, replay, multirun)
            finally:
                if not given and dist.is_main():  # the reserved directory, when the run left nothing in it
                    _remove_if_no_run(Path(out), top)
    finally:
        if scratch is not None:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)



def _hydra_argv(exp: Experiment, args: list[str], out: str, multirun: bool) -> tuple[list[str], str | None]:
    """The argument vector ``hydra.main`` runs with, and the scratch directory a single run gives
    Hydra (None for a multirun, whose sweep directory is ``out``; the sweep ends with one table,
    poslsh collect)."""
    import tempfile

    hydra_args = [a for a in args if a.startswith(_HYDRA_PREFIXES)]
    user_args = [a for a in args if not a.startswith(_HYDRA_PREFIXES) and not a.startswith("out=")]
    argv = [f"poslsh {exp.name}"] + user_args + [f"out={out}"] + [
        "hydra.output_subdir=null", "hydra/job_logging=disabled"]
    scratch = None
    if multirun:
        argv = argv[:1] + ["--multirun"] + argv[1:] + [f"hydra.sweep.dir={out}", "hydra.sweep.subdir=${hydra.job.num}",
                                                        "+hydra.callbacks.collect._target_=poslsh_cli.app.sweep.CollectCallback"]
    else:
        scratch = tempfile.mkdtemp(prefix="poslsh-hydra-")
        argv += [f"hydra.run.dir={scratch}", "hydra/hydra_logging=disabled"]
    return argv + hydra_args, scratch


def _remove_if_no_run(out: Path, top: Optional[Path]) -> None:
    """A sweep whose jobs were all refused before writing anything must not leave its directory
    (nor the directories created above it) behind. Only what this process owns is removed, and
    nothing that holds a run."""
    import shutil

    if top is None:
        return
    if not out.is_dir():  # the run removed itself (nothing computed): what was made above it goes too
        remove_created(out.parent, top)
        return
    if any(out.rglob("config.yaml")):
        return
    if ownership.owns(out) or ownership.holder(out) is None:
        shutil.rmtree(out, ignore_errors=True)
        remove_created(out.parent, top)


def terminate_as_interrupt() -> None:
    """SIGTERM (a cancelled job) stops like Ctrl-C: finished cells stay, and the run exits 143
    (Ctrl-C: 130). Installed in the task itself, so it holds wherever Hydra runs the task, except
    in a submitit job (SLURM), where submitit owns the signals: it ignores SIGTERM and requeues on
    its preemption/timeout signal, and the requeued job resumes the run directory."""
    if os.environ.get("SUBMITIT_EXECUTOR"):
        return

    def _term(signum: int, frame: Any) -> None:
        raise Terminated

    try:
        signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not the main thread
        pass


def _config_text(cfg: Any) -> str:
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    return OmegaConf.to_yaml(OmegaConf.create(data))


def _run_hydra(exp: Experiment, argv: list[str], replay: str, multirun: bool) -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    registry.register_all_schemas()

    def task(cfg: Any) -> None:
        terminate_as_interrupt()
        run_dir = Path(cfg.out)
        preset = HydraConfig.get().runtime.choices.get("experiment")
        meta = {"preset": preset} if preset and preset != "null" else {}
        if multirun:
            run_dir = run_dir / str(HydraConfig.get().job.num)
            meta.update(job=HydraConfig.get().job.num, job_overrides=list(HydraConfig.get().overrides.task))
        try:
            rc = execute(exp, build_spec(exp.spec, cfg), run_dir, replay, _config_text(cfg), meta)
        except ConfigError as exc:
            fail(exp.name, exc)
        except RunFailed as exc:
            if os.environ.get("POSLSH_DEBUG"):
                raise
            fail(exp.name, " ".join(str(exc).splitlines()[:1]) + " (set POSLSH_DEBUG=1 for a traceback)", code=1)
        if rc:
            raise SystemExit(rc)

    saved = sys.argv
    sys.argv = argv
    try:
        hydra.main(config_path="pkg://poslsh_cli.conf", config_name=exp.config_name, version_base="1.3")(task)()
    finally:
        sys.argv = saved
