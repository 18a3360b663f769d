"""The ``poslsh`` command line: Typer owns the command line, Hydra owns configuration.

One command per registered experiment (:mod:`poslsh_cli.registry`), plus ``plot``, ``report``
and ``reproduce``. Every experiment command takes trailing ``key=value`` Hydra overrides (lists
as ``key=[a,b]`` sweep inside one run). ``-m`` turns comma-separated values (``s=8,16``) into a
Hydra multirun, so the same command runs jobs one after another (basic launcher), in parallel
(``hydra/launcher=joblib``) or as a SLURM array (``hydra/launcher=submitit_slurm``).

Flow: argv -> overrides parsed and every job composed and validated into a frozen spec (so bad
input fails before anything is written) -> ``hydra.main`` task -> the same validation -> runner
-> run directory. Errors are raised below this module and turned into one line here.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from poslsh_cli import __version__, models, registry
from poslsh_cli.config import CONF_DIR, ConfigError, build_spec, key_help
from poslsh_cli.experiment import Experiment

app = typer.Typer(
    name="poslsh",
    help="Reproduce, measure and extend Positional LSH (Wolfson & Wagner, 2026): ALiBi's bias exp(-|i-j|/sigma) "
         "as the mean of random block-diagonal masks.\n\n"
         "Experiment commands take KEY=VALUE overrides (lists: key=\\[a,b]); experiment=NAME applies a preset; "
         "-m runs a Hydra multirun over comma-separated values. Results go to runs/<command>/<timestamp>/ or "
         "out=DIR; running again with the same out= resumes.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
_HYDRA_PREFIXES = ("hydra.", "hydra/", "+hydra", "++hydra", "~hydra")
#: launcher -> (Python module of its plugin, what else it needs). local, joblib and slurm are the
#: presets in conf/hydra/launcher/; basic, submitit_local and submitit_slurm the plugins' own.
LAUNCHERS = {"basic": (None, None), "local": (None, None), "joblib": ("hydra_plugins.hydra_joblib_launcher", None),
             "submitit_local": ("hydra_plugins.hydra_submitit_launcher", None),
             "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "sbatch"),
             "slurm": ("hydra_plugins.hydra_submitit_launcher", "sbatch")}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"poslsh {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """poslsh: Positional-LSH experiment runner."""


def fail(command: str, message: "str | BaseException", code: int = 2) -> None:
    """One clear line on stderr, then exit non-zero. Under torchrun only rank 0 says what rank 0
    decided (the other ranks exit with the same code, silently)."""
    from poslsh_cli.distributed import FollowerError

    if isinstance(message, FollowerError):
        raise SystemExit(code)
    first = " ".join(str(message).strip().splitlines()[:1]) or type(message).__name__
    sys.stderr.write(f"poslsh {command}: error: {first}\n")
    sys.stderr.flush()
    raise SystemExit(code)


# ---------------------------------------------------------------------------------------------
# help text


def _paragraphs(text: str) -> str:
    """Reflow a docstring: lines of a paragraph joined, so the terminal wraps whole sentences;
    square brackets escaped, so rich shows ``position=[a,b]`` instead of reading it as markup."""
    from rich.markup import escape

    paras = [" ".join(line.strip() for line in p.splitlines()) for p in text.strip().split("\n\n")]
    return "\n\n".join(escape(p) for p in paras if p)


def _helped(fn: Callable[..., None]) -> Callable[..., None]:
    """A command whose docstring is reflowed (see :func:`_paragraphs`)."""
    fn.__doc__ = _paragraphs(fn.__doc__ or "")
    return fn


def _yaml_defaults(exp: Experiment) -> dict:
    """Defaults as written in conf/<command>.yaml, config groups by their chosen name."""
    import yaml

    data = yaml.safe_load((CONF_DIR / f"{exp.config_name}.yaml").read_text()) or {}
    for entry in data.pop("defaults", []) or []:
        if isinstance(entry, dict):
            for group, name in entry.items():
                if group in exp.groups:
                    data[group] = {"name": name}
    return data


def _epilog(exp: Experiment) -> str:
    from rich.markup import escape

    lines = [f"[b]Keys[/b] (KEY=VALUE, defaults from conf/{exp.config_name}.yaml):\n\n"]
    for k, default, text in key_help(exp.spec, _yaml_defaults(exp)):
        if k in exp.groups and k == "model":
            text = models.help_text()
        lines.append(f"  [cyan]{k}[/cyan]={escape(default)}  {escape(text)}\n\n")
    presets = registry.preset_names(exp)
    if presets:
        lines.append(f"  [cyan]experiment[/cyan]=NAME  a preset from conf/experiment/: {escape(', '.join(presets))}\n\n")
    lines.append("  [cyan]hydra/launcher[/cyan]=NAME  with -m: basic (default), joblib (parallel on this machine), "
                 "submitit_local or submitit_slurm (SLURM array); the last three need pip install -e \".\\[launchers]\"\n\n")
    return "".join(lines)


# ---------------------------------------------------------------------------------------------
# overrides -> jobs -> hydra.main


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
            _check_launcher(str(p.value()), multirun)
        if key.startswith(_HYDRA_PREFIXES) or key == "hydra":
            continue
        if p.is_sweep_override():
            if not multirun:
                raise ConfigError(f"{p.input_line!r} is a sweep: add -m for a Hydra multirun, "
                                  f"or write {key}=[a,b] to sweep inside one run")
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


def _check_launcher(name: str, multirun: bool) -> None:
    """One line for a launcher that cannot run here, before Hydra prints its own pages."""
    import importlib.util
    import shutil

    if name not in LAUNCHERS:
        raise ConfigError(f"unknown launcher {name!r} (choose from {', '.join(LAUNCHERS)})")
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
    import tempfile

    from poslsh_cli import ownership
    from poslsh_cli.rundir import check_writable, missing_top, reserve_default, timestamp

    from poslsh_cli import distributed as dist

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
        out = dist.broadcast(given or str(Path("runs") / exp.name / timestamp()))
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
    hydra_args = [a for a in args if a.startswith(_HYDRA_PREFIXES)]
    user_args = [a for a in args if not a.startswith(_HYDRA_PREFIXES) and not a.startswith("out=")]
    argv = [f"poslsh {exp.name}"] + user_args + [f"out={out}"] + [
        "hydra.output_subdir=null", "hydra/job_logging=disabled"]
    scratch = None
    if multirun:  # and one table from the sweep when it ends (poslsh collect)
        argv = argv[:1] + ["--multirun"] + argv[1:] + [f"hydra.sweep.dir={out}", "hydra.sweep.subdir=${hydra.job.num}",
                                                        "+hydra.callbacks.collect._target_=poslsh_cli.sweep.CollectCallback"]
    else:
        scratch = tempfile.mkdtemp(prefix="poslsh-hydra-")
        argv += [f"hydra.run.dir={scratch}", "hydra/hydra_logging=disabled"]
    argv += hydra_args
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


def _remove_if_no_run(out: Path, top: Optional[Path]) -> None:
    """A sweep whose jobs were all refused before writing anything must not leave its directory
    (nor the directories created above it) behind. Only what this process owns is removed, and
    nothing that holds a run."""
    import shutil

    from poslsh_cli import ownership
    from poslsh_cli.rundir import remove_created

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


def _terminate_as_interrupt() -> None:
    """SIGTERM (a cancelled job) stops like Ctrl-C: finished cells stay. Installed in the task
    itself, so it holds wherever Hydra runs the task, except in a submitit job (SLURM), where
    submitit owns the signals: it ignores SIGTERM and requeues on its preemption/timeout signal,
    and the requeued job resumes the run directory."""
    if os.environ.get("SUBMITIT_EXECUTOR"):
        return

    def _term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

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

    from poslsh_cli.runner import RunFailed, execute

    registry.register_all_schemas()

    def task(cfg: Any) -> None:
        _terminate_as_interrupt()
        run_dir = Path(cfg.out)
        meta = {}
        if multirun:
            run_dir = run_dir / str(HydraConfig.get().job.num)
            meta = {"job": HydraConfig.get().job.num, "job_overrides": list(HydraConfig.get().overrides.task)}
        try:
            rc = execute(exp, build_spec(exp.spec, cfg), run_dir, replay, _config_text(cfg), meta)
        except ConfigError as exc:
            fail(exp.name, exc)
        except RunFailed as exc:
            if os.environ.get("POSLSH_DEBUG"):
                raise
            fail(exp.name, f"{exc} (set POSLSH_DEBUG=1 for a traceback)", code=1)
        if rc:
            raise SystemExit(rc)

    saved = sys.argv
    sys.argv = argv
    try:
        hydra.main(config_path="pkg://poslsh_cli.conf", config_name=exp.config_name, version_base="1.3")(task)()
    finally:
        sys.argv = saved


def _multirun_opt() -> Any:
    return typer.Option(False, "-m", "--multirun",
                        help="Hydra multirun: one job per combination of comma-separated values.")


def _experiment_command(exp: Experiment) -> Callable[..., None]:
    def command(ctx: typer.Context, multirun: bool = _multirun_opt()) -> None:
        launch(exp, ctx.args, multirun)

    command.__name__ = exp.config_name
    command.__doc__ = _paragraphs(exp.help)
    return command


for _exp in registry.experiments().values():
    app.command(_exp.name, context_settings=_EXTRA, epilog=_epilog(_exp))(_experiment_command(_exp))


# ---------------------------------------------------------------------------------------------
# commands over run directories


@app.command("report")
@_helped
def report_cmd(run_dirs: List[Path] = typer.Argument(..., help="run directories (a multirun root works too)",
                                                     show_default=False),
               out: Path = typer.Option(None, "--out", "-o", help="where report.md and report.html go "
                                        "(default: the single run directory, or the common parent)")) -> None:
    """One report.md and a self-contained report.html: each paper claim beside its measurement."""
    from poslsh_cli import report
    from poslsh_cli.rundir import find_runs

    try:
        runs = find_runs(run_dirs)
        target = out or _common_parent(runs)
        if target.exists() and not target.is_dir():
            raise ConfigError(f"-o {target} is a file: -o names the folder that report.md and report.html go to")
        md, html_path = report.build(run_dirs, target,
                                     notice=lambda text: sys.stderr.write(f"poslsh report: {text}\n"))
    except ConfigError as exc:
        fail("report", str(exc))
        return
    except OSError as exc:
        fail("report", f"cannot write the report ({exc.strerror or type(exc).__name__}: {exc.filename or target})")
        return
    typer.echo(str(md))
    typer.echo(str(html_path))


def _common_parent(paths: list[Path]) -> Path:
    if len(paths) == 1:
        return paths[0]
    return Path(os.path.commonpath([str(p.resolve()) for p in paths]))


@app.command("collect")
@_helped
def collect_cmd(sweep_dir: Path = typer.Argument(..., help="the directory of a multirun (holds multirun.yaml)",
                                                 show_default=False)) -> None:
    """One results.csv from a multirun: every job's rows, with the job's overrides as columns;
    says which jobs are missing or unfinished and which cells more than one job ran (exit 1).
    Runs by itself at the end of every -m."""
    from poslsh_cli.sweep import collect

    try:
        res = collect(sweep_dir)
    except ConfigError as exc:
        fail("collect", str(exc))
        return
    typer.echo(f"{res.rows} rows from {res.jobs} jobs: {res.path}")
    for p in res.notes + res.problems:
        sys.stderr.write(f"poslsh collect: {p}\n")
    if res.problems:
        raise SystemExit(1)


@app.command("reproduce")
@_helped
def reproduce_cmd(scale: str = typer.Option("paper", help="paper or quick"),
                  runs: Path = typer.Option(Path("runs/reproduce"), help="root of the run directories"),
                  launcher: str = typer.Option("local", help="local (one preset after another), joblib (presets in "
                                               "parallel here) or slurm (each preset a SLURM job)"),
                  jobs: Optional[int] = typer.Option(None, help="joblib: presets at once (default: the cores)"),
                  with_: list[str] = typer.Option([], "--with", help="opt-in presets to run as well: train_long, "
                                                  "perplexity_long (the long-context CPU runs), or all")) -> None:
    """Every experiment of the paper at one scale, then plots and the report (resumable)."""
    from poslsh_cli.reproduce import Launcher
    from poslsh_cli.reproduce import main as reproduce_main

    for value, kind in ((scale, registry.Scale), (launcher, Launcher)):
        if value not in {m.value for m in kind}:
            fail("reproduce", f"--{kind.__name__.lower()} must be {' or '.join(m.value for m in kind)}, got {value!r}")
    if launcher != Launcher.LOCAL.value:
        try:
            _check_launcher(launcher, multirun=True)
        except ConfigError as exc:
            fail("reproduce", str(exc))
    from poslsh_cli.reproduce import check_with

    try:
        include = check_with(with_)
    except ConfigError as exc:
        fail("reproduce", str(exc))
    raise SystemExit(reproduce_main(scale, runs, launcher, jobs, include))


@app.command("plot")
@_helped
def plot_cmd(run_dirs: List[Path] = typer.Argument(..., help="run directories (a multirun root works too)",
                                                   show_default=False)) -> None:
    """Draw the figures of finished (or partial) runs into each run's figures/ (PNG and PDF)."""
    from poslsh_cli.report import plot_run
    from poslsh_cli.rundir import find_runs

    def notice(text: str) -> None:
        sys.stderr.write(f"poslsh plot: {text}\n")

    try:
        runs = find_runs(run_dirs)
    except ConfigError as exc:
        fail("plot", str(exc))
    failed = []
    for run in runs:  # one run that cannot be plotted does not stop the others
        try:
            for p in plot_run(run, notice=notice):
                typer.echo(str(p))
        except ConfigError as exc:
            failed.append(str(exc))
        except OSError as exc:
            failed.append(f"{run}: cannot write its figures ({exc.strerror or type(exc).__name__}: "
                          f"{exc.filename or run})")
    if failed and len(runs) > 1:
        for why in failed[:-1]:
            notice(f"not plotted: {why}")
        fail("plot", f"{len(failed)} of {len(runs)} runs not plotted; the last: {failed[-1]}")
    elif failed:
        fail("plot", failed[0])


def run() -> None:
    """Console-script entry point."""
    _terminate_as_interrupt()
    app()


if __name__ == "__main__":  # pragma: no cover
    run()


__all__ = ["app", "run", "launch", "fail"]
