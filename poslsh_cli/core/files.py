"""Files that are never seen half-written: atomic writes, directories renamed into place with a
manifest, and the fault-injection points the tests kill a run at.

Every file a run writes is either appended line by line (metrics logs, which drop a cut last line
when read) or written whole into a temporary name and renamed over the target, so a reader (or a
run killed mid-write and started again) sees the old version or the new one, never a part.
Temporary names start with :data:`TMP_PREFIX`, so the owner of a run directory can remove what a
killed session left behind (:func:`remove_stale_temporaries`).

A directory that must be whole (a training checkpoint, a final model) is filled under a temporary
name, gets ``manifest.json`` (every file's size and SHA-256) written *last*, and is then renamed
into place (:func:`write_dir`). :func:`verify_dir` checks a directory against its manifest: a
directory cut, truncated or altered after the fact is recognised before anything is loaded from it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Callable, Optional

#: Temporary files and directories start with this prefix (and are hidden).
TMP_PREFIX = ".tmp-"
#: An older directory that :func:`write_dir` moved aside while replacing it (put back if need be).
OLD_PREFIX = ".old-"
MANIFEST = "manifest.json"
#: Environment variable naming a fault-injection point (see :func:`fault_point`).
FAULT_ENV = "POSLSH_FAULT"
#: The signal a fault point sends (KILL, TERM or INT; default KILL), or RAISE: an exception.
FAULT_SIGNAL_ENV = "POSLSH_FAULT_SIGNAL"
#: Only the process of this rank (``$RANK`` of a distributed run) fires the fault point.
FAULT_RANK_ENV = "POSLSH_FAULT_RANK"
#: Environment variable naming a file: a fault point writes it and waits until it is removed.
FAULT_HOLD_ENV = "POSLSH_FAULT_HOLD"
#: How long a held fault point waits for its file to go before it gives up (seconds).
FAULT_HOLD_LIMIT = 600.0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: readers see the old file
    or the new one, never a part. The file gets the usual mode (0666 less the umask), not the
    0600 of a temporary file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            fault_point(f"write:{path.name}")
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def _listing(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path) -> None:
    """``root/manifest.json``: size and SHA-256 of every other file below ``root``."""
    files = {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in _listing(root)}
    atomic_write_text(root / MANIFEST, json.dumps({"files": files}, indent=1) + "\n")


def verify_dir(root: Path) -> Optional[str]:
    """Why ``root`` is not a complete directory written by :func:`write_dir`, or None when every
    file has the size and hash its manifest records (and no file is missing)."""
    root = Path(root)
    try:
        files = json.loads((root / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"{root / MANIFEST} is missing (the directory was not completely written)"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{root / MANIFEST} is unreadable"
    for name, rec in files.items():
        p = root / name
        if not p.is_file():
            return f"{p} is missing"
        size = p.stat().st_size
        if size != rec["size"]:
            return f"{p} has {size} bytes, its manifest says {rec['size']}"
        if sha256_file(p) != rec["sha256"]:
            return f"{p} does not match the SHA-256 in its manifest"
    return None


def write_dir(target: Path, fill: Callable[[Path], None]) -> Path:
    """Create the directory ``target`` whole: ``fill(tmp)`` writes its files into a temporary
    sibling, the manifest is written last, then the directory is renamed into place. An older
    ``target`` is first renamed aside (to ``.old-<name>``), then the new one takes its place, then
    the old one is deleted: a kill at any moment leaves the old ``target``, the new one, or the
    old one aside, which :func:`restore_replaced` (run by the directory's owner on start, and here)
    puts back."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _restore(target.parent / f"{OLD_PREFIX}{target.name}")
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}.", dir=target.parent))
    aside = None
    try:
        fill(tmp)
        fault_point(f"dir:{target.name}")
        _usual_modes(tmp)
        write_manifest(tmp)
        os.chmod(tmp, 0o777 & ~_umask())
        fault_point(f"rename:{target.name}")
        if target.exists():
            aside = target.parent / f"{OLD_PREFIX}{target.name}"
            os.replace(target, aside)
            fault_point(f"replace:{target.name}")
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and aside.exists() and not target.exists():
            os.replace(aside, target)  # the new one never got its place: the old one goes back
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return target


def _usual_modes(root: Path) -> None:
    """Every file and folder below ``root`` gets the mode the umask gives a new one (0644 and 0755
    under the usual 022): what ``fill`` wrote may come from a library that writes its files 0600
    (safetensors' ``model.safetensors``), which would hide a model from the others who share it."""
    mask = _umask()
    for p in root.rglob("*"):
        if p.is_symlink():
            continue
        executable = p.is_dir() or p.stat().st_mode & 0o111
        os.chmod(p, (0o777 if executable else 0o666) & ~mask)


def _restore(aside: Path) -> None:
    """``.old-<name>``, an older directory :func:`write_dir` moved aside: deleted when ``<name>``
    (the new one) is in place, renamed back to ``<name>`` when it is not."""
    if not aside.is_dir():
        return
    target = aside.parent / aside.name[len(OLD_PREFIX):]
    if target.exists():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(aside, target)


def restore_replaced(root: Path) -> int:
    """Put back, or delete when superseded, every older directory that a killed :func:`write_dir`
    left aside below ``root`` (call only as the directory's owner); returns how many."""
    root = Path(root)
    if not root.is_dir():
        return 0
    found = sorted((p for p in root.rglob(f"{OLD_PREFIX}*") if p.is_dir()), key=lambda p: len(p.parts))
    for p in found:
        _restore(p)
    return len(found)


def remove_stale_temporaries(root: Path) -> int:
    """Remove temporary files and directories a killed session left below ``root``, after putting
    back any directory a killed :func:`write_dir` had moved aside (call only as the directory's
    owner); returns how many temporaries."""
    root = Path(root)
    if not root.is_dir():
        return 0
    restore_replaced(root)
    found = sorted(root.rglob(f"{TMP_PREFIX}*"), key=lambda p: len(p.parts))
    removed = 0
    for p in found:
        if not p.exists() and not p.is_symlink():
            continue  # inside a directory removed a moment ago
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed += 1
    return removed


def fault_point(name: str) -> None:
    """Fault injection for the tests: when ``$POSLSH_FAULT`` names this point, the process sends
    itself a signal right here: SIGKILL by default (a power cut, the kernel's OOM killer), or the
    one ``$POSLSH_FAULT_SIGNAL`` names (``TERM``: a cancelled or preempted job; ``INT``: Ctrl-C), or
    raises RuntimeError (``RAISE``: a bug or an out-of-memory error). ``$POSLSH_FAULT_RANK=r``: only
    rank r of a distributed run fires.

    ``$POSLSH_FAULT_HOLD=FILE``: the process first writes its pid to FILE and waits at the point
    until FILE is removed (then does what ``$POSLSH_FAULT_SIGNAL`` says; nothing when it is unset),
    so a test acts while the process is known to be here (sends a signal from outside, starts a
    second process) instead of guessing how long to wait.

    ``POSLSH_FAULT=name`` fires at the first pass, ``name@k`` at the k-th. Points: ``write:<file>``
    (an atomic write, before its rename), ``dir:<name>`` and ``rename:<name>`` (a checkpoint or
    final model filled but without its manifest, or complete but not yet renamed), ``replace:<name>``
    (an older directory of that name moved aside, the new one not yet in its place), ``step:<t>``
    (after training step t is logged), ``cell`` (after a cell's file, before results.csv).
    """
    want = os.environ.get(FAULT_ENV)
    if not want:
        return
    point, _, nth = want.partition("@")
    if point != name:
        return
    only = os.environ.get(FAULT_RANK_ENV)
    if only is not None and os.environ.get("RANK", "0") != only:
        return
    count = _FAULT_COUNTS[name] = _FAULT_COUNTS.get(name, 0) + 1
    if count != int(nth or 1):
        return
    hold = os.environ.get(FAULT_HOLD_ENV)
    if hold:
        _hold(Path(hold), name)
    what = os.environ.get(FAULT_SIGNAL_ENV, "" if hold else "KILL").upper()
    if not what:
        return
    if what == "RAISE":
        raise RuntimeError(f"fault injected at {name}")
    sig = getattr(signal, "SIG" + what)
    if signal.getsignal(sig) is signal.SIG_IGN:
        # a process started in the background by a non-interactive shell inherits an ignored
        # SIGINT: the signal would do nothing and the run would carry on as if never interrupted
        raise RuntimeError(f"fault point {name}: SIG{what} is ignored in this process (inherited from the "
                           "process that started it), so sending it would do nothing")
    # the Python-level handler of TERM / INT (KeyboardInterrupt) runs as this call returns
    os.kill(os.getpid(), sig)


def _hold(path: Path, name: str) -> None:
    """Write this pid to ``path`` and wait until ``path`` is removed; a signal sent meanwhile is
    handled here, at the fault point."""
    import time

    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, path)  # whole when the test sees it
    deadline = time.monotonic() + FAULT_HOLD_LIMIT
    while path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"fault point {name}: held for {FAULT_HOLD_LIMIT:.0f} s and nobody removed {path}")
        time.sleep(0.01)


_FAULT_COUNTS: dict[str, int] = {}
