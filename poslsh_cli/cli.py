"""The ``poslsh`` command line: Typer owns the command line, Hydra owns configuration.

Every experiment command takes trailing ``key=value`` Hydra overrides (lists as ``key=[a,b]``
sweep inside one run). ``-m`` turns comma-separated values (``s=8,16``) into a Hydra multirun,
so the same command runs jobs one after another (basic launcher), in parallel
(``hydra/launcher=joblib``) or as a SLURM array (``hydra/launcher=submitit_slurm``).

Flow: argv -> overrides checked and composed for every job (so bad input fails before anything
is written) -> ``hydra.main`` task -> typed config -> pure experiment functions -> run directory.
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any, List, Optional

import typer

from poslsh_cli import __version__
from poslsh_cli.config import SCHEMAS, ConfigError, config_name, key_help, register_schemas, validate

app = typer.Typer(
    name="poslsh",
    help="Reproduce, measure and extend Positional LSH (Wolfson & Wagner, 2026): ALiBi's bias "
         "exp(-|i-j|/sigma) as the mean of random block-diagonal masks.\n\n"
         "Experiment commands take KEY=VALUE overrides (lists: key=\\[a,b]); -m runs a Hydra multirun "
         "over comma-separated values. Results go to runs/<command>/<timestamp>/ or out=DIR; "
         "re-running with the same out= resumes.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
_HYDRA_PREFIXES = ("hydra.", "hydra/", "+hydra", "++hydra", "~hydra")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"poslsh {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """poslsh: Positional-LSH experiment runner."""


def _epilog(command: str) -> str:
    lines = ["[b]Keys[/b] (KEY=VALUE, defaults from conf/" + config_name(command) + ".yaml):\n\n"]
    from rich.markup import escape

    for key, default, text in key_help(command):
        lines.append(f"  [cyan]{key}[/cyan]={escape(default)}  {escape(text)}\n\n")
    return "".join(lines)


def fail(command: str, message: str, code: int = 2) -> None:
    """One clear line on stderr, then exit non-zero."""
    first = " ".join(str(message).strip().splitlines()[:1]) or type(message).__name__
    sys.stderr.write(f"poslsh {command}: error: {first}\n")
    sys.stderr.flush()
    raise SystemExit(code)


# ---------------------------------------------------------------------------------------------
# overrides -> jobs -> hydra.main


def _parse(command: str, overrides: list[str], multirun: bool) -> list[list[str]]:
    """Check overrides and expand them into one list per job (one job unless ``-m``)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    known = {f for f in SCHEMAS[command].__dataclass_fields__}
    overrides = _model_shorthand(command, overrides)
    for o in overrides:
        if o.startswith("-"):
            raise ConfigError(f"unknown option {o!r} (see poslsh {command} --help)")
        if "=" not in o:
            raise ConfigError(f"expected KEY=VALUE, got {o!r} (see poslsh {command} --help)")
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise ConfigError(f"cannot parse overrides: {str(exc).splitlines()[0]}") from None
    for p in parsed:
        key = p.key_or_group
        if key.startswith(_HYDRA_PREFIXES) or key == "hydra":
            continue
        if key.split(".")[0] not in known and key != "experiment":
            raise ConfigError(f"unknown key {key!r} for {command}; known keys: {', '.join(sorted(known))}")
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


def _model_shorthand(command: str, overrides: list[str]) -> list[str]:
    """``model=/path/to/checkpoint`` means the ``custom`` preset with that path."""
    from poslsh_cli.config import MODEL_PRESETS

    if command != "output-error":
        return overrides
    out = []
    for o in overrides:
        if o.startswith("model=") and o[6:] not in MODEL_PRESETS:
            out += ["model=custom", f"model.path={o[6:]}"]
        else:
            out.append(o)
    return out


def _compose(command: str, overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schemas()
    try:
        with initialize_config_module("poslsh_cli.conf", version_base="1.3"):
            return compose(config_name=config_name(command), overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        cause = exc.__cause__ or exc
        text = " ".join(str(cause).split("\n")[0:1])
        raise ConfigError(f"bad value: {text}") from None


def _out_of(job: list[str]) -> Optional[str]:
    for o in job:
        if o.startswith("out="):
            v = o[4:]
            return None if v in ("null", "") else v
    return None


def launch(command: str, args: list[str], multirun: bool) -> None:
    """Validate everything, then run ``command`` through ``hydra.main``."""
    try:
        jobs = _parse(command, list(args), multirun)
        out = _out_of(jobs[0]) or str(Path("runs") / command / _timestamp())
        out = str(Path(out).expanduser().resolve())
        for job in jobs:
            job = [o for o in job if not o.startswith("out=")] + [f"out={out}"]
            validate(command, _compose(command, job))
        from poslsh_cli.rundir import check_writable

        check_writable(Path(out))
    except ConfigError as exc:
        fail(command, str(exc))
        return
    args = _model_shorthand(command, list(args))
    hydra_args = [a for a in args if a.startswith(_HYDRA_PREFIXES)]
    user_args = [a for a in args if not a.startswith(_HYDRA_PREFIXES) and not a.startswith("out=")]
    argv = [f"poslsh {command}"] + user_args + [f"out={out}"] + [
        "hydra.output_subdir=null", "hydra/job_logging=disabled"]
    if multirun:
        argv = argv[:1] + ["--multirun"] + argv[1:] + [f"hydra.sweep.dir={out}", "hydra.sweep.subdir=${hydra.job.num}"]
    else:
        argv += [f"hydra.run.dir={out}", "hydra/hydra_logging=disabled"]
    argv += hydra_args
    existed = Path(out).exists()
    try:
        _run_hydra(command, argv, " ".join(["poslsh", command] + list(args)), multirun)
    finally:
        if not existed:
            _remove_if_no_run(Path(out))


def _remove_if_no_run(out: Path) -> None:
    """Hydra creates its output directory before the task runs; a task refused before writing
    anything must not leave that directory (or a multirun's) behind."""
    import shutil

    if out.is_dir() and not any(out.rglob("config.yaml")):
        shutil.rmtree(out, ignore_errors=True)


def _timestamp() -> str:
    from poslsh_cli.rundir import timestamp

    return timestamp()


def _run_hydra(command: str, argv: list[str], user_argv: str, multirun: bool) -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    register_schemas()

    def task(cfg: Any) -> None:
        from poslsh_cli.runner import execute

        run_dir = Path(cfg.out)
        if multirun:
            run_dir = run_dir / str(HydraConfig.get().job.num)
        execute(command, cfg, run_dir, user_argv)

    saved = sys.argv
    sys.argv = argv
    try:
        hydra.main(config_path="pkg://poslsh_cli.conf", config_name=config_name(command),
                   version_base="1.3")(task)()
    finally:
        sys.argv = saved


def _multirun_opt() -> Any:
    return typer.Option(False, "-m", "--multirun",
                        help="Hydra multirun: one job per combination of comma-separated values.")


@app.command("sample", context_settings=_EXTRA, epilog=_epilog("sample"))
def sample_cmd(ctx: typer.Context, multirun: bool = _multirun_opt()) -> None:
    """Draw positional-LSH partitions; write masks.npz (bins, widths, shifts) and a block table.

    `poslsh sample n=N sigma=SIGMA s=S seed=SEED` regenerates exactly the masks behind any
    results row with that seed.
    """
    launch("sample", ctx.args, multirun)


@app.command("matrix-error", context_settings=_EXTRA, epilog=_epilog("matrix-error"))
def matrix_error_cmd(ctx: typer.Context, multirun: bool = _multirun_opt()) -> None:
    """Spectral and max-norm error of the mean of s masks against L* = exp(-|i-j|/sigma).

    One row per (n, sigma, s, trial) and method. method=fast never builds an n x n matrix:
    O(n) matvecs, Lanczos for ||L*-M~||_2, the band argument for the max norm.
    """
    launch("matrix-error", ctx.args, multirun)


@app.command("block-stats", context_settings=_EXTRA, epilog=_epilog("block-stats"))
def block_stats_cmd(ctx: typer.Context, multirun: bool = _multirun_opt()) -> None:
    """Realised block sizes: b_max against the exact law and sigma*loglog(n); block histograms."""
    launch("block-stats", ctx.args, multirun)


@app.command("output-error", context_settings=_EXTRA, epilog=_epilog("output-error"))
def output_error_cmd(ctx: typer.Context, multirun: bool = _multirun_opt()) -> None:
    """Positional-LSH attention against exact ALiBi on a model's own q, k, v.

    Captures each layer's query/key/value (after RoPE and q/k norms, GQA expanded) from a local
    checkpoint, then measures ||T* - T~||_F / ||T*||_F per head for each s, with the no-bias,
    fixed-block and windowed-ALiBi baselines. Default: the shipped all-MiniLM-L6-v2, n=512.
    """
    launch("output-error", ctx.args, multirun)


@app.command("bench", context_settings=_EXTRA, epilog=_epilog("bench"))
def bench_cmd(ctx: typer.Context, multirun: bool = _multirun_opt()) -> None:
    """Time exact ALiBi, windowed ALiBi, fixed blocks and Positional LSH side by side.

    Random inputs, one sigma per head (standard slopes). Reports median seconds, peak memory,
    useful GFLOP/s and relative error against exact, per (n, causal, method, s or window).
    """
    launch("bench", ctx.args, multirun)


@app.command("report")
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
        md, html_path = report.build(run_dirs, target)
    except ConfigError as exc:
        fail("report", str(exc))
        return
    typer.echo(str(md))
    typer.echo(str(html_path))


def _common_parent(paths: list[Path]) -> Path:
    import os

    if len(paths) == 1:
        return paths[0]
    return Path(os.path.commonpath([str(p.resolve()) for p in paths]))


@app.command("reproduce")
def reproduce_cmd(scale: str = typer.Option("paper", help="paper or quick"),
                  runs: Path = typer.Option(Path("runs/reproduce"), help="root of the run directories")) -> None:
    """Every experiment of the paper at one scale, then plots and the report (resumable)."""
    from poslsh_cli.reproduce import main as reproduce_main

    if scale not in ("paper", "quick"):
        fail("reproduce", f"scale must be paper or quick, got {scale!r}")
    raise SystemExit(reproduce_main(scale, runs))


@app.command("plot")
def plot_cmd(run_dirs: List[Path] = typer.Argument(..., help="run directories (a multirun root works too)",
                                                   show_default=False)) -> None:
    """Draw the figures of finished (or partial) runs into each run's figures/ (PNG and PDF)."""
    from poslsh_cli import plotting
    from poslsh_cli.rundir import find_runs

    try:
        runs = find_runs(run_dirs)
        for run in runs:
            paths = plotting.plot_run(run)
            for p in paths:
                typer.echo(str(p))
    except ConfigError as exc:
        fail("plot", str(exc))


def run() -> None:
    """Console-script entry point; SIGTERM is handled like Ctrl-C (finished cells are kept)."""
    def _term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not the main thread
        pass
    app()


if __name__ == "__main__":  # pragma: no cover
    run()
