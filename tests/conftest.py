"""What the test files share: the tiny model, the one way to run the CLI (in this process, or as a
process of its own), the verdict helpers, and checkpoints built once per session.

Test files import the plain names (``from conftest import TINY, poslsh``) and ask for the
fixtures by name."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from typer.testing import CliRunner  # noqa: E402

from poslsh_cli.app.cli import app  # noqa: E402

#: The tiny model of the training tests (keys of ``poslsh train``): two layers of width 32, four
#: query heads of 8 sharing two key/value heads. A file adds its run (seq_len=, batch=, steps=, ...).
TINY = ["hidden=32", "layers=2", "heads=4", "kv_heads=2", "head_dim=8", "intermediate=64"]

# ---------------------------------------------------------------------------------------------
# running the CLI

_runner = CliRunner()
#: ``poslsh`` as a process of its own
POSLSH = [sys.executable, "-m", "poslsh_cli"]
#: The environment of a poslsh process: output unbuffered (a killed process has printed what it
#: did), one thread, no network
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def poslsh(*args):
    """``poslsh ARGS`` in this process: ``.exit_code``, ``.stdout``, ``.stderr``, ``.output`` (both)."""
    return _runner.invoke(app, [str(a) for a in args])


def ctrl_c_as_in_a_terminal():
    """The child takes SIGINT as a command typed in a terminal does. A test session started in the
    background by a non-interactive shell (``make test &``, a CI script) has SIGINT ignored, and its
    children inherit that: Ctrl-C would do nothing to them."""
    import signal as signals

    signals.signal(signals.SIGINT, signals.SIG_DFL)


def fault_env(fault=None, signal=None, hold=None, env=None):
    """``env`` (default :data:`ENV`) with the fault point set: ``$POSLSH_FAULT`` (where the process
    kills itself, see :func:`poslsh_cli.core.files.fault_point`), ``$POSLSH_FAULT_SIGNAL`` (with which
    signal), ``$POSLSH_FAULT_HOLD`` (a file it writes, then waits at the point)."""
    env = {k: v for k, v in (ENV if env is None else env).items() if not k.startswith("POSLSH_FAULT")}
    for k, v in (("POSLSH_FAULT", fault), ("POSLSH_FAULT_SIGNAL", signal), ("POSLSH_FAULT_HOLD", hold)):
        if v:
            env[k] = str(v)
    return env


def poslsh_process(*args, fault=None, signal=None, env=None, launcher=POSLSH, cwd=None, timeout=600):
    """``poslsh ARGS`` as a process of its own (for a fault point, a signal, a launcher such as
    torchrun: ``launcher=``), run to its end: ``.returncode``, ``.stdout``, ``.stderr`` (text)."""
    return subprocess.run([*launcher, *map(str, args)], capture_output=True, text=True,
                          env=fault_env(fault, signal, env=env), cwd=cwd, timeout=timeout,
                          preexec_fn=ctrl_c_as_in_a_terminal)


def one_line(r):
    """A refusal: exit 2, one line on stderr, no traceback."""
    lines = r.stderr.strip().splitlines()
    return r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.output


def small_run(tmp_path, name="m"):
    """A matrix-error run of two cells (seconds), for the commands that read runs."""
    out = tmp_path / name
    r = poslsh("matrix-error", "n=[64]", "sigma=[4]", "s=[1,2]", "trials=1", f"out={out}")
    assert r.exit_code == 0, r.output
    return out


# ---------------------------------------------------------------------------------------------
# verdicts

#: The run a report of a synthetic table is written for (nothing is read from it)
RUN = Path("synthetic")


def verdicts(section):
    return {v.claim: v.status for v in section.verdicts}


def status_of(section, needle):
    hits = [v.status for v in section.verdicts if needle in v.claim]
    assert len(hits) == 1, (needle, [v.claim for v in section.verdicts])
    return hits[0]


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(scope="session")
def poslsh_checkpoint(tmp_path_factory):
    """A byte-level Positional-LSH checkpoint (random weights: 2 layers of width 64, sigmas 2 .. 16,
    s=8, trained at 128), saved as poslsh train saves, for a test that needs *a* checkpoint. Built
    once; a test that changes it copies it first."""
    from poslsh_cli.lm.convert import save
    from poslsh_cli.lm.trained import TrainInfo
    from poslsh_cli.lm.loading import Arch, build_model
    from poslsh_cli.lm.positions import PositionState

    arch = Arch(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, head_dim=16, max_positions=4096)
    state = PositionState("poslsh", np.array([2.0, 4.0, 8.0, 16.0]), s=8, seed=3)
    model = build_model(arch, state, seed=1).eval()
    path = tmp_path_factory.mktemp("ck") / "poslsh"
    save(model, path, TrainInfo.of({"scheme": model.poslsh_position.to_json(), "seq_len": 128}), None)
    return path


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """``poslsh train`` of the tiny model, every scheme, six steps: its checkpoints, metrics and
    tables, for the tests that read a training run (train's outputs, perplexity of its checkpoints).
    A test of training itself (resume, faults, several processes) trains its own."""
    out = tmp_path_factory.mktemp("train") / "run"
    r = poslsh("train", *TINY, "seq_len=32", "batch=4", "eval_tokens=2048", "warmup=2",
               "position=[none,alibi,poslsh,fixed_block,windowed,rope]", "s=[3]", "steps=6",
               "eval_every=3", "checkpoint_every=4", f"out={out}")
    assert r.exit_code == 0, r.output
    return out


ANIMALS = ["cat", "dog", "cow", "hen", "pig", "fox", "owl", "bee"]
COLORS = ["red", "blue", "green", "black", "white"]


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory):
    """A multiple-choice task of 20 documents as lm-eval task YAML + JSON lines."""
    d = tmp_path_factory.mktemp("tasks")
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(20):
        a, c = rng.choice(ANIMALS), rng.choice(COLORS)
        choices = [c, *rng.choice([x for x in COLORS if x != c], 2, replace=False)]
        rng.shuffle(choices)
        rows.append({"query": f"The {a} is {c}. The {a} is", "choices": [" " + str(x) for x in choices],
                     "gold": choices.index(c)})
    (d / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {d / 'tiny.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{query}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\nmetric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")
    return d


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:
        cuda = False
    if not cuda:
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
