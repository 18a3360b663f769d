"""Run directories that nothing can corrupt: a fault-injection suite.

Each case kills a real ``poslsh`` process with SIGKILL at a chosen point (``$POSLSH_FAULT``, see
:func:`poslsh_cli.core.files.fault_point`), or runs two processes on one directory, or corrupts a file
on disk, then runs the same command again and compares the directory with an uninterrupted run:
the final weights bit for bit, the metrics log step by step (no step twice), and every metric
column of results.csv. Bad input must give one line, exit 2, and leave nothing behind.

No case waits for a time: a case that acts while a process is at a given point (sends SIGTERM or
SIGINT from outside, starts a second process) holds that process at the point
(``$POSLSH_FAULT_HOLD``) and waits for the file the point writes.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import ENV, POSLSH, TINY, ctrl_c_as_in_a_terminal, fault_env, poslsh_process

TRAIN = [*TINY, "seq_len=32", "batch=4", "eval_tokens=1024", "warmup=2", "position=[poslsh]", "s=[4]", "steps=10",
         "checkpoint_every=4", "eval_every=5"]
MATRIX = ["matrix-error", "n=[300,600]", "sigma=[4]", "s=[2,8]", "trials=2"]
TIMING = {"seconds", "tokens_per_s", "wall_seconds", "step_seconds", "peak_mem_mb"}
#: Exit code of a run stopped by the signal (128 + its number, the shell's convention)
STOPPED = {"TERM": 143, "INT": 130}


def start(*args, cwd=None, fault=None, hold=None):
    return subprocess.Popen([*POSLSH, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=fault_env(fault, hold=hold), cwd=cwd, preexec_fn=ctrl_c_as_in_a_terminal)


def held(proc, hold, timeout=600):
    """Wait until ``proc`` stands at its fault point (it has written ``hold``); fail with its output
    if it ended first."""
    deadline = time.monotonic() + timeout
    while not hold.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended (code {proc.returncode}) before its fault point: {err[-2000:]}")
        assert time.monotonic() < deadline, f"no fault point reached in {timeout} s"
        time.sleep(0.01)


def interrupt(*args, fault, sig, hold):
    """Run ``poslsh *args`` until it stands at ``fault``, send it SIG``sig`` from outside (a cancelled
    job, Ctrl-C), and return what it did as a CompletedProcess."""
    import signal as signals

    proc = start(*args, fault=fault, hold=hold)
    held(proc, hold)
    proc.send_signal(getattr(signals, f"SIG{sig}"))
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line(stderr):
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    return len(lines) == 1 and "Traceback" not in stderr


def one_error(stderr):
    """One error line (notices about what was found may precede it), no traceback."""
    return sum(": error: " in x for x in stderr.splitlines()) == 1 and "Traceback" not in stderr


def metrics_of(run):
    return pd.read_csv(next((Path(run) / "work").glob("*/metrics.csv")))


def weights_of(run):
    from safetensors.torch import load_file

    return load_file(next((Path(run) / "work").glob("*/final/model.safetensors")))


def assert_same_training(run, ref):
    """The run equals the uninterrupted reference: weights, log (each step once), results."""
    a, b = metrics_of(ref), metrics_of(run)
    assert list(b.step) == list(range(1, 11)), list(b.step)
    pd.testing.assert_frame_equal(a[["step", "loss", "val_loss", "lr"]], b[["step", "loss", "val_loss", "lr"]])
    wa, wb = weights_of(ref), weights_of(run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert_same_results(run, ref)


def assert_same_results(run, ref, key=None):
    ra, rb = pd.read_csv(Path(ref) / "results.csv"), pd.read_csv(Path(run) / "results.csv")
    cols = [c for c in ra.columns if c not in TIMING and c != "checkpoint"]
    if key:
        ra, rb = ra.sort_values(key).reset_index(drop=True), rb.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(ra[cols], rb[cols])
    meta = json.loads((Path(run) / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["cells_done"] == meta["cells_total"]
    assert not list(Path(run).rglob(".tmp-*")), "temporary files left behind"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    r = poslsh_process("train", *TRAIN, f"out={root / 'train'}")
    assert r.returncode == 0, r.stderr
    r = poslsh_process(*MATRIX, f"out={root / 'matrix'}")
    assert r.returncode == 0, r.stderr
    return root


def SLOW(*values):
    """A case run by the slow tier only (make test-all, CI): the fast tier keeps one of each kind."""
    return pytest.param(*values, marks=pytest.mark.slow)


# ---------------------------------------------------------------------------------------------
# SIGKILL at chosen points, then the same command


@pytest.mark.parametrize("fault", [
    "step:3",                      # before the first checkpoint: the log restarts from scratch
    SLOW("step:6"),                # after the step-4 checkpoint: steps 5, 6 are recomputed once
    SLOW("dir:step-00000008"),     # a checkpoint whose files are written but not its manifest
    SLOW("rename:step-00000008"),  # a complete checkpoint not yet renamed into place
    SLOW("rename:final"),          # the final model complete, not yet renamed
    SLOW("write:results.csv"),     # results.csv being rewritten
    SLOW("write:meta.json@3"),     # meta.json being rewritten
])
def test_killed_training_cell_resumes_to_the_uninterrupted_run(reference, tmp_path, fault):
    out = tmp_path / "run"
    r = poslsh_process("train", *TRAIN, f"out={out}", fault=fault)
    assert r.returncode == -9, (fault, r.returncode, r.stderr[-2000:])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "running"  # what a dead process leaves
    r = poslsh_process("train", *TRAIN, f"out={out}")
    assert r.returncode == 0, r.stderr
    assert_same_training(out, reference / "train")
    history = json.loads((out / "meta.json").read_text())["history"]
    assert history and history[-1]["status"] == "died"


@pytest.mark.parametrize("fault,sig", [
    ("step:3", "INT"),             # before the first checkpoint: only the metrics log is there
    SLOW("step:3", "TERM"),
    ("step:6", "TERM"),            # after the step-4 checkpoint
    SLOW("step:6", "INT"),
    *(SLOW(fault, sig) for fault in ("dir:step-00000008", "rename:step-00000008", "rename:final",
                                     "write:results.csv", "write:meta.json@3") for sig in ("TERM", "INT")),
])
def test_sigterm_and_ctrl_c_in_the_first_cell_keep_the_run(reference, tmp_path, fault, sig):
    """SIGTERM (a cancelled or preempted job) or SIGINT at each kill point of a run's first and only
    cell: exit 143 after SIGTERM and 130 after Ctrl-C (128 + the signal), nothing deleted that holds work, and the same command resumes to the
    uninterrupted run (resumed after SIGTERM only: SIGINT reaches the same handler, so after it the
    test checks what is kept: the metrics log, and every checkpoint written before the signal)."""
    out = tmp_path / "run"
    r = interrupt("train", *TRAIN, f"out={out}", fault=fault, sig=sig, hold=tmp_path / "held")
    assert r.returncode == STOPPED[sig], (fault, sig, r.returncode, r.stderr[-2000:])
    assert out.is_dir() and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"kept in {out}" in r.stderr and "removed" not in r.stderr, r.stderr[-2000:]
    assert json.loads((out / "meta.json").read_text())["status"] in ("interrupted", "complete")
    assert not list(out.rglob(".tmp-*")), "temporaries left behind"
    if sig == "INT":
        finished = list((out / "cells").glob("*.json"))
        assert finished or list(out.glob("work/*/metrics.csv")), sorted(map(str, out.rglob("*")))
        if fault != "step:3":  # the step-4 checkpoint was written before the signal
            assert finished or list(out.glob("work/*/checkpoints/step-00000004")), sorted(map(str, out.rglob("*")))
        return
    r = poslsh_process("train", *TRAIN, f"out={out}")
    assert r.returncode == 0, r.stderr
    assert_same_training(out, reference / "train")


def test_ctrl_c_reaches_a_run_whose_parent_ignored_it(reference, tmp_path):
    """A test session started in the background by a non-interactive shell (``make test &``) has
    SIGINT ignored: the harness gives its children SIGINT back (Ctrl-C stops the run), and a fault
    point asked to send an ignored signal says so instead of letting the run finish as if never
    interrupted."""
    import signal as signals

    before = signals.signal(signals.SIGINT, signals.SIG_IGN)
    try:
        r = interrupt("train", *TRAIN, f"out={tmp_path / 'run'}", fault="step:3", sig="INT", hold=tmp_path / "held")
        assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
        r = subprocess.run([sys.executable, "-m", "poslsh_cli", "train", *TRAIN, f"out={tmp_path / 'b'}"],
                           capture_output=True, text=True, env=fault_env("step:3", "INT"))  # SIGINT stays ignored
    finally:
        signals.signal(signals.SIGINT, before)
    assert r.returncode == 1 and "SIGINT is ignored in this process" in r.stderr, (r.returncode, r.stderr[-2000:])


def test_an_interrupt_before_any_work_removes_only_what_it_created(tmp_path):
    """Interrupted while the run directory is set up (nothing computed yet): nothing is left."""
    out = tmp_path / "a" / "run"
    r = interrupt("train", *TRAIN, f"out={out}", fault="write:meta.json", sig="TERM", hold=tmp_path / "held")
    assert r.returncode == 143 and "before anything was computed" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("sig", ["TERM", SLOW("INT")])
def test_sigterm_in_a_sweep_keeps_its_finished_cells(reference, tmp_path, sig):
    out = tmp_path / "m"
    r = interrupt(*MATRIX, f"out={out}", fault="cell@2", sig=sig, hold=tmp_path / "held")
    assert r.returncode == STOPPED[sig] and "2/8 cells finished" in r.stderr, r.stderr[-2000:]
    r = poslsh_process(*MATRIX, f"out={out}")
    assert r.returncode == 0 and "resuming" in r.stderr, r.stderr
    assert_same_results(out, reference / "matrix")


# write:results.csv@2 is the final rewrite: while cells finish the tables are rewritten at most every
# few seconds (runner._Tables), after the first cell and then at the end of this quick sweep
@pytest.mark.parametrize("fault", ["cell@2", SLOW("write:results.csv@2"), SLOW("write:meta.json@4")])
def test_killed_matrix_sweep_resumes_to_the_uninterrupted_run(reference, tmp_path, fault):
    out = tmp_path / "m"
    r = poslsh_process(*MATRIX, f"out={out}", fault=fault)
    assert r.returncode == -9, r.stderr
    r = poslsh_process(*MATRIX, f"out={out}")
    assert r.returncode == 0 and "resuming" in r.stderr, r.stderr
    assert_same_results(out, reference / "matrix")


@pytest.mark.slow
def test_killed_perplexity_run_resumes(reference, tmp_path):
    args = ["perplexity", reference / "train", "lengths=[32,64]", "attention=[own,alibi]", "max_tokens=512"]
    ref = tmp_path / "ref"
    assert poslsh_process(*args, f"out={ref}").returncode == 0
    r = poslsh_process(*args, f"out={tmp_path / 'p'}", fault="cell@2")
    assert r.returncode == -9
    r = poslsh_process(*args, f"out={tmp_path / 'p'}")
    assert r.returncode == 0, r.stderr
    assert_same_results(tmp_path / "p", ref)


# ---------------------------------------------------------------------------------------------
# two processes on one run directory


@pytest.mark.slow
@pytest.mark.parametrize("when", ["together", "while the first trains"])
def test_two_processes_on_one_run_directory(reference, tmp_path, when):
    """One runs, the other exits 2 with one line naming the holder and touches nothing; the
    directory ends equal to an uninterrupted run. Started together, either may win; started while
    the first stands at training step 3, the first is the holder."""
    out, hold = tmp_path / "run", tmp_path / "held"
    a = start("train", *TRAIN, f"out={out}", **({"fault": "step:3", "hold": hold} if when != "together" else {}))
    if when != "together":
        held(a, hold)
    b = start("train", *TRAIN, f"out={out}")
    rb = b.communicate(timeout=600)
    hold.unlink(missing_ok=True)  # the first goes on
    ra = a.communicate(timeout=600)
    codes = sorted([a.returncode, b.returncode])
    assert codes == [0, 2], (codes, ra[1][-1500:], rb[1][-1500:])
    if when != "together":
        assert b.returncode == 2
    loser = ra if a.returncode == 2 else rb
    assert one_line(loser[1]) and "is in use by pid" in loser[1], loser[1]
    assert_same_training(out, reference / "train")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sessions"] == 1 and meta["history"] == []


def test_a_second_sweep_on_one_directory_is_refused(tmp_path):
    """The second sweep starts while the first stands after its first cell (held there)."""
    out, hold = tmp_path / "sweep", tmp_path / "held"
    a = start("matrix-error", "-m", "n=3000,6000", "sigma=[4]", "s=[2,4,8,16]", "trials=3", f"out={out}",
              fault="cell", hold=hold)
    held(a, hold)
    r = poslsh_process("matrix-error", "-m", "n=3000,6000", "sigma=[4]", "s=[2,4,8,16]", "trials=3", f"out={out}")
    hold.unlink()
    a.communicate(timeout=600)
    assert a.returncode == 0
    assert r.returncode == 2 and one_line(r.stderr) and "in use by" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------
# corrupt files: a rebuild or one line, never a traceback, never a wrong number


def copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def test_cut_results_csv_is_read_from_the_cells_and_rewritten_by_its_owner(reference, tmp_path):
    """Readers (plot, report) read a cut or stale results.csv from the cells and write nothing (only
    the owner writes); the same command rewrites it."""
    run = copy_run(reference / "train", tmp_path / "run")
    good = (run / "results.csv").read_text()
    cut = good[: len(good) - 40]
    (run / "results.csv").write_text(cut)  # cut mid-line
    r = poslsh_process("plot", run)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "results.csv is cut mid-line; read from its 1 cell in" in r.stderr
    assert (run / "results.csv").read_text() == cut  # the reader wrote nothing
    (run / "results.csv").write_text(good.splitlines()[0] + "\n")  # rows lost
    r = poslsh_process("report", run)
    assert r.returncode == 0 and "read from its 1 cell in" in r.stderr, r.stderr
    assert "read from its 1 cell in" in (run / "report.md").read_text()
    assert "0.0" in (run / "report.md").read_text()  # the report has the cell's numbers
    r = poslsh_process("train", *TRAIN, f"out={run}")  # the owner: every cell done, the tables rewritten
    assert r.returncode == 0, r.stderr
    assert (run / "results.csv").read_text() == good


def test_cut_cell_file_is_named_and_computed_again(reference, tmp_path):
    run = copy_run(reference / "matrix", tmp_path / "m")
    cell = sorted((run / "cells").glob("*.json"))[0]
    cell.write_text(cell.read_text()[:30])
    r = poslsh_process("report", run)
    assert r.returncode == 0 and f"{cell.name} is unreadable" in r.stderr, r.stderr
    # 8 cells, one unreadable: the report reads the 7 others (not a wrong row) and, being a reader,
    # leaves results.csv as the owner wrote it
    assert "read from its 7 cells" in r.stderr, r.stderr
    assert len(pd.read_csv(run / "results.csv")) == 8
    r = poslsh_process(*MATRIX, f"out={run}")
    assert r.returncode == 0 and "will be computed again" in r.stderr, r.stderr
    assert_same_results(run, reference / "matrix")


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(reference, tmp_path):
    out = tmp_path / "run"
    r = poslsh_process("train", *TRAIN, f"out={out}", fault="step:9")
    assert r.returncode == -9
    ckpts = sorted((out / "work").glob("*/checkpoints/step-*"))
    assert [p.name for p in ckpts] == ["step-00000004", "step-00000008"]
    weights = ckpts[-1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    r = poslsh_process("train", *TRAIN, f"out={out}")
    assert r.returncode == 0, r.stderr
    assert sum("is unusable" in line and "step-00000008" in line for line in r.stderr.splitlines()) == 1
    assert "resuming from step-00000004" in r.stderr
    assert_same_training(out, reference / "train")


@pytest.mark.slow
def test_no_usable_checkpoint_is_one_line_naming_the_file(tmp_path):
    out = tmp_path / "run"
    assert poslsh_process("train", *TRAIN, f"out={out}", fault="step:9").returncode == -9
    for ck in (out / "work").glob("*/checkpoints/step-*"):
        (ck / "model.safetensors").write_bytes(b"\0" * 10)
    r = poslsh_process("train", *TRAIN, f"out={out}")
    assert r.returncode == 2 and one_error(r.stderr) and "model.safetensors has 10 bytes" in r.stderr, r.stderr
    assert (out / "cells").is_dir()  # nothing was deleted


def test_empty_meta_json_is_named_and_the_run_still_reads(reference, tmp_path):
    run = copy_run(reference / "matrix", tmp_path / "m")
    (run / "meta.json").write_text("")
    r = poslsh_process("plot", run)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    r = poslsh_process("report", run)
    assert r.returncode == 0, r.stderr
    r = poslsh_process(*MATRIX, f"out={run}")
    assert r.returncode == 0 and "meta.json was unreadable" in r.stderr, r.stderr


def test_truncated_final_model_is_refused_by_perplexity_in_one_line(reference, tmp_path):
    run = copy_run(reference / "train", tmp_path / "run")
    w = next(run.glob("work/*/final/model.safetensors"))
    w.write_bytes(w.read_bytes()[:-8])
    r = poslsh_process("perplexity", run, "lengths=[32]", f"out={tmp_path / 'p'}")
    assert r.returncode == 2 and one_line(r.stderr) and "is corrupt" in r.stderr and "model.safetensors" in r.stderr
    assert not (tmp_path / "p").exists()


# ---------------------------------------------------------------------------------------------
# bad input: one line, exit 2, no directory (not even runs/<command>/)


@pytest.mark.parametrize("args,needle", [
    (["train", "data=/dev/null"], "is neither a regular file nor a folder"),
    (["train", "data=empty.txt"], "the text is empty"),
    (["train", "init=missing-checkpoint"], "does not exist"),
    (["perplexity", "missing-run"], "missing-run does not exist"),
    (["output-error", "n=100000"], "exceeds the model's 512 positions"),
    (["matrix-error", "n=1e12"], "this machine has"),
    (["matrix-error", "n=1e9", "s=[1]"], "memory_check=false runs it anyway"),
    (["bench", "n=[4194304]", "s=[64]", "heads=64"], "of memory"),
])
def test_bad_input_leaves_nothing_behind(tmp_path, args, needle):
    (tmp_path / "empty.txt").write_text("")
    r = poslsh_process(*args, cwd=tmp_path)
    assert r.returncode == 2 and one_line(r.stderr) and needle in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


@pytest.mark.slow
def test_collect_rebuilds_a_cut_job_table_and_names_a_dead_job(tmp_path):
    out = tmp_path / "sweep"
    r = poslsh_process("matrix-error", "-m", "n=300,600", "sigma=[4]", "s=[2,8]", "trials=1", f"out={out}")
    assert r.returncode == 0, r.stderr
    whole = pd.read_csv(out / "results.csv")
    table = out / "0" / "results.csv"
    table.write_text(table.read_text()[:-25])
    r = poslsh_process("collect", out)
    assert r.returncode == 0 and "cut mid-line; read from its 2 cells" in r.stderr, r.stderr
    pd.testing.assert_frame_equal(pd.read_csv(out / "results.csv"), whole)
    meta = json.loads((out / "1" / "meta.json").read_text())
    (out / "1" / "meta.json").write_text(json.dumps({**meta, "status": "running"}))  # its process was killed
    r = poslsh_process("collect", out)
    assert r.returncode == 1 and "job 1 (n=600 sigma=[4] s=[2,8] trials=1) died" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------
# the pieces: a directory replaced whole, the lock's one descriptor


def test_write_dir_killed_while_replacing_keeps_the_old_directory(tmp_path):
    """write_dir over an existing directory renames the old one aside, puts the new one in place,
    then deletes the old: killed in between, the owner's next start puts the old one back."""
    from poslsh_cli.core.files import remove_stale_temporaries, verify_dir, write_dir

    code = (f"import sys; from pathlib import Path; from poslsh_cli.core.files import write_dir\n"
            f"write_dir(Path({str(tmp_path / 'ck')!r}), lambda d: (d / 'w').write_text(sys.argv[1]))")
    env = {k: v for k, v in ENV.items() if k != "POSLSH_FAULT"}
    assert subprocess.run([sys.executable, "-c", code, "old"], env=env).returncode == 0
    r = subprocess.run([sys.executable, "-c", code, "new"], env={**env, "POSLSH_FAULT": "replace:ck"})
    assert r.returncode == -9
    assert not (tmp_path / "ck").exists() and (tmp_path / ".old-ck" / "w").read_text() == "old"
    remove_stale_temporaries(tmp_path)
    assert (tmp_path / "ck" / "w").read_text() == "old" and verify_dir(tmp_path / "ck") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    write_dir(tmp_path / "ck", lambda d: (d / "w").write_text("new"))  # and replacing works
    assert (tmp_path / "ck" / "w").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]

    def fail(d):
        raise RuntimeError("fill failed")

    with pytest.raises(RuntimeError):
        write_dir(tmp_path / "ck", fail)
    assert (tmp_path / "ck" / "w").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_the_owner_never_opens_its_lock_file_again(tmp_path, monkeypatch):
    """POSIX locks (what NFS offers across nodes) are dropped when the owning process closes any
    descriptor of the file: the owner asks who holds it through the lock's own descriptor, and
    another process still finds the directory in use afterwards."""
    from poslsh_cli.store import ownership

    run = tmp_path / "run"
    ownership.acquire(run, "test")
    try:
        lock = os.path.realpath(run / ownership.LOCK_NAME)
        opened = []
        real_open, real_os_open = open, os.open

        def spy_open(path, *a, **k):
            if os.path.realpath(str(path)) == lock:
                opened.append(path)
            return real_open(path, *a, **k)

        def spy_os_open(path, *a, **k):
            if os.path.realpath(str(path)) == lock:
                opened.append(path)
            return real_os_open(path, *a, **k)

        import io

        monkeypatch.setattr("builtins.open", spy_open)
        monkeypatch.setattr(io, "open", spy_open)
        monkeypatch.setattr(os, "open", spy_os_open)
        info = ownership.holder(run)
        ownership.check_free(run)
        monkeypatch.undo()
        assert opened == [] and info["pid"] == os.getpid()
        probe = ("import sys; from poslsh_cli.store import ownership\n"
                 f"try:\n    ownership.acquire({str(run)!r}, 'probe')\nexcept ownership.RunBusy:\n    sys.exit(3)")
        assert subprocess.run([sys.executable, "-c", probe], env=ENV).returncode == 3
    finally:
        ownership.release(run)
