"""The longest silence of a command: seconds without a new line on stdout or stderr, from its start to
its end (the first line's wait counts). Used to check that every wait a busy machine stretches says
something (docs/GUIDE.md, "Measuring speed on a shared machine").

    python scripts/silence.py -- poslsh train experiment=train_quick out=/tmp/x
    python scripts/silence.py --load 2 -- poslsh bench experiment=bench_quick out=/tmp/b

``--load N`` runs N busy loops (``yes > /dev/null``) beside it, as a shared machine would. Prints one
line: the command, its exit code, its wall time, its lines and its longest silence (and where it was).
"""
from __future__ import annotations

import argparse
import selectors
import subprocess
import sys
import time


def longest_silence(cmd: list[str]) -> tuple[int, float, int, float, str]:
    """(exit code, wall seconds, lines, longest silence in seconds, the line that ended it)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sel = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        sel.register(stream, selectors.EVENT_READ)
    last, worst, where, lines, open_streams = t0, 0.0, "(start)", 0, 2
    buffers = {proc.stdout: b"", proc.stderr: b""}
    while open_streams:
        for key, _ in sel.select():
            chunk = key.fileobj.read1(65536)
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            buffers[key.fileobj] += chunk
            *done, buffers[key.fileobj] = buffers[key.fileobj].split(b"\n")
            for line in done:
                now = time.monotonic()
                if now - last > worst:
                    worst, where = now - last, line.decode(errors="replace")[:80]
                last, lines = now, lines + 1
    code = proc.wait()
    end = time.monotonic()
    if end - last > worst:
        worst, where = end - last, "(the end)"
    return code, end - t0, lines, worst, where


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=int, default=0, help="busy loops beside the command (yes > /dev/null)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the command after --")
    busy = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.load)]
    try:
        code, wall, lines, worst, where = longest_silence(cmd)
    finally:
        for p in busy:
            p.kill()
    print(f"{' '.join(cmd)[:90]} | exit {code} | {wall:.1f} s | {lines} lines | longest silence {worst:.1f} s "
          f"(before: {where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
