"""Training in several processes on torch.distributed (gloo on this CPU): two processes under
torchrun give the losses of one process with the same global batch, step by step, and the same
weights; so do FSDP, gradient accumulation and a multi-task submitit job (the SLURM code path);
a killed torchrun job resumes as one process does; bad input is one line from rank 0."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import ENV, TINY, poslsh, poslsh_process

TRAIN = [*TINY, "seq_len=48", "batch=8", "eval_tokens=2048", "warmup=2", "steps=8", "checkpoint_every=3",
         "eval_every=4", "position=[poslsh]", "s=[4]", "data=pydoc-topics", "device=cpu"]
#: ``poslsh`` in two processes on this machine
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "poslsh_cli"]


def metrics_of(out):
    return pd.read_csv(next((Path(out) / "work").glob("*/metrics.csv")))


def weights_of(out):
    from safetensors.torch import load_file

    return load_file(next((Path(out) / "work").glob("*/final/model.safetensors")))


def assert_same_losses(a, b, rel=1e-4):
    ma, mb = metrics_of(a), metrics_of(b)
    assert list(ma.step) == list(mb.step) == list(range(1, 9))
    np.testing.assert_allclose(mb.loss, ma.loss, rtol=rel)
    both = ma.val_loss.notna()
    assert both.sum() >= 2 and (mb.val_loss.notna() == both).all()
    np.testing.assert_allclose(mb.val_loss[both], ma.val_loss[both], rtol=rel)


def assert_same_weights(a, b):
    wa, wb = weights_of(a), weights_of(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "one"
    r = poslsh_process("train", *TRAIN, f"out={out}")
    assert r.returncode == 0, r.stderr
    return out


def test_two_processes_equal_one_process_with_the_same_global_batch(single, tmp_path):
    out = tmp_path / "ddp"
    r = poslsh_process("train", *TRAIN, f"out={out}", launcher=TORCHRUN)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_losses(single, out)
    assert_same_weights(single, out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["status"] == "complete"
    row = pd.read_csv(out / "results.csv").iloc[0]
    assert row.world_size == 2 and row.tokens == 8 * 8 * 48
    # rank 1 wrote nothing of its own: one run directory, one log, no second lock holder
    assert len(list(tmp_path.iterdir())) == 1


@pytest.mark.slow
def test_accumulation_and_fsdp_equal_one_process(single, tmp_path):
    r = poslsh_process("train", *TRAIN, "accumulate=4", f"out={tmp_path / 'acc'}")
    assert r.returncode == 0, r.stderr
    assert_same_losses(single, tmp_path / "acc")
    r = poslsh_process("train", *TRAIN, "parallel=fsdp", "accumulate=2", f"out={tmp_path / 'fsdp'}", launcher=TORCHRUN)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_losses(single, tmp_path / "fsdp")
    assert_same_weights(single, tmp_path / "fsdp")


@pytest.mark.slow
def test_killed_torchrun_job_resumes_to_the_uninterrupted_run(single, tmp_path):
    out = tmp_path / "killed"
    r = poslsh_process("train", *TRAIN, f"out={out}", fault="step:5", launcher=TORCHRUN)  # after the step-3 checkpoint
    assert r.returncode != 0
    assert len(metrics_of(out)) == 5
    r = poslsh_process("train", *TRAIN, f"out={out}", launcher=TORCHRUN)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_losses(single, out)
    assert_same_weights(single, out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sessions"] == 2 and meta["history"][0]["status"] == "died"


@pytest.mark.slow
def test_multi_task_submitit_job_runs_data_parallel(single, tmp_path):
    out = tmp_path / "sweep"
    r = poslsh_process("train", "-m", "seed=0", *TRAIN, "hydra/launcher=submitit_local",
                       "hydra.launcher.tasks_per_node=2", f"out={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "0" / "meta.json").read_text())["world_size"] == 2
    assert_same_losses(single, out / "0")


def test_a_batch_that_does_not_divide_is_one_line_from_rank_zero(tmp_path):
    out = tmp_path / "bad"
    r = poslsh_process("train", *[a for a in TRAIN if not a.startswith("batch=")], "batch=6", "accumulate=2",
                       f"out={out}", launcher=TORCHRUN)
    assert r.returncode != 0
    errors = [x for x in r.stderr.splitlines() if "poslsh train: error:" in x]
    assert errors == ["poslsh train: error: batch=6 does not divide into 2 process(es) x accumulate=2 "
                      "micro-batches; use a multiple of 4"], r.stderr[-2000:]
    assert not out.exists()


@pytest.mark.slow
def test_commands_other_than_train_refuse_torchrun(tmp_path):
    r = poslsh_process("matrix-error", "n=64", "s=[1]", f"out={tmp_path / 'm'}", launcher=TORCHRUN)
    errors = [x for x in r.stderr.splitlines() if ": error:" in x]
    assert r.returncode != 0 and errors and "only train runs under torchrun" in errors[0]
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_gradient_checkpointing_and_bf16(single, tmp_path):
    r = poslsh_process("train", *TRAIN, "gradient_checkpointing=true", f"out={tmp_path / 'gc'}")
    assert r.returncode == 0, r.stderr
    assert_same_losses(single, tmp_path / "gc", rel=1e-5)
    r = poslsh_process("train", *TRAIN, "precision=bf16", "steps=8", f"out={tmp_path / 'bf16'}")
    assert r.returncode == 0, r.stderr
    a, b = metrics_of(single), metrics_of(tmp_path / "bf16")
    np.testing.assert_allclose(b.loss, a.loss, rtol=3e-2)  # bfloat16 logits: 8 bits of mantissa
    assert not np.array_equal(b.loss.to_numpy(), a.loss.to_numpy())  # autocast ran: not float32's bits
    r = poslsh_process("train", *TRAIN, "precision=fp16", f"out={tmp_path / 'fp16'}")
    assert r.returncode == 2 and "precision=fp16 needs CUDA" in r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_training_with_autocast_follows_the_float32_cpu_run(single, tmp_path, precision):
    """On a CUDA device (scripts/gpu_check.sh): bf16 / fp16 autocast (fp16 with loss scaling) with
    gradient checkpointing trains to the float32 CPU losses within half-precision rounding."""
    out = tmp_path / precision
    r = poslsh_process("train", *[a for a in TRAIN if a != "device=cpu"], "device=cuda", f"precision={precision}",
                       "gradient_checkpointing=true", f"out={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(metrics_of(out).loss, metrics_of(single).loss, rtol=3e-2)


@pytest.mark.slow
def test_evaluation_batch_sees_the_vocabulary_through_ddp(tmp_path):
    """lm.evaluate caps the batch by the logits' memory: a DDP-wrapped 32k-vocabulary model at
    L=4096 gets 2 windows a pass (2 x 4096 x 32000 float32 logits, 1 GiB), as unwrapped, not the
    8 a 256-token vocabulary would allow."""
    import torch.distributed as td
    from torch.nn.parallel import DistributedDataParallel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from poslsh_cli.lm.evaluate import eval_batch, vocab_size

    cfg = Qwen3Config(vocab_size=32000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = Qwen3ForCausalLM(cfg)
    td.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(model)
        assert vocab_size(wrapped) == vocab_size(model) == 32000
        assert eval_batch(wrapped, 4096, 8) == eval_batch(model, 4096, 8) == 2
    finally:
        td.destroy_process_group()


@pytest.mark.slow
def test_a_follower_failure_stops_rank_zero_at_once_naming_it(tmp_path):
    """An exception on rank 1 inside a training cell (a multi-task job: no torchrun agent to stop the
    others) is left for rank 0, which fails at once with that error as its one line, keeping the
    checkpoint written before, instead of waiting in a collective (default timeout 2 h)."""
    out = tmp_path / "sweep"
    env = {"POSLSH_FAULT": "step:5", "POSLSH_FAULT_RANK": "1", "POSLSH_FAULT_SIGNAL": "RAISE"}
    r = subprocess.run([sys.executable, "-m", "poslsh_cli", "train", "-m", "seed=0", *TRAIN,
                        "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", f"out={out}"],
                       capture_output=True, text=True, env=dict(ENV, **env), timeout=300)
    errors = [x for x in r.stderr.splitlines() if "poslsh train: error:" in x]
    assert errors and "rank 1: RuntimeError: fault injected at step:5" in errors[0], r.stderr[-3000:]
    assert list((out / "0" / "work").glob("*/checkpoints/step-00000003"))  # the work before stays


@pytest.mark.slow
def test_fp16_checkpoints_keep_the_loss_scale(tmp_path):
    """An fp16 run's checkpoint holds its GradScaler state (scale, growth tracker), restored on
    resume; a checkpoint without one is refused in one line rather than resumed at the initial
    scale. (The fp16 training path itself needs CUDA: tests/test_distributed.py's gpu tests.)"""
    from poslsh_cli.core.errors import ConfigError
    from poslsh_cli.experiments.train.stage import SCALER, load_scaler

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=3)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for bad in (True, False, False):  # one overflow halves the scale; two good steps advance the tracker
        opt.zero_grad()
        scaler.scale((w * (float("inf") if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    torch.save(scaler.state_dict(), tmp_path / SCALER)
    again = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=3)
    load_scaler(again, tmp_path)
    assert again.get_scale() == scaler.get_scale() == 2.0 ** 15
    assert again.state_dict() == scaler.state_dict()
    (tmp_path / SCALER).unlink()
    with pytest.raises(ConfigError, match="has no scaler.pt"):
        load_scaler(again, tmp_path)


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_every_layer_and_autocast_computes_in_bf16(tmp_path, monkeypatch):
    """In process: with gradient_checkpointing=true each decoder layer's forward runs twice per
    training micro-batch (the forward, and its recomputation in the backward), once without; under
    precision=bf16 the layers' matmuls return bfloat16."""
    from transformers.models.qwen3 import modeling_qwen3

    calls = {"grad": 0, "dtypes": set()}
    forward = modeling_qwen3.Qwen3MLP.forward

    def counted(self, x):
        # counted on entry: the recomputation stops early (torch.utils.checkpoint), once the saved
        # tensors the backward needs are back, so the recomputed call does not return
        if torch.is_grad_enabled():
            calls["grad"] += 1
        out = forward(self, x)
        if torch.is_grad_enabled():
            calls["dtypes"].add(out.dtype)
        return out

    monkeypatch.setattr(modeling_qwen3.Qwen3MLP, "forward", counted)
    base = [a for a in TRAIN if not a.startswith(("steps=", "checkpoint_every=", "eval_every="))]
    base += ["steps=3", "checkpoint_every=3", "eval_every=3"]
    seen = {}
    for name, extra in (("gc", ["gradient_checkpointing=true"]), ("plain", []), ("bf16", ["precision=bf16"])):
        calls["grad"], calls["dtypes"] = 0, set()
        r = poslsh("train", *base, *extra, f"out={tmp_path / name}")
        assert r.exit_code == 0, r.output
        seen[name] = (calls["grad"], set(calls["dtypes"]))
    layers = 2
    assert seen["plain"] == (3 * layers, {torch.float32})
    assert seen["gc"][0] == 2 * 3 * layers
    assert seen["bf16"] == (3 * layers, {torch.bfloat16})


BLOCK_PATH = [a for a in TRAIN if not a.startswith(("seq_len=", "batch=", "steps=", "checkpoint_every=", "eval_every=",
                                                   "eval_tokens="))] + [
    "seq_len=512", "batch=4", "steps=3", "checkpoint_every=3", "eval_every=3", "eval_tokens=2048"]


@pytest.mark.slow
def test_two_processes_equal_one_on_the_block_path(tmp_path):
    """At L=512 causal Positional LSH trains on the recomputing block kernel (the plan's sparse path),
    not the dense bias of L=48: two processes still give one process's losses and weights."""
    from poslsh_cli.attention.plan import Backend, Method, choose

    for n, backend in ((48, Backend.DENSE), (512, Backend.BLOCKS)):  # TRAIN's L, and this test's
        assert choose(Method.POSLSH, device=torch.device("cpu"), dtype=torch.float32, n=n, causal=True,
                      grad=True).backend is backend
    r = poslsh_process("train", *BLOCK_PATH, f"out={tmp_path / 'one'}")
    assert r.returncode == 0, r.stderr[-3000:]
    r = poslsh_process("train", *BLOCK_PATH, f"out={tmp_path / 'two'}", launcher=TORCHRUN)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = metrics_of(tmp_path / "one"), metrics_of(tmp_path / "two")
    assert list(a.step) == list(b.step) == [1, 2, 3]
    np.testing.assert_allclose(b.loss, a.loss, rtol=1e-4)
    assert_same_weights(tmp_path / "one", tmp_path / "two")


@pytest.mark.slow
def test_ddp_with_attention_dropout_replays_itself_not_one_process(tmp_path):
    """The stated exception (docs/THEORY.md): dropout masks are drawn per rank, so two processes
    with attention dropout replay each other exactly and differ from one process."""
    args = [a for a in TRAIN if not a.startswith(("position=", "s=", "steps=", "checkpoint_every=", "eval_every="))] + [
        "position=[alibi]", "attn_dropout=[0.1]", "steps=2", "checkpoint_every=2", "eval_every=2"]
    for name in ("a", "b"):
        r = poslsh_process("train", *args, f"out={tmp_path / name}", launcher=TORCHRUN)
        assert r.returncode == 0, r.stderr[-3000:]
    r = poslsh_process("train", *args, f"out={tmp_path / 'one'}")
    assert r.returncode == 0, r.stderr[-3000:]
    a, b, single = (metrics_of(tmp_path / n).loss.to_numpy() for n in ("a", "b", "one"))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a[1:], single[1:], rtol=1e-6)  # step 1's loss is before any update
