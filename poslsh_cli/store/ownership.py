"""One owner per run directory: an exclusive lock held for the life of the run.

The owner holds an exclusive POSIX record lock (``fcntl.lockf``) on ``DIR/.lock`` and writes who it
is into that file (pid, host, command, since when). The kernel releases the lock when the process
ends, however it ends (SIGKILL, out of memory), so a dead owner never leaves a stale lock: the next
process simply takes it. A second process that finds the lock held touches nothing and refuses with one line naming the
holder (:class:`RunBusy`, exit 2). Readers (``report``, ``collect``, ``plot``) never lock; they
only ask whether a live owner exists (:func:`holder`) before repairing a table.

Locks are re-entrant within a process (a sweep's parent holds the sweep directory, a job of the
same process its own directory). POSIX locks belong to the process and the kernel drops them when
the process closes *any* descriptor of the file, so the owner never opens the lock file a second
time: it keeps the one descriptor that holds the lock and reads its own record through it
(:func:`holder`). POSIX locks are what an NFS mount offers across nodes (Linux emulates ``flock``
with them there, so the same rule would apply to it): on NFSv4 (or v3 with its lock manager) a
second node sees the lock; a node that crashes keeps it until the server's lease or lock-manager
recovery expires it (typically 90 s), after which the next process takes it.
"""
from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any, Optional

from poslsh_cli.core.errors import ConfigError

LOCK_NAME = ".lock"


class RunBusy(ConfigError):
    """Another live process owns the directory."""


#: Locks this process holds: real path of the lock file -> [fd, depth].
_HELD: dict[str, list[int]] = {}


def _key(directory: Path) -> str:
    return os.path.realpath(Path(directory) / LOCK_NAME)


def _describe(info: dict[str, Any] | None) -> str:
    if not info:
        return "another process (no details recorded)"
    return (f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')}"
            + (f" ({info.get('command')})" if info.get("command") else ""))


def _read_fd(fd: int) -> dict[str, Any] | None:
    """The owner's record, read through an open descriptor of the lock file (never a new one)."""
    try:
        data = os.pread(fd, 1 << 16, 0)
        return json.loads(data.decode() or "null")
    except (OSError, ValueError):
        return None


def _busy(exc: OSError) -> bool:
    return exc.errno in (errno.EACCES, errno.EAGAIN)


def _try_lock(fd: int, tries: int = 10) -> bool:
    """An exclusive lock, retried for about 0.2 s: a reader's probe (:func:`holder`) holds a shared
    lock for microseconds, an owner for the life of its run."""
    import time

    for attempt in range(tries):
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if not _busy(exc):
                raise
            if attempt + 1 < tries:
                time.sleep(0.02)
    return False


def acquire(directory: Path, command: str, what: str = "out") -> None:
    """Take ownership of ``directory`` (created if missing) for this process; raises
    :class:`RunBusy` naming the holder when a live process owns it. Re-entrant."""
    directory = Path(directory)
    key = _key(directory)
    if key in _HELD:
        _HELD[key][1] += 1
        return
    directory.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o666)
        if not _try_lock(fd):
            info = _read_fd(fd)
            os.close(fd)
            raise RunBusy(f"{what}={directory} is in use by {_describe(info)}; wait for it to finish or "
                          f"use another {what}=") from None
        try:  # the file may have been removed (its directory discarded) between open and lock: retry
            same = os.fstat(fd).st_ino == os.stat(key).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
            "since": _dt.datetime.now().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _HELD[key] = [fd, 1]


def release(directory: Path) -> None:
    """Give up one level of ownership; the lock goes when the outermost holder releases."""
    key = _key(directory)
    entry = _HELD.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _HELD[key]
        os.close(entry[0])


def owns(directory: Path) -> bool:
    return _key(directory) in _HELD


def holder(directory: Path) -> Optional[dict[str, Any]]:
    """Who owns ``directory`` now (pid, host, command, since), or None when nobody does (no lock
    file, or its owner is gone). This process counts as an owner too."""
    key = _key(directory)
    if key in _HELD:  # through the lock's own descriptor: opening the file again would drop the lock
        return _read_fd(_HELD[key][0]) or {"pid": os.getpid()}
    try:
        fd = os.open(key, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if not _busy(exc):
                raise
            return _read_fd(fd) or {}
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_free(directory: Path, what: str = "out") -> None:
    """Refuse early (before any work) when another live process owns ``directory``."""
    if owns(directory):
        return
    info = holder(directory)
    if info is not None:
        raise RunBusy(f"{what}={directory} is in use by {_describe(info)}; wait for it to finish or use another {what}=")
