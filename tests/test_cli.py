"""The command line, end to end, into temporary directories: what every command shares (help,
bad input in one line, launchers, resume, run directories, memory estimates, unreadable files). A
command's own tests are in tests/test_<command>.py."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from conftest import TINY, one_line, poslsh, small_run

METRICS = ["n", "sigma", "s", "trial", "seed", "method", "spectral_err", "spectral_rel", "max_err", "b_max"]


def test_version_and_help_list_every_key():
    r = poslsh("--version")
    assert r.exit_code == 0 and r.stdout.startswith("poslsh ")
    r = poslsh("matrix-error", "--help")
    assert r.exit_code == 0
    for key in ("n=", "sigma=", "s=", "trials=", "method=", "tol=", "seed=", "out="):
        assert key in r.stdout


def test_help_shows_no_value_for_flags_and_names_arguments_in_capitals():
    """A flag takes no value, so its help shows none (not <bool>); the usage line names arguments as
    click does, CHECKPOINT [SETTINGS]... (not {checkpoint} [settings]...)."""
    for args in (["--help"], ["matrix-error", "--help"], ["generate", "--help"], ["report", "--help"]):
        r = poslsh(*args)
        assert r.exit_code == 0 and "<bool>" not in r.stdout, args
    assert "generate [OPTIONS] CHECKPOINT [SETTINGS]..." in " ".join(poslsh("generate", "--help").stdout.split())
    assert "report [OPTIONS] RUN_DIRS..." in " ".join(poslsh("report", "--help").stdout.split())


def test_a_closed_pipe_ends_the_output_not_the_command(tmp_path):
    """poslsh ... | head: the reader going away leaves no traceback and no failure; a run finishes its cells."""
    import subprocess
    import sys

    from conftest import ENV

    out = tmp_path / "run"
    cmd = f"{sys.executable} -m poslsh_cli matrix-error 'n=[64]' sigma=4 's=[1,2,4,8,16,32]' trials=12 out={out} | head -1"
    res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr
    assert len(pd.read_csv(out / "results.csv")) == 72


@pytest.mark.parametrize("args,needle", [
    (["matrix-error", "foo=1"], "unknown key 'foo'"),
    (["matrix-error", "sigmaa=1"], "unknown key 'sigmaa' (did you mean sigma?); known keys: delta, dense_max_n,"),
    (["matrix-error", "model=x"], "unknown key 'model'; known keys: delta,"),
    (["matrx-error", "n=64"], "no command 'matrx-error' (did you mean matrix-error?); commands: matrix-error,"),
    (["perplexity", "model=/tmp"], "unknown key 'model'; known keys: attention, batch, checkpoints,"),
    (["matrix-error", "sigma=0"], "sigma must be > 0"),
    (["matrix-error", "sigma=[2,-1]"], "sigma must be > 0"),
    (["matrix-error", "s=0"], "s must be >= 1"),
    (["matrix-error", "n=1"], "n must be >= 2"),
    (["matrix-error", "trials=0"], "trials must be >= 1"),
    (["matrix-error", "trials=abc"], "trials must be an integer, got 'abc'"),
    (["sample", "n=abc"], "n must be an integer, got 'abc'"),
    (["matrix-error", "tol=2"], "tol must be in (0, 1)"),
    (["block-stats", "s_per_log_n=0"], "s_per_log_n must be > 0"),
    (["matrix-error", "method=slow"], "method must be"),
    (["matrix-error", "n=100000", "method=dense"], "dense_max_n"),
    (["matrix-error", "s=1,2"], "add -m"),
    (["block-stats", "sigma=-3"], "sigma must be > 0"),
    (["sample", "n=10", "sigma=null"], "give sigma= or heads="),
    (["matrix-error", "n"], "expected KEY=VALUE"),
    (["matrix-error", "n=64", "hydra/launcher=joblib"], "applies to a multirun: add -m"),
    (["matrix-error", "-m", "n=64", "hydra/launcher=nope"], "unknown launcher 'nope'"),
    (["matrix-error", "experiment=nonexistent"],
     "unknown preset experiment=nonexistent (this command's presets: matrix_dense_check_paper,"),
    (["step-bench", "backend=[blocks]", "position=[rope]"], "position=rope runs on its own attention only"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, needle):
    out = tmp_path / "never"
    r = poslsh(*args, f"out={out}")
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not out.exists()


@pytest.mark.parametrize("launcher,needle,plugins", [("joblib", 'pip install -e ".[launchers]"', False),
                                                     ("submitit_slurm", 'pip install -e ".[launchers]"', False),
                                                     ("slurm", "needs SLURM (sbatch is not on PATH)", True)])
def test_launchers_that_cannot_run_here_say_why_in_one_line(tmp_path, monkeypatch, launcher, needle, plugins):
    """Without the plugins (simulated), or without SLURM, one line instead of Hydra's pages."""
    import importlib.util
    import shutil

    real = importlib.util.find_spec
    if not plugins:
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name.startswith("hydra_plugins") else real(name, *a))
    if shutil.which("sbatch"):
        pytest.skip("this machine has SLURM")
    r = poslsh("matrix-error", "-m", "n=64,128", f"hydra/launcher={launcher}", f"out={tmp_path / 'x'}")
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()


def test_multirun_meta_records_the_replayable_argv(tmp_path):
    r = poslsh("block-stats", "-m", "n=64,128", "sigma=2", "s=4", "trials=1", f"out={tmp_path}")
    assert r.exit_code == 0, r.output
    argv = json.loads((tmp_path / "0" / "meta.json").read_text())["argv"]
    assert argv.startswith("poslsh block-stats -m ") and "n=64,128" in argv


def test_help_lists_presets_launchers_and_model_folders():
    r = poslsh("output-error", "--help")
    assert r.exit_code == 0
    text = " ".join(r.stdout.split())
    assert "experiment=NAME" in text and "output_error_minilm_quick" in text
    assert "hydra/launcher=NAME" in text and "submitit_slurm" in text
    assert "$POSLSH_MODELS/Qwen3-0.6B" in text and "get_alibi_slopes" in text


def test_unwritable_out_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = poslsh("matrix-error", "n=16", "s=1", "trials=1", f"out={blocker / 'sub'}")
    assert r.exit_code == 2 and "out=" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = poslsh("matrix-error", "n=16", "s=1", "trials=1", "out=/proc/poslsh-test")
    assert r.exit_code == 2 and "not writable" in r.stderr


def test_resume_refuses_a_different_config_naming_the_keys(tmp_path):
    assert poslsh("matrix-error", "n=16", "sigma=2", "s=[1,2]", "trials=1", f"out={tmp_path}").exit_code == 0
    r = poslsh("matrix-error", "n=32", "sigma=2", "s=[1,4]", "trials=2", f"out={tmp_path}")
    assert r.exit_code == 2 and one_line(r) and "different configuration" in r.stderr, r.stderr
    assert "n: 16 -> 32" in r.stderr and "s: [1, 2] -> [1, 4]" in r.stderr and "trials: 1 -> 2" in r.stderr, r.stderr
    assert "sigma" not in r.stderr, r.stderr


def test_a_run_made_before_a_key_existed_resumes_while_the_key_keeps_its_default(tmp_path):
    """A run directory from before a key was added (its config.yaml lacks the key) or before a key
    became a list sweep (a scalar where a one-element list is written now) resumes; a new key set
    to another value than its default is a different configuration."""
    import yaml

    assert poslsh("matrix-error", "n=16", "sigma=2", "s=[2]", "trials=1", f"out={tmp_path}").exit_code == 0
    cfg = tmp_path / "config.yaml"
    held = yaml.safe_load(cfg.read_text())
    assert held["trials"] == 1 and "sampler" in held and held["s"] == [2]
    del held["sampler"]  # as if the key did not exist when the run was made
    held["s"] = 2  # as if s had been a scalar key
    cfg.write_text(yaml.safe_dump(held))
    r = poslsh("matrix-error", "n=16", "sigma=2", "s=[2]", "trials=1", f"out={tmp_path}")
    assert r.exit_code == 0, r.stderr
    r = poslsh("matrix-error", "n=16", "sigma=2", "s=[2]", "trials=1", "sampler=sobol", f"out={tmp_path}")
    assert r.exit_code == 2 and "sampler: (not set) -> sobol" in r.stderr, r.stderr


def test_a_list_default_of_names_is_stored_as_a_user_types_it_and_older_spellings_resume(tmp_path):
    """dropout_positions' default is stored as [alibi] (not ALIBI, which poslsh refuses as an unknown
    position), so rerunning with the value typed resumes; a run that stored ALIBI resumes too."""
    import yaml

    out = tmp_path / "run"
    args = ["train", "hidden=16", "layers=1", "heads=2", "kv_heads=2", "head_dim=8", "intermediate=32", "seq_len=16",
            "batch=2", "steps=1", "eval_tokens=64", "position=[none]", "data=pydoc-topics", f"out={out}"]
    assert poslsh(*args).exit_code == 0
    held = yaml.safe_load((out / "config.yaml").read_text())
    assert held["dropout_positions"] == ["alibi"]
    r = poslsh(*args, "dropout_positions=[alibi]")
    assert r.exit_code == 0, r.stderr
    held["dropout_positions"] = ["ALIBI"]  # how runs made before stored the default
    (out / "config.yaml").write_text(yaml.safe_dump(held))
    r = poslsh(*args, "dropout_positions=[alibi]")
    assert r.exit_code == 0, r.stderr


def test_one_migration_reads_an_older_run_configuration_as_todays():
    """migrate_config is the one reading of older config.yaml layouts: an enum name reads as the value
    a user types where that value is asked for, a key the command gained takes its default only where it is asked for, and a
    different value still counts as a change (shown as the run holds it)."""
    from poslsh_cli.store.rundir import config_changes, migrate_config

    held = {"position": ["ALIBI", "POSLSH"], "steps": 10}
    wanted = {"position": ["alibi", "poslsh"], "sampler": "iid", "steps": 10}
    assert migrate_config(held, {"sampler": "iid", "other": 1}, wanted) == wanted
    assert held["position"] == ["ALIBI", "POSLSH"]  # the held record itself is not rewritten
    old = "position: [ALIBI]\nsteps: 10\n"
    assert config_changes(old, "position: alibi\nsteps: 10\nsampler: iid\n", {"sampler": "iid"}) == []
    assert config_changes(old, "position: alibi\nsteps: 10\nsampler: sobol\n", {"sampler": "iid"}) == [
        "sampler: (not set) -> sobol"]
    assert config_changes(old, "position: rope\nsteps: 10\n") == ["position: [ALIBI] -> rope"]
    held_file = "data: README\nposition: [ALIBI]\nseed: [1]\n"  # capitals that are no enum's name stay
    assert config_changes(held_file, "data: README\nposition: alibi\nseed: [1, 2]\n") == ["seed: [1] -> [1, 2]"]


def test_multirun_writes_one_run_per_job(tmp_path):
    r = poslsh("block-stats", "-m", "n=64,128", "sigma=2", "s=4", "trials=2", f"out={tmp_path}")
    assert r.exit_code == 0, r.output
    for job in ("0", "1"):
        df = pd.read_csv(tmp_path / job / "results.csv")
        assert len(df) == 2
    assert sorted(pd.read_csv(tmp_path / j / "results.csv").n.iloc[0] for j in "01") == [64, 128]
    r = poslsh("plot", tmp_path)
    assert r.exit_code == 0
    assert (tmp_path / "0" / "figures" / "b_max_vs_n.png").exists()


@pytest.mark.slow
def test_killed_run_resumes_without_recomputing(tmp_path):
    """SIGTERM half-way, then the same command: every cell exactly once, same numbers."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "poslsh_cli", "matrix-error", "n=[3000,6000]", "sigma=[2,8]",
           "s=[2,8,32]", "trials=2", f"out={out}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 120
    while time.time() < deadline:
        if len(list((out / "cells").glob("*.json"))) >= 5 if (out / "cells").exists() else False:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.decode()  # 128 + SIGTERM
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "interrupted"
    done_before = {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.json")}
    assert 5 <= len(done_before) < 24
    partial = pd.read_csv(out / "results.csv")
    assert len(partial) == len(done_before)

    res = subprocess.run(cmd, capture_output=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr.decode()
    assert b"resuming" in res.stderr
    for name, mtime in done_before.items():  # finished cells were not recomputed
        assert (out / "cells" / name).stat().st_mtime_ns == mtime
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 24 and not df.duplicated(["n", "sigma", "s", "trial"]).any()
    assert json.loads((out / "meta.json").read_text())["sessions"] == 2

    fresh = tmp_path / "fresh"
    assert poslsh(*cmd[3:-1], f"out={fresh}").exit_code == 0
    ref = pd.read_csv(fresh / "results.csv")
    pd.testing.assert_frame_equal(df[METRICS], ref[METRICS])


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "poslsh_cli", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "matrix-error" in r.stdout


# ---------------------------------------------------------------------------------------------
# bad files: one line each, nothing half-written


@pytest.mark.parametrize("name,content,needle", [
    ("b.jsonl", b'{"text":"a"}\n{broken\n', "line 2 is not JSON"),
    ("c.jsonl", b'{"text":"a"}\n{"text":"caf\xe9"}\n', "line 2 is not UTF-8"),
    ("d.jsonl", b'{"text":"a"}\n[1, 2]\n', "line 2 is a JSON list, not a record"),
    ("r.txt", np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8).tobytes(),
     "r.txt is not text: "),
])
def test_a_corpus_that_cannot_be_read_is_one_line(tmp_path, name, content, needle):
    (tmp_path / name).write_bytes(content)
    out = tmp_path / "run"
    r = poslsh("train", f"data={tmp_path / name}", "steps=1", f"out={out}")
    assert one_line(r) and needle in r.stderr, r.output
    assert not out.exists()


FRENCH = "Là où la raison ne connaît point, le café est prêt à l'aube. "


def test_text_in_another_encoding_is_refused_naming_the_byte_or_decoded_as_told(tmp_path):
    """A Latin-1 file is not UTF-8: train refuses it in one line naming the file and the byte offset
    of the first byte that is not (nothing written); with encoding=latin-1 it trains on the text
    itself, never on U+FFFD. JSON lines alike."""
    from poslsh_cli.lm.data import load_corpus

    tiny = [*TINY, "seq_len=32", "batch=4", "eval_tokens=2048", "warmup=0", "steps=2", "position=[alibi]"]
    raw = (FRENCH * 200).encode("latin-1")
    (tmp_path / "fr.txt").write_bytes(raw)
    out = tmp_path / "run"
    r = poslsh("train", f"data={tmp_path / 'fr.txt'}", *tiny, f"out={out}")
    assert one_line(r) and "fr.txt" in r.stderr and "byte offset 1 " in r.stderr and "encoding=" in r.stderr, r.output
    assert not out.exists()
    r = poslsh("train", f"data={tmp_path / 'fr.txt'}", "encoding=latin-1", *tiny, f"out={out}")
    assert r.exit_code == 0, r.output
    corpus = load_corpus(str(tmp_path / "fr.txt"), encoding="latin-1")
    assert bytes(corpus.train[:len(FRENCH.encode())]).decode("utf-8") == FRENCH
    assert json.loads((out / "meta.json").read_text())["corpus"]["encoding"] == "latin-1"
    lines = b"".join(b'{"text": "' + FRENCH.encode("latin-1") + b'"}\n' for _ in range(30))
    (tmp_path / "fr.jsonl").write_bytes(lines)
    r = poslsh("train", f"data={tmp_path / 'fr.jsonl'}", *tiny, f"out={tmp_path / 'run2'}")
    assert one_line(r) and "line 1 is not UTF-8" in r.stderr and "byte offset 11 " in r.stderr, r.output
    jsonl = load_corpus(str(tmp_path / "fr.jsonl"), encoding="latin-1")
    assert bytes(jsonl.train[:len(FRENCH.encode())]).decode() == FRENCH
    r = poslsh("train", f"data={tmp_path / 'fr.txt'}", "encoding=klingon", *tiny, f"out={tmp_path / 'run3'}")
    assert one_line(r) and "encoding='klingon'" in r.stderr, r.output
    assert "encoding" in poslsh("train", "--help").output


def test_binary_config_yaml_on_resume_is_one_line(tmp_path):
    run = small_run(tmp_path)
    (run / "config.yaml").write_bytes(bytes(range(256)))
    r = poslsh("matrix-error", "n=[64]", "sigma=[4]", "s=[1,2]", "trials=1", f"out={run}")
    assert one_line(r) and "config.yaml is not UTF-8 text" in r.stderr, r.output


def test_a_checkpoint_whose_weights_do_not_fit_its_config_is_one_line(tmp_path):
    """config.json says 5 heads, the weights were saved with 4: the tensor and both shapes, in one
    line (transformers' own error points at a report that is not shown)."""
    import numpy as np

    from poslsh_cli.lm.convert import save
    from poslsh_cli.lm.trained import TrainInfo
    from poslsh_cli.lm.loading import Arch, build_model
    from poslsh_cli.lm.positions import PositionState

    arch = Arch(hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, head_dim=8, max_positions=256)
    ck = tmp_path / "ck"
    model = build_model(arch, PositionState("alibi", np.array([2.0, 4.0, 8.0, 16.0])), seed=0)
    save(model, ck, TrainInfo(seq_len=64), None)
    (ck / "manifest.json").unlink(missing_ok=True)
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 5}))
    for command in (["perplexity", ck, f"out={tmp_path / 'p'}"], ["generate", ck, "max_new_tokens=2"]):
        r = poslsh(*command)
        assert one_line(r) and "above report" not in r.stderr, r.output
        assert "model.layers.0.self_attn.q_proj.weight" in r.stderr and "32x32" in r.stderr and "40x32" in r.stderr, \
            r.stderr
    assert not (tmp_path / "p").exists()


def test_an_error_keeps_the_lines_that_say_how_to_fix_it(tmp_path, capsys):
    """--readme FILE without the results markers: the error gives the two lines to put in FILE,
    each whole on its own line; nothing is published. An unexpected error keeps its first line."""
    from poslsh_cli.app.launch import fail
    from poslsh_cli.app.publish import BEGIN, END

    run = small_run(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("# mine\n")
    r = poslsh("report", run, "--publish", tmp_path / "docs", "--readme", readme)
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and "Traceback" not in r.stderr, r.output
    assert lines[0].startswith("poslsh report: error: ") and "has no results block" in lines[0], r.stderr
    assert BEGIN in lines and END in lines, r.stderr
    assert readme.read_text() == "# mine\n" and not (tmp_path / "docs").exists()
    with pytest.raises(SystemExit):
        fail("x", RuntimeError("what went wrong\n  File \"a.py\", line 1\nmore detail"))
    assert capsys.readouterr().err == "poslsh x: error: what went wrong\n"


def test_every_command_estimates_its_memory():
    """memory_check is a key of every command, so every command estimates its peak memory."""
    from poslsh_cli.app import registry

    missing = [name for name, exp in registry.experiments().items() if exp.memory is None]
    assert not missing, missing


@pytest.mark.parametrize("command", ["step-bench", "train", "decode-bench", "passkey", "eval"])
def test_a_run_too_large_for_this_machine_is_refused_in_one_line(tmp_path, command, poslsh_checkpoint):
    """The same refusal as the other commands, before anything is written or loaded; memory_check=false
    would run it."""
    ck = poslsh_checkpoint if command in ("passkey", "eval") else None
    args = {"step-bench": ["seq_len=[4000000]"],
            "train": ["seq_len=[4000000]"],
            "decode-bench": ["context=[400000000]"],
            "passkey": [ck, "lengths=[400000000]"],
            "eval": [ck, "tasks=[anything]", "max_length=400000000", "batch_size=64"]}[command]
    r = poslsh(command, *args, f"out={tmp_path / 'run'}")
    assert r.exit_code == 2 and one_line(r), r.output
    assert "needs about" in r.stderr and "memory_check=false runs it anyway" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_default_run_directories_are_unique_within_one_second(tmp_path, monkeypatch):
    """Launches in the same second (the timestamp held fixed here) get their own directories; two
    processes race for them through mkdir, which only one can win."""
    import poslsh_cli.store.rundir as rundir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rundir, "timestamp", lambda: "2026-01-01_00-00-00")
    for s in ("[1]", "[2]", "[1]"):
        r = poslsh("matrix-error", "n=[64]", "sigma=[4]", f"s={s}", "trials=1")
        assert r.exit_code == 0, r.output
    made = sorted(p.name for p in (tmp_path / "runs" / "matrix-error").iterdir())
    assert made == ["2026-01-01_00-00-00", "2026-01-01_00-00-00-2", "2026-01-01_00-00-00-3"]
    r = poslsh("matrix-error", "n=[64]", "sigma=[-4]")  # refused: nothing reserved
    assert r.exit_code == 2 and len(list((tmp_path / "runs" / "matrix-error").iterdir())) == 3
    code = ("import sys; from poslsh_cli.store.rundir import reserve_default; "
            "print(reserve_default(sys.argv[1], 'same')[0].name)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "race")], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    names = sorted(p.communicate()[0].strip() for p in procs)
    assert names == ["same", "same-2", "same-3", "same-4"]


def test_progress_lines_leave_out_s_for_schemes_without_it():
    from poslsh_cli.app.runner import key_text

    assert key_text({"position": "none", "s": 0, "seed": 0}) == "position=none seed=0"
    assert key_text({"position": "poslsh", "s": 4, "seed": 1}) == "position=poslsh s=4 seed=1"


def test_messages_that_say_what_is_wrong(tmp_path, trained):
    """output-error text=<folder> says it is a folder; out= at another command's run names that command;
    generate on a train run names its models."""
    folder = tmp_path / "texts"
    folder.mkdir()
    r = poslsh("output-error", f"text={folder}", "n=64", "s=[1]", "trials=1", f"out={tmp_path / 'o'}")
    assert r.exit_code == 2 and "a folder, not a text file" in r.stderr, r.stderr
    other = tmp_path / "m"
    assert poslsh("matrix-error", "n=16", "s=[1]", "trials=1", f"out={other}").exit_code == 0
    r = poslsh("block-stats", "n=[64]", "sigma=2", "s=[2]", "trials=1", f"out={other}")
    assert r.exit_code == 2 and one_line(r) and "holds a poslsh matrix-error run, not a block-stats run" in r.stderr
    r = poslsh("generate", str(trained), "prompt=hello")
    assert r.exit_code == 2 and one_line(r) and "is a train run" in r.stderr and "/final" in r.stderr, r.stderr
    r = poslsh("perplexity", str(trained.parent), "lengths=[32]", "max_tokens=256", f"out={tmp_path / 'p'}")
    n = len(pd.read_csv(trained / "results.csv"))
    assert r.exit_code == 0 and f"{trained.parent}: {n} checkpoint" in r.stderr.splitlines()[0], r.stderr


def test_the_heldout_task_of_a_corpus_without_whole_held_out_documents_says_why():
    from poslsh_cli.core.errors import ConfigError
    from poslsh_cli.lm import heldout_task

    with pytest.raises(ConfigError, match="has 1 document, fewer than val_every=10: training held out the last part"):
        heldout_task.build("pydoc-topics")


def test_a_log_gets_a_line_every_tenth_and_one_per_kind_of_message_at_the_end():
    """Off a terminal, a long cell's progress is a line every 10% of its steps; at its last step (a
    training cell's final evaluations, each reporting its windows) one line for each kind of message,
    not one per update."""
    import io

    from rich.console import Console

    from poslsh_cli.app.runner import _Progress

    out = io.StringIO()
    with _Progress(Console(file=out, force_terminal=False, width=200), 1, 0, "train") as bar:
        for step in range(1, 101):
            bar.sub(step, 100, f"alibi seed=0 loss {5 - step / 100:.3f}")
            if step % 20 == 0 or step == 100:
                for w in range(8, 257, 8):
                    bar.sub(step, 100, f"alibi seed=0 validation {w}/256 windows")
        for w in range(8, 257, 8):
            bar.sub(100, 100, f"alibi seed=0 final weights on the training split {w}/256 windows")
        bar.sub(100, 100, "alibi seed=0 loss 4.000 val_bpb 5.000")
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 + 3, lines  # the first step, 10%, 20%, ... 100%; then three other kinds at 100/100
    assert lines[-3:] == ["    100/100 alibi seed=0 validation 8/256 windows",
                          "    100/100 alibi seed=0 final weights on the training split 8/256 windows",
                          "    100/100 alibi seed=0 loss 4.000 val_bpb 5.000"], lines[-3:]


def test_a_log_never_stays_silent_longer_than_the_quiet_limit(monkeypatch):
    """Off a terminal, a line at least every QUIET_S seconds besides one every tenth: a tenth of a
    1200-step cell took 20-40 s on a busy machine with nothing printed."""
    import io

    from rich.console import Console

    from poslsh_cli.app import runner

    now = [0.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    with runner._Progress(Console(file=out, force_terminal=False, width=200), 1, 0, "train") as bar:
        for step in range(1, 1001):
            now[0] += 0.35  # a step of a third of a second: a tenth of the cell is 35 s
            bar.sub(step, 1000, f"alibi seed=0 loss {5 - step / 1000:.3f}")
    lines = out.getvalue().splitlines()
    assert len(lines) > 30  # every ~10 s of 350 s, besides the tenths
    steps = [int(line.split("/")[0]) for line in lines]
    assert max(b - a for a, b in zip(steps, steps[1:])) * 0.35 <= runner.QUIET_S + 0.35


def test_a_silent_step_shows_a_spinner_on_a_terminal_and_nothing_in_a_log(monkeypatch, capsys):
    """Preparing (data, models) took tens of seconds on a busy machine with nothing shown: a spinner on a
    terminal; off a terminal nothing at all, so a refusal raised while preparing stays one line (a
    line every 10 s there stood beside such refusals on a loaded machine)."""
    import io
    import time as _time

    from rich.console import Console

    from poslsh_cli.app import runner

    with runner.waiting("poslsh train: preparing"):
        _time.sleep(0.3)
    assert "preparing" not in capsys.readouterr().err
    out = io.StringIO()
    monkeypatch.setattr(runner, "console", lambda stderr=True: Console(file=out, force_terminal=True, width=80))
    with runner.waiting("poslsh train: preparing"):
        _time.sleep(0.3)
    assert "poslsh train: preparing" in out.getvalue()
