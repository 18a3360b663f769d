"""What a new user runs into in the first hour: every wrong input is one line naming what is wrong,
refused before anything of its size is built (each of these printed a traceback or a misleading line
before)."""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import one_line, poslsh, small_run


@pytest.mark.parametrize("settings,why", [
    (["do_sample=true", "top_k=-1"], "top_k must be >= 0"),
    (["top_k=5"], "add do_sample=true"),
    (["temperature=0.7"], "add do_sample=true"),
])
def test_generate_checks_every_sampling_setting_up_front(poslsh_checkpoint, settings, why):
    res = poslsh("generate", str(poslsh_checkpoint), "max_new_tokens=2", *settings)
    assert one_line(res) and why in res.stderr, res.output


def test_generate_refuses_a_cache_that_would_outgrow_memory_and_says_what_a_long_run_costs(poslsh_checkpoint):
    # exact ALiBi keeps every key: 10^11 tokens of 2 layers x 2 x 2 heads x 16 x 4 bytes is 47 TiB
    res = poslsh("generate", str(poslsh_checkpoint), "attention=alibi", "max_new_tokens=100000000000")
    line = res.stderr
    assert one_line(res) and "key/value cache keeps every key and would grow to" in line and "TiB" in line, line
    # Positional LSH's cache forgets: the run goes on, and says what it will cost before it starts
    from poslsh_cli.lm.generate import check_cache

    from poslsh_cli.lm.loading import load_model

    model, _ = load_model(poslsh_checkpoint)
    said = []
    check_cache(model, "poslsh s=8", 10 ** 11, True, 1e9, said.append)
    assert said and "keeps only the keys poslsh s=8 can still see" in said[0] and "Ctrl-C" in said[0]
    said.clear()
    check_cache(model, "alibi", 5000, False, 1e9, said.append)
    assert said and "grows to" in said[0]  # past its 4096 positions: a line, not a refusal
    said.clear()
    check_cache(model, "alibi", 100, False, 1e9, said.append)
    assert not said  # a short run says nothing


def test_another_commands_preset_names_its_command():
    res = poslsh("matrix-error", "experiment=train_quick")
    line = res.stderr
    assert one_line(res) and "experiment=train_quick is a preset of poslsh train, not of poslsh matrix-error" in line
    assert "matrix_error_quick" in line  # and what this command's presets are


def test_perplexity_of_another_commands_run_says_what_run_it_is(tmp_path):
    run = small_run(tmp_path)  # a matrix-error run: config.yaml, cells, results.csv
    res = poslsh("perplexity", str(run))
    line = res.stderr
    assert one_line(res) and "is a matrix-error run, not a training run: its cells hold no checkpoints" in line, line


def test_a_run_directory_whose_config_cannot_be_read_is_named(tmp_path):
    run = small_run(tmp_path)
    (run / "config.yaml").write_text("n: [64\n  sigma: ][\n")  # cut and malformed
    res = poslsh("matrix-error", "n=[64]", "sigma=[4]", "s=[1,2]", "trials=1", f"out={run}")
    line = res.stderr
    assert one_line(res) and "config.yaml cannot be read as a poslsh configuration" in line, line
    assert "different configuration" not in line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ulimit -v")
def test_a_length_past_memory_is_refused_before_anything_of_its_size_is_built(tmp_path):
    """step-bench's memory check from sizes alone: under a 12 GB address-space cap a billion tokens is
    one line (the check drew the masks of that length first, and numpy ran out of memory)."""
    out = tmp_path / "sb"
    cmd = (f"ulimit -v 12000000; {shutil.which('poslsh') or sys.executable + ' -m poslsh_cli'} step-bench "
           f"'seq_len=[1000000000]' out={out}")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "needs about" in r.stderr and "TiB of memory" in r.stderr
    assert not out.exists()


def test_train_says_what_the_session_will_cost_after_its_first_steps(tmp_path):
    """models x steps x the measured step time, said once, after the first ten steps of the first
    model this session trains (a resumed session counts only the models it still has to train)."""
    from conftest import TINY

    out = tmp_path / "t"
    args = [*TINY, "seq_len=32", "batch=4", "eval_tokens=512", "position=[alibi,poslsh]", "s=[3]", "steps=12",
            "eval_every=6", "checkpoint_every=6", f"out={out}"]
    r = poslsh("train", *args)
    assert r.exit_code == 0, r.output
    said = [line for line in r.stderr.splitlines() if line.startswith("train: ")]
    assert len(said) == 1, r.stderr
    assert "s a step (the median of the first 10)" in said[0] and "the session's 2 models of up to 12 steps" in said[0]
    r = poslsh("train", *args)  # nothing left to train: nothing to say
    assert r.exit_code == 0 and "s a step" not in r.stderr
