"""Run every experiment of the paper at one scale, then the plots and the report.

The list is the registry's: for every experiment, each of its presets in order, run as
``poslsh <command> experiment=<preset>_<scale> out=<root>/<scale>/<preset>`` in a child process,
so a fixed run directory resumes after an interruption. The local launcher runs ``jobs`` presets at
a time (default 1); with more than one, each child gets an equal share of the cores
(``OMP_NUM_THREADS``, unless set) and writes its output to ``<root>/<scale>/logs/<preset>.log``, and
a preset that fails has the end of its log printed. With ``launcher=joblib`` or ``slurm`` each
preset is a one-job Hydra multirun on that launcher (``out/0``), the presets run at the same
time (joblib: at most ``jobs`` at once; slurm: as the queue allows), in two waves: experiments
that evaluate others' results (``reproduce_overrides``, e.g. perplexity) after the rest. A preset that cannot run here (its
experiment's ``skip_reason``: no checkpoint, a large model without a GPU) is skipped, and the
reason is kept in its run directory (``skipped.json``) so any later report says so. Opt-in presets
(an experiment's ``opt_in``: the long-context CPU runs) run at the paper scale only when named with
``--with NAME`` (``--with all`` for every one); otherwise they are skipped the same way, with that
reason. The quick scale runs them always (its smoke test covers every preset). ``--only`` runs
some presets (by name, or every preset of a command); the report covers every run of the root.
"""
from __future__ import annotations

import enum
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from poslsh_cli.app import registry
from poslsh_cli.app.runner import INTERRUPTED, TERMINATED, stopped_code
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.core.files import atomic_write_text
from poslsh_cli.store import ownership


class Launcher(str, enum.Enum):
    """Where ``reproduce`` runs its presets."""

    LOCAL = "local"  # one after another, here
    JOBLIB = "joblib"  # in parallel, here
    SLURM = "slurm"  # each a SLURM job


def plan(scale: str) -> list[tuple[str, str, str]]:
    """(run name, command, preset) for every preset of every experiment, in report order."""
    return [(stem, exp.name, f"{stem}_{scale}") for exp in registry.experiments().values() for stem in exp.presets
            if f"{stem}_{scale}" in registry.preset_names(exp)]


def reads(command: str, preset: str) -> tuple[str, ...]:
    """The run names a preset evaluates (its ``checkpoints`` relative to the reproduce root: the
    training presets it waits for), none for a preset that trains or measures on its own."""
    exp = registry.get(command)
    if exp.reproduce_overrides is None:
        return ()
    try:
        spec = registry.compose_spec(exp, [f"experiment={preset}"])
    except ConfigError:
        return ()
    return tuple(str(c) for c in getattr(spec, "checkpoints", ()) if not Path(str(c)).is_absolute())


def schedule(entries: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The presets in the order they run: every preset that trains or measures on its own in plan
    order, each evaluation preset right after the last of the runs it reads (so the paper's
    comparison, train_official and perplexity_official, is reported before the other trainings
    start); an evaluation preset waits for those runs when presets run side by side."""
    order = [e for e in entries if registry.get(e[1]).reproduce_overrides is None]
    placed: set = set()
    for e in (e for e in entries if registry.get(e[1]).reproduce_overrides is not None):
        deps = reads(e[1], e[2])
        at = max((i for i, x in enumerate(order) if x[0] in deps), default=len(order) - 1)
        while at + 1 < len(order) and order[at + 1] in placed:  # after the evaluations placed there before it
            at += 1
        order.insert(at + 1, e)
        placed.add(e)
    return order


def opt_in() -> list[str]:
    """The presets (run names) reproduce runs only when named with ``--with``."""
    return [stem for exp in registry.experiments().values() for stem in exp.opt_in]


def check_with(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``--with`` values: opt-in preset names or ``all``; anything else is an error."""
    known = opt_in()
    for n in names:
        if n != "all" and n not in known:
            raise ConfigError(f"--with must be one of {', '.join(known)} or all, got {n!r}")
    return tuple(known) if "all" in names else tuple(names)


def check_only(names: list[str] | tuple[str, ...], scale: str) -> tuple[str, ...]:
    """``--only`` values: preset run names (``train_official``) or commands (``perplexity``: all of
    its presets); anything else is an error. Returned as run names, in plan order."""
    entries = plan(scale)
    known_runs, known_commands = [e[0] for e in entries], sorted({e[1] for e in entries})
    for n in names:
        if n not in known_runs and n not in known_commands:
            raise ConfigError(f"--only takes a preset ({', '.join(known_runs)}) or a command "
                              f"({', '.join(known_commands)}), got {n!r}")
    return tuple(run for run, command, _ in entries if run in names or command in names)


def not_asked(name: str, preset: str, include: tuple[str, ...]) -> str | None:
    """Why reproduce leaves the preset ``name`` out: at the paper scale, an opt-in preset not named
    with ``--with``."""
    if preset.endswith("_paper") and name in opt_in() and name not in include:
        return f"an opt-in preset: poslsh reproduce --with {name} (make reproduce-all WITH={name}) runs it"
    return None


def overrides(command: str, preset: str, root: Path) -> list[str]:
    """What reproduce passes for a preset: the preset and the experiment's own extra overrides."""
    exp = registry.get(command)
    extra = []
    if exp.reproduce_overrides is not None:
        extra = exp.reproduce_overrides(root, registry.compose_spec(exp, [f"experiment={preset}"]))
    return [f"experiment={preset}", *extra]


def skip_reason(command: str, preset: str, root: Path = Path(".")) -> str | None:
    """Why a preset cannot run on this machine (from its composed spec), or None."""
    exp = registry.get(command)
    if exp.skip_reason is None:
        return None
    try:
        return exp.skip_reason(registry.compose_spec(exp, overrides(command, preset, root)))
    except ConfigError as exc:
        return f"the preset does not compose: {exc}"


def _mark_skipped(out: Path, name: str, command: str, preset: str, reason: str) -> None:
    """Keep the reason in the experiment's own directory, so any report over it says so."""
    if (out / "config.yaml").exists():
        return  # a run was made there before: its results stand
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "skipped.json", json.dumps({"name": name, "command": command, "preset": preset,
                                                        "reason": reason}, indent=1) + "\n")


def _record_session(root: Path, scale: str, started: str, seconds: float, ran: int, failed: list[str]) -> None:
    path = root / "reproduce.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        rec = {"scale": scale, "sessions": []}
    rec["sessions"].append({"started": started, "seconds": round(seconds, 1), "ran": ran, "failed": failed})
    atomic_write_text(path, json.dumps(rec, indent=1) + "\n")


def main(scale: str, root: Path, launcher: str = "local", jobs: int | None = None,
         include: tuple[str, ...] = (), only: tuple[str, ...] | None = None) -> int:

    root = Path(root) / scale
    try:  # one reproduce at a time per root; each preset's run directory has its own owner
        ownership.acquire(root, f"poslsh reproduce --scale {scale}", what="--runs")
    except ConfigError as exc:
        print(f"poslsh reproduce: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _main(scale, root, launcher, jobs, include, only)
    finally:
        ownership.release(root)


def _main(scale: str, root: Path, launcher: str, jobs: int | None, include: tuple[str, ...] = (),
          only: tuple[str, ...] | None = None) -> int:
    import datetime as _dt
    import os

    failed, done = [], []
    started = _dt.datetime.now().isoformat(timespec="seconds")
    t0 = time.time()
    if launcher == "local":
        limit = jobs or 1
    else:
        limit = (jobs or (os.cpu_count() or 1)) if launcher == "joblib" else 10**6
    entries = schedule([e for e in plan(scale) if only is None or e[0] in only])
    try:
        _run_wave(entries, root, launcher, limit, done, failed, include)
    except KeyboardInterrupt as exc:
        _record_session(root, scale, started, time.time() - t0, len(done), failed + ["(interrupted)"])
        print(f"interrupted; run the same command again to resume ({root})", file=sys.stderr)
        return stopped_code(exc)
    _record_session(root, scale, started, time.time() - t0, len(done), failed)
    if done and _REPORTED.get(root) != len(done):  # unless the last preset's report already covers them all
        _report(root)
    return 1 if failed else 0


#: reproduce root -> how many presets had finished when its report was last written (by this process)
_REPORTED: dict[Path, int] = {}


def _report(root: Path, finished: int | None = None) -> None:
    """The report of every run under ``root`` so far (report.md, report.html), said where it is; a
    line before it starts and one per run read, since reading every run and drawing its figures takes
    minutes at the paper scale."""
    from poslsh_cli.app import report

    print(f"report: reading the runs under {root} and drawing their figures", flush=True)
    md, html_path = report.build([root], root, progress=lambda text: print(f"report: {text}", flush=True))
    print(f"report: {md}\n        {html_path}", flush=True)
    if finished is not None:
        _REPORTED[root] = finished


def _spawn(cmd: list[str], log_path: Path | None, env: dict) -> subprocess.Popen:
    """A preset's child process: its output in ``log_path`` when presets run side by side (a resumed
    preset's log follows its interrupted attempt's), else on this terminal."""
    if log_path is None:
        return subprocess.Popen(cmd)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        if log.tell():
            log.write(f"\n== resumed {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            log.flush()
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _run_wave(wave: list[tuple[str, str, str]], root: Path, launcher: str, limit: int, done: list, failed: list,
              include: tuple[str, ...] = ()) -> None:
    """Run a wave's presets, at most ``limit`` at a time; a child that fails is recorded."""
    import os

    running: list[tuple[str, Path, subprocess.Popen]] = []
    evaluations = {name for name, command, _ in wave if registry.get(command).reproduce_overrides is not None}
    logs: dict[str, Path] = {}
    side_by_side = launcher == "local" and limit > 1
    env = dict(os.environ)
    if side_by_side:  # each child an equal share of the cores, so two children do not fight over them
        share = str(max(1, (os.cpu_count() or 1) // limit))
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, share)

    def reap(block: bool) -> None:
        while running and (block or any(p.poll() is not None for _, _, p in running)):
            for item in list(running):
                name, out, proc = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                if proc.returncode in (INTERRUPTED, TERMINATED):  # stopped by Ctrl-C or a kill: stop the rest
                    raise KeyboardInterrupt
                if proc.returncode != 0:
                    failed.append(name)
                    print(f"== FAILED {name} (exit {proc.returncode})"
                          + (f"; the end of {logs[name]}:" if name in logs else ""), flush=True)
                    if name in logs:
                        tail = logs[name].read_text(errors="replace").splitlines()[-15:]
                        print("\n".join(f"   {line}" for line in tail), flush=True)
                else:
                    done.append(out)
                    if name in logs:
                        print(f"== finished {name} (log: {logs[name]})", flush=True)
                    if name in evaluations:  # its claims are in the report now, not only at the end
                        try:
                            _report(root, len(done))
                        except Exception as exc:  # noqa: BLE001  (a report is rebuilt at the end; the runs go on)
                            print(f"== report not written yet: {type(exc).__name__}: {exc}", flush=True)
            if block and running:
                time.sleep(0.2)

    try:
        for name, command, preset in wave:
            out = root / name
            deps = set(reads(command, preset))
            while len(running) >= limit or any(n in deps for n, _, _ in running):
                reap(block=False)  # the previous child's output comes before this header; the runs it reads finish
                time.sleep(0.2)
            broken = sorted(deps & set(failed))  # an evaluation of a training that failed would read half its models
            reason = (f"it reads {', '.join(broken)}, which failed in this session" if broken else None) \
                or not_asked(name, preset, include) or skip_reason(command, preset, root)
            if reason:
                _mark_skipped(out, name, command, preset, reason)
                print(f"== skipped {name}: {reason}", flush=True)
                continue
            (out / "skipped.json").unlink(missing_ok=True)
            extra = [] if launcher == "local" else ["-m", f"hydra/launcher={launcher}"]
            args = [command, *extra, *overrides(command, preset, root), f"out={out}"]
            print(f"== {name}: poslsh {' '.join(args)}", flush=True)
            cmd = [sys.executable, "-m", "poslsh_cli", *args]
            if side_by_side:
                logs[name] = root / "logs" / f"{name}.log"
            running.append((name, out, _spawn(cmd, logs.get(name), env)))
        while running:
            reap(block=True)
    except KeyboardInterrupt:
        # Ctrl-C reached the children too; SIGTERM covers a kill aimed at this process only.
        # Either way each child keeps its finished cells and marks its run interrupted.
        for _, _, proc in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, _, proc in running:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
