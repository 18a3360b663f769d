"""Run every experiment of the paper at one scale, then the plots and the report.

Each experiment runs as ``poslsh <command> experiment=<preset>_<scale> out=<root>/<scale>/<name>``
in a child process, so a fixed run directory resumes after an interruption. The large-model
presets run only where their checkpoint is found ($POSLSH_MODELS/<dir> or model.path) and a GPU
is present; the report says which were skipped and why.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: (run name, command, preset stem): the evidence of the paper's summary, in report order
EXPERIMENTS = [
    ("matrix_error", "matrix-error", "matrix_error"),
    ("matrix_dense_check", "matrix-error", "matrix_dense_check"),
    ("block_stats", "block-stats", "block_stats"),
    ("block_stats_loglog", "block-stats", "block_stats_loglog"),
    ("output_error_minilm", "output-error", "output_error_minilm"),
    ("output_error_qwen3_0_6b", "output-error", "output_error_qwen3_0_6b"),
    ("output_error_mistral_7b", "output-error", "output_error_mistral_7b"),
    ("output_error_llama_4_scout", "output-error", "output_error_llama_4_scout"),
    ("bench", "bench", "bench"),
]
LARGE = {"output_error_qwen3_0_6b": "Qwen3-0.6B", "output_error_mistral_7b": "Mistral-7B-v0.1",
         "output_error_llama_4_scout": "Llama-4-Scout-17B-16E"}


def _skip_reason(name: str) -> str | None:
    if name not in LARGE:
        return None
    root = os.environ.get("POSLSH_MODELS")
    if not root:
        return "POSLSH_MODELS is not set (no checkpoint directory)"
    path = Path(root) / LARGE[name]
    if not (path / "config.json").exists():
        return f"no checkpoint at {path}"
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA GPU (a large model on this CPU would take hours)"
    except ImportError:
        return "torch missing"
    return None


def _mark_skipped(out: Path, name: str, command: str, preset: str, reason: str) -> None:
    """Keep the reason in the experiment's own directory, so any report over it says so."""
    from poslsh_cli.rundir import atomic_write_text

    if (out / "config.yaml").exists():
        return  # a run was made there before: its results stand
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "skipped.json", json.dumps({"name": name, "command": command, "preset": preset,
                                                        "reason": reason}, indent=1) + "\n")


def _record_session(root: Path, scale: str, started: str, seconds: float, ran: int, failed: list[str]) -> None:
    from poslsh_cli.rundir import atomic_write_text

    path = root / "reproduce.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        rec = {"scale": scale, "sessions": []}
    rec["sessions"].append({"started": started, "seconds": round(seconds, 1), "ran": ran, "failed": failed})
    atomic_write_text(path, json.dumps(rec, indent=1) + "\n")


def main(scale: str, root: Path) -> int:
    import datetime as _dt

    root = Path(root) / scale
    root.mkdir(parents=True, exist_ok=True)
    failed, done = [], []
    started = _dt.datetime.now().isoformat(timespec="seconds")
    t0 = time.time()
    for name, command, preset in EXPERIMENTS:
        out = root / name
        reason = _skip_reason(name)
        if reason:
            _mark_skipped(out, name, command, f"{preset}_{scale}", reason)
            print(f"== skipped {name}: {reason}", flush=True)
            continue
        (out / "skipped.json").unlink(missing_ok=True)
        print(f"== {name}: poslsh {command} experiment={preset}_{scale} out={out}", flush=True)
        cmd = [sys.executable, "-m", "poslsh_cli", command, f"experiment={preset}_{scale}", f"out={out}"]
        child = subprocess.Popen(cmd)
        try:
            rc = child.wait()
        except KeyboardInterrupt:
            # Ctrl-C reached the child too; SIGTERM covers a kill aimed at this process only.
            # Either way the child keeps its finished cells and marks the run interrupted.
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
            rc = 130
        if rc == 130:
            _record_session(root, scale, started, time.time() - t0, len(done), failed + [f"{name} (interrupted)"])
            print(f"interrupted; run the same command again to resume ({root})", file=sys.stderr)
            return 130
        if rc != 0:
            failed.append(name)
            print(f"== FAILED {name} (exit {rc})", flush=True)
            continue
        done.append(out)
    _record_session(root, scale, started, time.time() - t0, len(done), failed)
    if done:
        from poslsh_cli import report

        md, html_path = report.build([root], root)
        print(f"report: {md}\n        {html_path}", flush=True)
    return 1 if failed else 0
