"""The ``poslsh`` command line: Typer owns the command line, Hydra owns configuration.

One command per registered experiment (:mod:`poslsh_cli.app.registry`), plus ``plot``, ``report``
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
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from poslsh_cli import __version__
from poslsh_cli.app import registry
from poslsh_cli.app.launch import check_launcher, launcher_help, terminate_as_interrupt, fail, launch
from poslsh_cli.core.config import CONF_DIR, key_help
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm import models
from poslsh_cli.experiments.base import Experiment
from poslsh_cli.app.reproduce import Launcher, check_only, check_with, main as reproduce_main
from poslsh_cli.app.runner import waiting
from poslsh_cli.experiments.machine import available_memory
from poslsh_cli.lm.generate import generate, parse
from poslsh_cli.store.readers import find_runs
from poslsh_cli.verdicts.declared import CLAIMS, claims_of, listing

class _Commands(typer.core.TyperGroup):
    """The command group, refusing an unknown command in one line like every other error (click draws
    a box around it), with the closest command's name."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        import difflib

        name = args[0] if args else ""
        if name and not name.startswith("-") and not ctx.resilient_parsing and self.get_command(ctx, name) is None:
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1)
            sys.stderr.write(f"poslsh: error: no command {name!r}" + (f" (did you mean {close[0]}?)" if close else "")
                             + f"; commands: {', '.join(self.list_commands(ctx))}\n")
            raise SystemExit(2)
        return super().resolve_command(ctx, args)


app = typer.Typer(
    name="poslsh",
    cls=_Commands,
    help="Reproduce, measure and extend Positional LSH (Wolfson & Wagner, 2026): ALiBi's bias exp(-|i-j|/sigma) "
         "as the mean of random block-diagonal masks.\n\n"
         "Experiment commands take KEY=VALUE overrides (lists, quoted for zsh: 'key=\\[a,b]'); experiment=NAME applies a preset; "
         "-m runs a Hydra multirun over comma-separated values. Results go to runs/<command>/<timestamp>/ or "
         "out=DIR; running again with the same out= resumes.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


def _click_style_help() -> None:
    """Help in click's own style where this typer departs from it: a flag shows no value type (typer
    prints ``<bool>`` beside --help, --version, --multirun, which take none), and the usage line names
    arguments in capitals, required bare and optional in brackets (``CHECKPOINT [SETTINGS]...``, not
    ``{checkpoint} [settings]...``)."""
    from typer import core

    flag_type = core.TyperOption.display_type_rich

    def display_type_rich(self, ctx):  # noqa: ANN001, ANN202
        return None if getattr(self, "is_flag", False) and self.metavar is None else flag_type(self, ctx)

    def usage_name(self) -> str:  # noqa: ANN001
        name = self.display_name_raw.upper()
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")

    core.TyperOption.display_type_rich = display_type_rich
    if hasattr(core.TyperArgument, "_usage_display_name"):
        core.TyperArgument._usage_display_name = usage_name


_click_style_help()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"poslsh {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """poslsh: Positional-LSH experiment runner."""


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
        q = "'" if "[" in default else ""  # a list, quoted as the shell needs it (zsh globs brackets)
        lines.append(f"  {q}[cyan]{k}[/cyan]={escape(default)}{q}  {escape(text)}\n\n")
    presets = registry.preset_names(exp)
    if presets:
        lines.append(f"  [cyan]experiment[/cyan]=NAME  a preset from conf/experiment/: {escape(', '.join(presets))}\n\n")
    lines.append("  [cyan]hydra/launcher[/cyan]=NAME  with -m: " + escape(launcher_help()) + "\n\n")
    return "".join(lines)


# ---------------------------------------------------------------------------------------------
# overrides -> jobs -> hydra.main


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
                                        "(default: the single run directory, or the common parent)"),
               publish: Optional[Path] = typer.Option(None, "--publish", help="instead: write DIR/RESULTS.md, "
                                                      "DIR/figures/ and a snapshot of the runs in DIR/results/, "
                                                      "each section stamped with its run, commit and machine "
                                                      "(replaces or removes only snapshots and figures it wrote)"),
               readme: Optional[Path] = typer.Option(None, "--readme", help="with --publish: the file whose "
                                                     "results block (between its markers) is regenerated")) -> None:
    """One report.md and a self-contained report.html: each paper claim beside its measurement.

    With --publish DIR the results are published instead, from a snapshot that publishing
    DIR/results/* again regenerates byte for byte (make publish FROM=<reproduce root>).
    """
    from poslsh_cli.app import report

    if readme is not None and publish is None:
        fail("report", "--readme goes with --publish DIR")
        return
    from poslsh_cli.app.publish import publish as publish_runs

    def notice(text: str) -> None:
        sys.stderr.write(f"poslsh report: {text}\n")

    def progress(text: str) -> None:  # each run read and each run's figures drawn: never long silent
        sys.stderr.write(f"poslsh report: {text}\n")
        sys.stderr.flush()

    target = publish or out
    try:
        if publish is not None:
            written = list(publish_runs(run_dirs, publish, readme, notice=notice, progress=progress).values())
        else:
            target = out or _common_parent(find_runs(run_dirs))
            if target.exists() and not target.is_dir():
                raise ConfigError(f"-o {target} is a file: -o names the folder that report.md and report.html go to")
            written = list(report.build(run_dirs, target, notice=notice, progress=progress))
    except ConfigError as exc:
        fail("report", str(exc))
        return
    except OSError as exc:
        what = "publish" if publish is not None else "write the report"
        fail("report", f"cannot {what} ({exc.strerror or type(exc).__name__}: {exc.filename or target})")
        return
    for path in written:
        typer.echo(str(path))


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
    from poslsh_cli.app.sweep import collect

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
                  launcher: str = typer.Option("local", help="local (presets here, --jobs at a time), joblib (presets "
                                               "in parallel here) or slurm (each preset a SLURM job)"),
                  jobs: Optional[int] = typer.Option(None, help="presets at once (local: default 1, each with its "
                                                     "share of the cores and its log in <runs>/<scale>/logs/; "
                                                     "joblib: default the cores)"),
                  with_: list[str] = typer.Option([], "--with", help="opt-in presets to run as well: train_long, "
                                                  "perplexity_long (the long-context CPU runs); train_confirm_l1024, "
                                                  "train_stability_l1024, perplexity_confirm_l1024, passkey_confirm_l1024 "
                                                  "(the registered experiment at L = 1024); the pilots; or all"),
                  only: list[str] = typer.Option([], "--only", help="run only these presets (run names, e.g. "
                                                 "train_official) or every preset of these commands (e.g. train, "
                                                 "perplexity, passkey, eval); the report covers every run of the "
                                                 "root")) -> None:
    """Every experiment of the paper at one scale, then plots and the report (resumable)."""
    for value, kind in ((scale, registry.Scale), (launcher, Launcher)):
        if value not in {m.value for m in kind}:
            fail("reproduce", f"--{kind.__name__.lower()} must be {' or '.join(m.value for m in kind)}, got {value!r}")
    if launcher != Launcher.LOCAL.value:
        try:
            check_launcher(launcher, multirun=True)
        except ConfigError as exc:
            fail("reproduce", str(exc))
    if jobs is not None and jobs < 1:
        fail("reproduce", f"--jobs must be at least 1, got {jobs}")

    try:
        include = check_with(with_)
        chosen = check_only(only, scale) if only else None
    except ConfigError as exc:
        fail("reproduce", str(exc))
    raise SystemExit(reproduce_main(scale, runs, launcher, jobs, include, chosen))


@app.command("generate")
@_helped
def generate_cmd(checkpoint: Path = typer.Argument(..., help="a checkpoint directory (poslsh train's final/, or "
                                                   "any causal LM)", show_default=False),
                 settings: List[str] = typer.Argument(None, help="key=value: prompt (text to continue), "
                                                      "max_new_tokens (64), attention (own, or a scheme swapped "
                                                      "in: alibi, poslsh, windowed, fixed_block, none), s (masks "
                                                      "per head for poslsh; 0: the checkpoint's own, else 8), seed, "
                                                      "sampler (how poslsh masks are drawn: iid, stratified, "
                                                      "sobol; own: the checkpoint's), "
                                                      "do_sample (false: greedy), temperature, top_k, cache (true: "
                                                      "decode through the key/value cache)",
                                                      show_default=False)) -> None:
    """Continue a prompt with a checkpoint under its own position scheme or another one (transformers'
    generate; the text on stdout as it comes, tokens and speed on stderr). A RoPE model stops at its
    max_position_embeddings; the other schemes have no position limit and extrapolate past the
    length the model was trained at (a line on stderr says so)."""
    import contextlib

    loading = contextlib.ExitStack()  # a spinner on a terminal until the first line or text

    def stream(text: str) -> None:
        loading.close()
        sys.stdout.write(text)
        sys.stdout.flush()

    def notice(text: str) -> None:
        loading.close()
        sys.stderr.write(f"poslsh generate: {text}\n")
        sys.stderr.flush()

    try:
        opts = parse(list(settings or []))
        with loading:
            loading.enter_context(waiting(f"poslsh generate: loading {checkpoint} ..."))
            out = generate(checkpoint, **opts, stream=stream, notice=notice, memory_bytes=available_memory("cpu"))
    except ConfigError as exc:
        fail("generate", str(exc))
        return
    typer.echo("")
    sys.stderr.write(f"poslsh generate: {out.new_tokens} new tokens in {out.seconds:.2f} s "
                     f"({out.tokens_per_s:.1f} tokens/s), {out.scheme}, attention path "
                     f"{', '.join(out.paths) or 'the model own'}, cache {'on' if opts['cache'] else 'off'}\n")


@app.command("plot")
@_helped
def plot_cmd(run_dirs: List[Path] = typer.Argument(..., help="run directories (a multirun root works too)",
                                                   show_default=False)) -> None:
    """Draw the figures of finished (or partial) runs into each run's figures/ (PNG and PDF)."""
    from poslsh_cli.app.report import plot_run

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


@app.command("claims")
@_helped
def claims_cmd(command: Optional[str] = typer.Argument(None, help="one command's claims (e.g. bench)",
                                                       show_default=False)) -> None:
    """List the claims the commands judge: id, role, metric, the sides compared, the sentence and the rule."""
    known = registry.experiments()
    if command is not None and command not in known:
        fail("claims", f"no command {command!r}; the commands: {', '.join(sorted(known))}")
    typer.echo(listing(list(CLAIMS.values()) if command is None else claims_of(command)))


class _ClosedOk:
    """stdout that survives its reader going away (``poslsh ... | head``): once a write finds the pipe
    closed, the rest of the output goes nowhere and the command carries on to its end (a run keeps
    writing its results to disk) and exits with its own status, with no traceback."""

    def __init__(self, stream):  # noqa: ANN001
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._close()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._close()

    def _close(self) -> None:
        import os

        devnull = open(os.devnull, "w")
        try:
            os.dup2(devnull.fileno(), self._stream.fileno())  # the interpreter's own flush at exit is quiet too
        except (OSError, ValueError):
            pass
        self._stream = devnull

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._stream, name)


def run() -> None:
    """Console-script entry point."""
    terminate_as_interrupt()
    sys.stdout = _ClosedOk(sys.stdout)
    app()


if __name__ == "__main__":  # pragma: no cover
    run()


__all__ = ["app", "run", "launch", "fail"]
