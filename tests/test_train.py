"""Training paths and ``poslsh train``: float64 references for the training attention paths,
position schemes inside a real transformers model, resume after SIGKILL with identical results,
bad input, and train's claim on the gap to ALiBi. (Perplexity of the trained checkpoints:
tests/test_perplexity.py; step-bench: tests/test_step_bench.py.)"""
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import TINY, poslsh, status_of
from poslsh_cli.verdicts.claims import Status
from poslsh_cli.app import registry
from poslsh_cli import attention as A
from poslsh_cli.attention import AttentionSpec, Backend, Method, attend, choose, reference_attention
from poslsh_cli.lm.data import load_corpus
from poslsh_cli.lm.trained import TRAIN_INFO_SCHEMA, TrainInfo, train_info
from poslsh_cli.lm.windows import count_predicted, eval_windows
from poslsh_cli.lm.positions import Position, PositionState
from poslsh_cli.lm.loading import Arch, build_model, load_model
from poslsh_cli.numerics.sampling import alibi_sigmas, sample_partitions

TRAIN = [*TINY, "seq_len=32", "batch=4", "eval_tokens=2048", "warmup=2"]


def qkv(B=2, H=4, n=80, d=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(B, H, n, d, generator=g, dtype=torch.float64) for _ in range(3)]
    return [t.requires_grad_(grad) for t in ts]


# ---------------------------------------------------------------------------------------------
# the training attention paths against float64 references


@pytest.mark.parametrize("causal", [True, False])
def test_dense_bias_poslsh_equals_blocks_and_reference_in_float64(causal):
    """T~ = softmax(q k^T/sqrt(d) + log M~) V: the dense route equals the block-and-merge route."""
    q, k, v = qkv(n=200)
    g = np.random.default_rng(1)
    parts = tuple(sample_partitions(200, sg, 10, g) for sg in (1.0, 4.0, 16.0, 64.0))
    spec = AttentionSpec(Method.POSLSH, [1.0, 4.0, 16.0, 64.0], causal, partitions=parts)
    ref = attend(q, k, v, spec, backend="reference")
    torch.testing.assert_close(attend(q, k, v, spec, backend="dense"), ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(attend(q, k, v, spec, backend="blocks"), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("window", [None, [1, 3, 9, 400]])
def test_dense_and_rank1_alibi_equal_the_reference_with_gradients(window):
    """Causal exact ALiBi as one extra q/k coordinate (rank1) and as a dense bias: outputs and
    gradients equal the float64 reference."""
    sig = [0.5, 2.0, 8.0, 64.0]
    backends = ["dense"] + (["rank1"] if window is None else [])
    q, k, v = qkv(n=70, grad=True)
    method = Method.EXACT if window is None else Method.WINDOWED
    spec = AttentionSpec(method, sig, True, window=None if window is None else tuple(window))
    ref = attend(q, k, v, spec, backend="reference")
    gref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for b in backends:
        out = attend(q, k, v, spec, backend=b)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-11)
        for a, r in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), gref):
            torch.testing.assert_close(a, r, rtol=0, atol=1e-10)


@pytest.mark.parametrize("n", [256, 1024])
def test_rank1_float32_error_follows_its_precision_bound(n):
    """Float32 rank-one ALiBi: within twice the naive float32 error plus the rounding of its
    logit offset, eps * max_h m_h (n-1)/2, carried to the output by at most max |v|."""
    from poslsh_cli.attention import laplacian_weight

    q, k, v = qkv(B=1, H=8, n=n, d=16)
    sig = torch.as_tensor(alibi_sigmas(8))
    w = laplacian_weight(n, sig)
    ref, _ = reference_attention(q, k, v, w, True)
    naive, _ = reference_attention(q.float(), k.float(), v.float(), w, True, dtype=torch.float32)
    eps = torch.finfo(torch.float32).eps
    offset = float((1 / sig).max()) * (n - 1) / 2
    tol = 2 * (naive.double() - ref).abs().max().item() + 2 * eps * offset * v.abs().max().item()
    err = (A.alibi_rank1(q.float(), k.float(), v.float(), sig).double() - ref).abs().max().item()
    assert err <= tol, (err, tol)


def test_the_plan_picks_the_training_paths_by_length_and_gradient():
    def backend(method, n, causal=True, grad=True, dtype=torch.float32):
        return choose(method, device="cpu", dtype=dtype, n=n, causal=causal, grad=grad).backend

    assert backend(Method.EXACT, 64) is Backend.DENSE
    assert backend(Method.EXACT, A.RANK1_MIN_N) is Backend.RANK1
    assert backend(Method.EXACT, A.RANK1_MIN_N, causal=False) is Backend.DENSE
    assert backend(Method.EXACT, A.RANK1_MIN_N, dtype=torch.bfloat16) is Backend.DENSE
    assert backend(Method.WINDOWED, 64) is Backend.DENSE
    assert backend(Method.POSLSH, 64) is Backend.DENSE
    assert backend(Method.POSLSH, A.DENSE_MAX_N + 1, causal=False) is Backend.BLOCKS
    assert backend(Method.POSLSH, A.DENSE_MAX_N, causal=False) is Backend.DENSE
    # causal: where exact ALiBi trains in O(n) memory (rank1), the others leave the dense bias too
    assert backend(Method.POSLSH, A.RANK1_MIN_N - 1) is Backend.DENSE
    assert backend(Method.POSLSH, A.RANK1_MIN_N) is Backend.BLOCKS
    assert backend(Method.WINDOWED, A.RANK1_MIN_N) is Backend.CHUNKED
    assert backend(Method.FIXED_BLOCK, A.RANK1_MIN_N) is Backend.BLOCKS
    # inference: the dense bias at training lengths (one attention whatever s), the memory-light paths beyond
    # (without the masks' work the s threshold; attend() weighs blocks against union: tests/test_union.py)
    assert backend(Method.POSLSH, 64, grad=False) is Backend.DENSE
    assert backend(Method.POSLSH, A.INFER_DENSE_MAX_N, grad=False) is Backend.BLOCKS
    assert backend(Method.EXACT, 64, grad=False) is Backend.RANK1  # the fastest exact path, causal or not
    assert backend(Method.EXACT, 64, grad=False, causal=False) is Backend.RANK1
    assert backend(Method.EXACT, 64, grad=False, dtype=torch.bfloat16) is Backend.CHUNKED
    with pytest.raises(ValueError, match="no backend 'rank1'"):
        choose(Method.POSLSH, device="cpu", dtype=torch.float32, n=64, causal=True, grad=True, backend="rank1")


# ---------------------------------------------------------------------------------------------
# position schemes inside a transformers model


ARCH = Arch(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, head_dim=8, max_positions=512)


@pytest.mark.parametrize("position", list(Position))
def test_every_scheme_matches_its_float64_reference_inside_the_model(position):
    """The installed attention on its chosen path against the dense float64 reference path (rope:
    the architecture's own SDPA attention against its eager attention). In a float64 model both
    give the same logits to 1e-10 (float64 in, float64 out; not checked for rope, whose two
    attention implementations in transformers differ by about 1e-7 there). In float32 the chosen path may add no
    more error than float32 rounding already puts into the model: its distance to the float64
    model is at most twice that of the reference path run in float32, plus 64 float32 ulps of the
    largest logit."""
    import copy

    state = PositionState(position, alibi_sigmas(4), s=5, seed=3)
    model = build_model(ARCH, state, seed=0).eval()
    x = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))

    def logits(m, path):
        if position is Position.ROPE:
            m.set_attn_implementation(path)
        else:
            state.backend = path
        with torch.no_grad():
            return m(input_ids=x).logits

    fast_path, ref_path = ("sdpa", "eager") if position is Position.ROPE else ("auto", "reference")
    if position is Position.ROPE:
        assert model.config._attn_implementation == "sdpa"
    else:
        assert model.config.poslsh["position"] == position.value
    wide = copy.deepcopy(model).double()
    ref64 = logits(wide, ref_path)
    if position is not Position.ROPE:  # transformers' own SDPA and eager attention differ by ~1e-7 in float64
        torch.testing.assert_close(logits(wide, fast_path), ref64, rtol=0, atol=1e-10)
    fast32, ref32 = logits(model, fast_path), logits(model, ref_path)
    assert fast32.dtype == torch.float32
    rounding = (ref32.double() - ref64).abs().max().item()
    ulps = 64 * torch.finfo(torch.float32).eps * ref64.abs().max().item()
    assert (fast32.double() - ref64).abs().max().item() <= 2 * rounding + ulps, (rounding, ulps)


@pytest.mark.parametrize("position", [Position.POSLSH, Position.WINDOWED])
def test_a_short_training_run_has_the_same_losses_on_the_recomputing_path_as_on_the_dense_one(position):
    """Issue 18: the same model, masks and batches trained 6 AdamW steps through the block (or
    banded) path with its own backward and through one dense attention with log M~: the losses agree
    to float32 rounding (amplified a little by the steps)."""
    def losses(backend):
        state = PositionState(position, alibi_sigmas(4), s=5, seed=11, backend=backend)
        model = build_model(ARCH, state, seed=0).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        out = []
        for step in range(1, 7):
            state.step = step
            x = torch.randint(0, 256, (2, 161), generator=g)
            logits = model(input_ids=x[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return np.asarray(out), state.plans

    sparse = "blocks" if position is Position.POSLSH else "chunked"
    a, plans_a = losses(sparse)
    b, plans_b = losses("dense")
    assert plans_a == {f"{sparse}/fused"} and plans_b == {"dense"}
    np.testing.assert_allclose(a, b, rtol=2e-5)


def test_poslsh_masks_are_fresh_each_step_and_replay():
    state = PositionState(Position.POSLSH, alibi_sigmas(4), s=3, seed=7)
    state.step = 1
    a = state.attention_spec(0, 50, None).partitions
    state.step = 2
    b = state.attention_spec(0, 50, None).partitions
    state.step, state._cache = 1, {}
    c = state.attention_spec(0, 50, None).partitions
    assert not np.array_equal(a[0].widths, b[0].widths)
    assert all(np.array_equal(x.widths, y.widths) and np.array_equal(x.shifts, y.shifts) for x, y in zip(a, c))


# ---------------------------------------------------------------------------------------------
# data and evaluation windows


def test_eval_windows_predict_every_byte_once():
    tokens = np.arange(1000) % 256
    assert count_predicted(tokens, 100) == 10 * 99  # non-overlapping: all but each window's first
    seen = np.zeros(1000, int)
    start = 0
    for i, w in enumerate(eval_windows(tokens, 100, stride=25)):
        seen[start + w.score_from:start + 100] += 1
        start += 25
    assert seen[0] == 0 and (seen[1:start + 75] == 1).all()


# ---------------------------------------------------------------------------------------------
# poslsh train end to end (perplexity: tests/test_perplexity.py; step-bench: tests/test_step_bench.py)


def test_train_writes_cells_metrics_and_loadable_checkpoints(trained):
    from transformers import AutoModelForCausalLM

    df = pd.read_csv(trained / "results.csv")
    assert list(df.position) == ["none", "alibi", "poslsh", "fixed_block", "windowed", "rope"]
    assert (df.s == [0, 0, 3, 0, 0, 0]).all() and (df.val_bpb > 0).all() and (df.val_bpb < 9).all()
    meta = json.loads((trained / "meta.json").read_text())
    assert len(meta["corpus"]["sha256"]) == 64 and meta["corpus"]["source"] == "builtin"
    for r in df.itertuples():
        final = trained / r.checkpoint
        m = pd.read_csv(final.parent / "metrics.csv")
        # eval_every=3, but at least five evaluations in a stage: every step of six
        assert list(m.step) == [1, 2, 3, 4, 5, 6] and m.val_bpb.notna().sum() == 6
        assert (final.parent / "checkpoints" / "step-00000004" / "optimizer.pt").exists()
        # transformers loads it through the modeling files saved beside it (plain loading refuses: test_serving.py)
        model = AutoModelForCausalLM.from_pretrained(final, local_files_only=True, trust_remote_code=True)
        assert model.config.poslsh["position"] == r.position
        model2, state = load_model(final)
        assert state.position.value == r.position
        info = train_info(final)  # the typed record a training cell hands to evaluation, its layout recorded
        assert info.recorded and info.schema == TRAIN_INFO_SCHEMA and info.position == r.position
        assert (info.s, info.seq_len, info.steps, info.step) == (r.s, 32, 6, 6)
        # the scheme is saved once, in config.json; the record does not repeat it
        record = json.loads((final / "poslsh_train.json").read_text())
        assert not {"scheme", "position", "s"} & set(record) and info.scheme.to_json() == state.to_json()
    assert poslsh("plot", trained).exit_code == 0 and (trained / "figures" / "learning_curves.png").exists()


def test_the_train_record_of_every_layout_reads_as_one_type(tmp_path):
    """poslsh_train.json of layout 1 (no ``schema``), exactly as a checkpoint of the running registered
    experiment holds it, reads as a TrainInfo; a field missing or null takes the default every reader
    assumed, a count written as a float or text reads as its integer; the record round-trips through
    its files in layout 3 (the scheme in config.json alone); a newer layout, or a value of the wrong
    kind, is one error line; a checkpoint poslsh did not train (no file, or an empty record) has none
    (``recorded`` False)."""
    from poslsh_cli.core.errors import ConfigError

    layout1 = {"position": "alibi", "s": 0, "seed": 100, "seq_len": 256, "steps": 2400, "data": "builtin",
               "data_sha256": "0213d97886423f4450957ad9167d416823b774abd11ce5c42ffcfb294a1d5e75",
               "val_fraction": 0.1, "val_every": 10, "data_field": "text", "encoding": "utf-8", "attn_dropout": 0.0,
               "init": None, "tokenizer": "bytes", "lora_rank": 0,
               "scheme": {"position": "alibi", "sigmas": [8.0] * 8, "s": 0, "window_sigmas": 4.0, "seed": 100,
                          "backend": "auto"},
               "trainable": 820480, "world_size": 1, "step": 2400}
    info = TrainInfo.of(layout1)
    assert info.recorded and info.schema == 1 and (info.seed, info.seq_len, info.steps, info.step) == (100, 256, 2400, 2400)
    assert info.sigmas == [8.0] * 8 and info.init is None and info.data_sha256.startswith("0213d9")
    assert (info.position, info.s, info.scheme.seed) == ("alibi", 0, 100)
    sparse = TrainInfo.of({"seq_len": 256.0, "position": "poslsh", "s": "10", "seed": None, "init": None})
    assert (sparse.seq_len, sparse.s, sparse.seed, sparse.val_every, sparse.encoding, sparse.attn_dropout) == \
        (256, 10, -1, 10, "utf-8", 0.0) and isinstance(sparse.seq_len, int)
    (tmp_path / "poslsh_train.json").write_text(json.dumps(info.to_json()))
    assert "scheme" not in info.to_json() and "scheme" in dataclasses.replace(info, adapter_of="base").to_json()
    (tmp_path / "config.json").write_text(json.dumps({"poslsh": info.scheme.to_json()}))
    again = train_info(tmp_path)
    assert again.schema == TRAIN_INFO_SCHEMA == 3 and again == dataclasses.replace(info, schema=3)
    assert again.scheme.to_json() == info.scheme.to_json()
    for bad, needle in (({"schema": 4}, "layout 4, newer than"), ({"seq_len": 2.5}, "not a whole number"),
                        ({"seed": "x"}, "seed='x' is not of type int"), ({"scheme": [1]}, "is not of type dict")):
        with pytest.raises(ConfigError, match=needle):
            TrainInfo.of(bad)
    # an adapter saved alone keeps its scheme in the record, an ALiBi base's own attention (native) included
    native = {"position": "alibi", "sigmas": [1.0, 2.0], "s": 0, "native": True, "layout": 2}
    adapter = TrainInfo.of({"schema": 3, "adapter_of": "base", "scheme": native})
    assert adapter.scheme.native and adapter.to_json()["scheme"]["native"] is True
    assert TrainInfo.of({"position": "poslsh", "s": None}).s == 0  # a null count takes its default
    for foreign in (train_info(tmp_path / "elsewhere"), TrainInfo.of({})):
        assert not foreign.recorded and (foreign.seed, foreign.seq_len, foreign.s) == (-1, 0, 0)


def test_the_overfitting_gap_uses_the_final_weights_on_the_training_split(trained):
    """train_eval_loss is the final weights evaluated on eval_tokens spread over the whole training
    split (like the validation documents over the corpus): recomputed here from the saved
    checkpoint, and the report's overfitting table uses it, with a t-interval over seeds."""
    from poslsh_cli.lm.windows import spread_sample
    from poslsh_cli.experiments.train.report import overfitting_table
    from poslsh_cli.lm.evaluate import evaluate

    df = registry.get("train").migrate(pd.read_csv(trained / "results.csv"))  # as the report receives them
    assert df.train_eval_loss.notna().all() and (df.train_eval_loss > 0).all()
    assert (df.train_eval_sample == "spread").all()
    cfg = __import__("yaml").safe_load((trained / "config.yaml").read_text())
    corpus = load_corpus("builtin", cfg["val_fraction"])
    for r in df[df.position.isin(["alibi", "poslsh"])].itertuples():
        model, state = load_model(trained / r.checkpoint)
        sample = spread_sample(corpus.train, int(r.seq_len), cfg["eval_tokens"])
        assert len(sample) == cfg["eval_tokens"] // int(r.seq_len) * int(r.seq_len)
        assert sample[-1] == corpus.train[-1] and sample[0] == corpus.train[0]  # it spans the whole split
        ev = evaluate(model.float(), state, sample, int(r.seq_len))
        assert ev.loss == pytest.approx(r.train_eval_loss, rel=1e-5)
    table = overfitting_table(df)
    assert table["train measured by"].str.startswith("final weights, spread").all()
    row = table[table.scheme == "alibi"].iloc[0]
    assert row["gap"] == pytest.approx((df[df.position == "alibi"].val_loss.iloc[0]
                                        - df[df.position == "alibi"].train_eval_loss.iloc[0]) / math.log(2), abs=1e-4)
    assert row["gap 95% over seeds"] == "no interval (1 seed)"
    # three seeds: the t-interval of the per-seed gaps
    three = pd.concat([df[df.position == "alibi"].assign(seed=k, val_loss=df[df.position == "alibi"].val_loss + 0.01 * k)
                       for k in range(3)])
    gaps = (three.val_loss - three.train_eval_loss) / math.log(2)
    from poslsh_cli.verdicts.stats import t_interval

    iv = t_interval(gaps.to_numpy())
    assert overfitting_table(three).iloc[0]["gap 95% over seeds"] == f"[{iv.low:+.4f}, {iv.high:+.4f}]"
    # runs that scored the first tokens, or recorded nothing, say so
    first = overfitting_table(df.assign(train_eval_sample=float("nan")))
    assert first["train measured by"].str.contains("first eval_tokens").all()
    old = overfitting_table(df.drop(columns=["train_eval_loss"]))
    assert old["train measured by"].str.startswith("loss of the last tenth of steps").all()


@pytest.mark.parametrize("args,needle", [
    (["position=[magic]"], "unknown position 'magic'"),
    (["position=[poslsh]", "s=[0]"], "s must be >= 1, got 0"),
    (["data={tmp}/missing.txt"], "no such file"),
    (["data={tmp}/empty.txt"], "the text is empty"),
    (["data={tmp}/short.txt"], "fewer than one window"),
    (["init={tmp}"], "no config.json"),
    (["pretrain=rope"], "pretrain= needs pretrain_steps >= 1"),
    (["heads=4", "kv_heads=3"], "not a multiple of kv_heads"),
])
def test_train_bad_input_is_one_line_and_writes_nothing(tmp_path, args, needle):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("too short for one window of 32 bytes")
    out = tmp_path / "out"
    r = poslsh("train", *TRAIN, "steps=2", *[a.format(tmp=tmp_path) for a in args], f"out={out}")
    assert r.exit_code == 2, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.slow
def test_killed_training_resumes_to_the_same_weights_and_losses(tmp_path):
    """SIGKILL half-way (no chance to clean up), start again: it continues from the last
    checkpoint and ends with the uninterrupted run's losses and weights, bit for bit (CPU)."""
    from safetensors.torch import load_file

    args = [*TRAIN, "position=[poslsh]", "s=[4]", "steps=12", "eval_every=4", "checkpoint_every=3"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "poslsh_cli", "train", *args]
    ref = subprocess.run(cmd + [f"out={tmp_path / 'ref'}"], capture_output=True, env=env, timeout=600)
    assert ref.returncode == 0, ref.stderr.decode()
    proc = subprocess.Popen(cmd + [f"out={tmp_path / 'cut'}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    metrics = None
    deadline = time.time() + 300
    while time.time() < deadline:
        found = list((tmp_path / "cut" / "work").glob("*/metrics.csv")) if (tmp_path / "cut" / "work").exists() else []
        if found and len(found[0].read_text().splitlines()) >= 9:  # header + 8 steps: past the step-6 checkpoint
            metrics = found[0]
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert metrics is not None
    res = subprocess.run(cmd + [f"out={tmp_path / 'cut'}"], capture_output=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr.decode()
    a = pd.read_csv(next((tmp_path / "ref" / "work").glob("*/metrics.csv")))
    b = pd.read_csv(metrics)
    assert list(b.step) == list(range(1, 13))
    pd.testing.assert_frame_equal(a[["step", "loss", "val_loss"]], b[["step", "loss", "val_loss"]])
    wa = load_file(next((tmp_path / "ref" / "work").glob("*/final/model.safetensors")))
    wb = load_file(next((tmp_path / "cut" / "work").glob("*/final/model.safetensors")))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = pd.read_csv(tmp_path / "ref" / "results.csv"), pd.read_csv(tmp_path / "cut" / "results.csv")
    assert ra.val_loss.iloc[0] == rb.val_loss.iloc[0]


def test_a_run_grows_by_seeds_added_keeping_its_cells_and_equal_to_a_run_made_with_them(tmp_path):
    """Seeds appended to a finished run's list (the power calculation asked for more) add their cells:
    the cells made stay as they are, the new ones equal those of a run made with every seed at once, and
    config.yaml holds the grown list, meta.json what was added. With a steps sweep the cells made move in
    the grid (seed 1's short run comes before seed 0's long one): the tables are in the order of a run
    made with every seed. Any other change is still a different configuration."""
    from poslsh_cli.store.readers import results

    args = [*TRAIN, "position=[alibi]", "steps=[1,2]"]
    out, ref = tmp_path / "grown", tmp_path / "ref"
    assert poslsh("train", *args, "seed=[0]", f"out={out}").exit_code == 0
    first = {p.name: json.loads(p.read_text()) for p in (out / "cells").iterdir()}
    r = poslsh("train", *args, "seed=[0,1]", f"out={out}")
    assert r.exit_code == 0, r.stderr
    assert "seed 1 added" in r.stderr and "2/4 cells already done" in r.stderr, r.stderr
    for name, cell in first.items():  # the same models and rows, only their place in the grid updated
        now = json.loads((out / "cells" / name).read_text())
        assert {k: v for k, v in now.items() if k != "index"} == {k: v for k, v in cell.items() if k != "index"}
    assert "seed:\n- 0\n- 1" in (out / "config.yaml").read_text()
    assert json.loads((out / "meta.json").read_text())["grown"] == [{"seed": [1]}]
    assert poslsh("train", *args, "seed=[0,1]", f"out={ref}").exit_code == 0
    cols = ["seed", "steps", "train_loss", "val_loss"]
    a, b = pd.read_csv(out / "results.csv"), pd.read_csv(ref / "results.csv")
    assert list(zip(a.steps, a.seed)) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    pd.testing.assert_frame_equal(a[cols], b[cols])
    pd.testing.assert_frame_equal(results(out)[cols], results(ref)[cols])  # the readers' order: by the cells' index
    for other in ("seed=[1,0,2]", "seed=[0]"):  # reordered, or fewer: not a growth
        r = poslsh("train", *args, other, f"out={out}")
        assert r.exit_code == 2 and "different configuration" in r.stderr and "seed: [0, 1] ->" in r.stderr, r.stderr
    # the shorter command after the run grew (perhaps interrupted before the new cells): how to resume it
    assert "it holds seed=[0, 1], [1] beyond the list asked for: resume with 'seed=[0,1]'" in r.stderr, r.stderr
    r = poslsh("train", *args, "seed=[0]", "lr=0.5", f"out={out}")  # another change too: no such advice
    assert r.exit_code == 2 and "resume with" not in r.stderr and "use another out=" in r.stderr, r.stderr


def test_seeds_past_the_first_train_only_the_sized_schemes_and_a_finished_run_grows_by_them(tmp_path):
    """The sized comparisons' extra seeds (THEORY, "Power and the error rate the verdicts share"): with
    all_seeds and first_seeds, the seeds past the first first_seeds train only the schemes named (a
    position, poslsh:S for one s, alibi+dropout for the control). A finished run made with every scheme
    at its seeds grows by them, its cells kept, equal to a run made with those keys at once; a choice
    that would drop a finished seed's models is a different configuration; a name the run does not
    train is one error line."""
    from poslsh_cli.experiments.train.command import cells
    from poslsh_cli.app.registry import compose_spec, get

    spec = compose_spec(get("train"), ["position=[none,alibi,poslsh]", "s=[10,100]", "seed=[0,1,2,3]",
                                       "attn_dropout=[0.0,0.1]", "first_seeds=3", "all_seeds=[alibi,poslsh:100]"])
    got = {(c["seed"], c["position"], c["s"], c.get("attn_dropout", 0.0)) for c in cells(spec)}
    every = {(p, s, d) for p, s, d in [("none", 0, 0.0), ("alibi", 0, 0.0), ("poslsh", 10, 0.0),
                                       ("poslsh", 100, 0.0), ("alibi", 0, 0.1)]}
    assert got == {(seed, *m) for seed in (0, 1, 2) for m in every} | {(3, "alibi", 0, 0.0), (3, "alibi", 0, 0.1),
                                                                      (3, "poslsh", 100, 0.0)}
    for names, second in ((["alibi+dropout"], [0.1]), (["alibi"], [0.0, 0.1])):  # a position: its control too
        spec = compose_spec(get("train"), ["position=[alibi,none]", "seed=[0,1]", "attn_dropout=[0.0,0.1]",
                                           f"all_seeds=[{','.join(names)}]"])
        got = [(c["seed"], c["position"], c.get("attn_dropout", 0.0)) for c in cells(spec)]
        assert [g for g in got if g[0] == 1] == [(1, "alibi", d) for d in second], got
        assert len(got) - len(second) == 3  # seed 0: alibi, none, the control

    args = [*TRAIN, "position=[alibi,poslsh]", "s=[1,2]", "steps=2"]
    out, ref = tmp_path / "grown", tmp_path / "ref"
    assert poslsh("train", *args, "seed=[0]", f"out={out}").exit_code == 0
    first = {p.name: json.loads(p.read_text()) for p in (out / "cells").iterdir()}
    sized = ["seed=[0,1]", "first_seeds=1", "all_seeds=[alibi,poslsh:2]"]
    r = poslsh("train", *args, *sized, f"out={out}")
    assert r.exit_code == 0, r.stderr
    assert "seed 1 added" in r.stderr and "3/5 cells already done" in r.stderr, r.stderr
    for name, cell in first.items():
        now = json.loads((out / "cells" / name).read_text())
        assert {k: v for k, v in now.items() if k != "index"} == {k: v for k, v in cell.items() if k != "index"}
    assert poslsh("train", *args, *sized, f"out={ref}").exit_code == 0
    cols = ["position", "s", "seed", "train_loss", "val_loss"]
    a, b = pd.read_csv(out / "results.csv"), pd.read_csv(ref / "results.csv")
    assert sorted(zip(a.seed, a.position, a.s)) == [(0, "alibi", 0), (0, "poslsh", 1), (0, "poslsh", 2),
                                                    (1, "alibi", 0), (1, "poslsh", 2)]
    pd.testing.assert_frame_equal(a[cols], b[cols])
    assert poslsh("train", *args, *sized, f"out={out}").exit_code == 0  # resumed as grown: nothing to do
    # choices that would drop a finished seed's models: the grown run's seed 1 has no s=1 model, so a third seed
    # cannot move first_seeds; a run with every scheme at seeds 0 and 1 cannot take first_seeds=1; all_seeds
    # cannot change without seeds added
    two = tmp_path / "two"
    assert poslsh("train", *args, "seed=[0,1]", f"out={two}").exit_code == 0
    for run, keys in ((out, ["seed=[0,1,2]", "first_seeds=2", "all_seeds=[alibi,poslsh:2]"]),
                      (two, ["seed=[0,1,2]", "first_seeds=1", "all_seeds=[alibi]"]),
                      (out, ["seed=[0,1]", "first_seeds=1", "all_seeds=[alibi]"])):
        r = poslsh("train", *args, *keys, f"out={run}")
        assert r.exit_code == 2 and "different configuration" in r.stderr, (keys, r.stderr)
    r = poslsh("train", *args, "seed=[0,1,2]", "first_seeds=2", "all_seeds=[alibi]", f"out={two}")
    assert r.exit_code == 0 and "seed 2 added" in r.stderr and "6/7 cells already done" in r.stderr, r.stderr
    grown = ["seed=[0,1,2]", "first_seeds=1", "all_seeds=[alibi,poslsh:2]"]  # the sized run grows again
    r = poslsh("train", *args, *grown, f"out={out}")
    assert r.exit_code == 0 and "seed 2 added" in r.stderr and "5/7 cells already done" in r.stderr, r.stderr
    r = poslsh("train", *args, "seed=[0]", f"out={out}")  # the command it started from: how to resume it
    assert r.exit_code == 2 and "resume with 'seed=[0,1,2] all_seeds=[alibi,poslsh:2]'" in r.stderr, r.stderr
    for bad, said in (("all_seeds=[poslsh:7]", "names an s the run does not train"),
                      ("all_seeds=[bogus]", "unknown scheme 'bogus'"),
                      ("all_seeds=[rope]", "rope is not among the run's positions"),
                      ("all_seeds=[alibi+dropout]", "attention-dropout control the run does not train"),
                      ("all_seeds=[alibi:5]", "alibi draws no masks, so it has no s"),
                      ("all_seeds=[poslsh:x]", "names an s the run does not train"),
                      ("all_seeds=[]", "all_seeds must not be empty")):
        r = poslsh("train", *args, "seed=[0,1]", bad, f"out={tmp_path / 'bad'}")
        assert r.exit_code == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "bad").exists()


def test_a_warm_up_as_long_as_training_is_said_on_stderr(tmp_path):
    """warmup= at least the steps leaves no cosine decay (the schedule warms up over all but the last step):
    one line says so, and how to ask for a fraction; a shorter warm-up says nothing."""
    args = [*TRAIN, "position=[alibi]", "steps=4"]
    r = poslsh("train", *args, "warmup=6", f"out={tmp_path / 'a'}")
    assert r.exit_code == 0 and "warmup=6 is not shorter than steps=4: the learning rate warms up over 3 steps and " \
        "does not decay" in r.stderr, r.stderr
    r = poslsh("train", *args, f"out={tmp_path / 'b'}")  # TRAIN's warmup=2
    assert r.exit_code == 0 and "warmup=" not in r.stderr, r.stderr


def test_finetuning_shares_one_pretraining_stage(tmp_path):
    out = tmp_path / "ft"
    r = poslsh("train", *TRAIN, "position=[alibi,fixed_block]", "pretrain=rope", "pretrain_steps=3", "steps=2",
               "eval_every=0", f"out={out}")
    assert r.exit_code == 0, r.output
    stages = sorted(p.name for p in (out / "work").iterdir())
    assert sum(name.startswith("pretrain-rope-seed0") for name in stages) == 1
    df = pd.read_csv(out / "results.csv")
    assert (df.pretrain == "rope").all()
    info = json.loads((out / df.checkpoint.iloc[0] / "poslsh_train.json").read_text())
    assert info["init"].endswith("pretrain-rope-seed0/final")


def test_finetuning_continues_the_batch_stream_instead_of_replaying_pretraining(tmp_path, monkeypatch):
    """A fine-tune after pretrain_steps=N draws the batches of global steps N+1.., not the first
    ones again (every cell the same batches, so cells stay paired), and ``passes`` counts both."""
    import poslsh_cli.lm.windows as windows

    seen = []
    real = windows.train_batch

    def spy(tokens, seq_len, batch, generator):
        out = real(tokens, seq_len, batch, generator)
        seen.append(out.tobytes())
        return out

    monkeypatch.setattr(windows, "train_batch", spy)
    out = tmp_path / "ft"
    r = poslsh("train", *TRAIN, "position=[alibi,fixed_block]", "pretrain=rope", "pretrain_steps=3", "steps=3",
               "eval_every=0", f"out={out}")
    assert r.exit_code == 0, r.output
    assert len(seen) == 9
    pre, first, second = seen[:3], seen[3:6], seen[6:]
    assert first == second  # the two fine-tuning cells see the same data
    assert not set(first) & set(pre), "fine-tuning replays pretraining batches"
    df = pd.read_csv(out / "results.csv")
    corpus = load_corpus("builtin")
    np.testing.assert_allclose(df.passes, (3 + 3) * 4 * 32 / len(corpus.train))


def test_attention_dropout_runs_replay(tmp_path):
    """The regulariser control is reproducible: dropout masks are drawn from a generator seeded per
    step, so the same command gives the same losses, and they differ from the run without dropout."""
    def losses(name, p):
        out = tmp_path / name
        r = poslsh("train", *TRAIN, "position=[alibi]", f"attn_dropout=[{p}]", "dropout_positions=[alibi]",
                   "steps=4", "eval_every=4", "checkpoint_every=100", f"out={out}")
        assert r.exit_code == 0, r.output
        df = pd.read_csv(out / "results.csv")
        assert list(df.attn_dropout) == [p]
        return pd.read_csv((out / df.checkpoint.iloc[0]).parent / "metrics.csv").loss.to_numpy()

    a, b, plain = losses("a", 0.5), losses("b", 0.5), losses("plain", 0.0)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a[1:], plain[1:])


def test_a_steps_sweep_trains_each_length_with_its_own_schedule(tmp_path):
    """steps=[3,6] trains a model per length, each with its own warm-up (warmup_fraction of its
    steps) and its own cosine decay ending at 10% of lr at its last step; the shorter ones first, and
    the run with one length keeps its cells' keys (no ``steps``)."""
    from poslsh_cli.experiments.train.stage import learning_rate
    from poslsh_cli.experiments.train.command import cells

    r = poslsh("train", *TRAIN, "position=[alibi]", "steps=[3,6]", "warmup_fraction=0.34", "eval_every=3",
               "checkpoint_every=100", "lr=0.01", f"out={tmp_path}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "results.csv").sort_values("steps")
    assert list(df.steps) == [3, 6]
    for _, row in df.iterrows():
        m = pd.read_csv((tmp_path / row.checkpoint).parent / "metrics.csv")
        assert len(m) == row.steps
        lrs = m.lr.to_numpy()
        warm = round(0.34 * row.steps)
        assert lrs.argmax() == warm - 1 and lrs[warm - 1] == pytest.approx(0.01)
        assert lrs[-1] == pytest.approx(0.001)
    spec = registry.compose_spec(registry.experiments()["train"], ["steps=[6,3]", "position=[alibi]"])
    assert [k["steps"] for k in cells(spec)] == [3, 6]
    assert all("steps" not in k for k in cells(registry.compose_spec(registry.experiments()["train"], ["steps=5"])))
    assert learning_rate(registry.compose_spec(registry.experiments()["train"], ["steps=5", "warmup=2"]), 2, 5) == pytest.approx(2e-3)


def test_constant_sigma_accuracy_metrics_and_the_sliding_protocol(tmp_path):
    """sigma= gives every head of every scheme one bandwidth (recorded, and used again by
    perplexity); train and perplexity report the accuracy metrics; protocol=[nonoverlapping,sliding]
    evaluates the same models both ways beyond L (sliding: windows stepped by L, their last L tokens
    scored) and once at L, and the report puts both side by side."""
    out = tmp_path / "run"
    r = poslsh("train", *TRAIN, "position=[alibi,poslsh]", "s=[3]", "steps=4", "sigma=2", f"out={out}")
    assert r.exit_code == 0, r.output
    res = pd.read_csv(out / "results.csv")
    assert set(res.sigmas) == {"sigma=2 every head"}
    assert ((res.val_top1 > 0) & (res.val_top1 <= res.val_top10) & (res.val_top10 <= res.val_top100)).all()
    assert ((res.val_mrr >= res.val_top1) & (res.val_mrr <= 1) & (res.val_entropy > 0)).all()
    for ck in res.checkpoint:
        assert train_info(out / ck).sigmas == [2.0] * 4
    ppl = tmp_path / "ppl"
    r = poslsh("perplexity", out, "lengths=[32,64]", "protocol=[nonoverlapping,sliding]", "trials=1",
               "max_tokens=1024", f"out={ppl}")
    assert r.exit_code == 0, r.output
    p = pd.read_csv(ppl / "results.csv")
    assert set(p.sigmas) == {"sigma=2 every head"}
    # at L one row (the protocols score the same windows), beyond it one per protocol
    assert set(p[p.length == 32].protocol) == {"nonoverlapping"}
    long = p[p.length == 64].set_index(["position", "protocol"])
    assert len(long) == 4
    windows = 1024 // 32 - 1  # windows of 64 stepped by 32 over 1024 tokens
    assert (long.xs("sliding", level="protocol").tokens == windows * 32).all()
    assert (long.xs("nonoverlapping", level="protocol").tokens == (1024 // 64) * 63).all()
    assert ((p[["top1", "top10", "top100", "mrr"]] > 0) & (p[["top1", "top10", "top100", "mrr"]] <= 1)).all(axis=None)
    r = poslsh("report", ppl)
    md = (ppl / "report.md").read_text()
    assert r.exit_code == 0 and "sliding bpb" in md and "top-1 %" in md
    assert "reaches the top-1 accuracy of exact ALiBi" in md
    # stride and protocol=sliding both choose windows
    r = poslsh("perplexity", out, "stride=16", "protocol=[sliding]", f"out={tmp_path / 'bad'}")
    assert r.exit_code == 2 and "give one" in r.stderr and not (tmp_path / "bad").exists()


def _tensorboard_scalars(cell):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(cell / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_records(path):
    """The protobuf records of a W&B run file: a 7-byte header, then LevelDB-log chunks (a 7-byte
    chunk header: CRC, length, kind full/first/middle/last) in blocks of 32 KiB."""
    import struct

    data, pos, block, part = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 1:
            yield chunk
        elif kind in (2, 3):
            part = (b"" if kind == 2 else part) + chunk
        elif kind == 4:
            yield part + chunk


def _wandb_history(cell):
    """The history rows of the offline W&B run files of a cell (step -> logged values)."""
    from wandb.proto import wandb_internal_pb2

    files = []
    for f in sorted((cell / "wandb").glob("offline-run-*/run-*.wandb")):
        rows = {}
        for data in _wandb_records(f):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                assert int(items["_step"]) not in rows
                rows[int(items["_step"])] = items
        files.append(rows)
    return files


@pytest.mark.parametrize("logger", ["tensorboard", pytest.param("wandb", marks=pytest.mark.slow)])
def test_experiment_tracking_logs_every_step_once_across_a_resume(tmp_path, monkeypatch, logger):
    """logger=tensorboard|wandb: every logged step of metrics.csv, with its values, in the tracker's
    own files; a run cut after step 5 and resumed from its step-3 checkpoint logs steps 4.. again:
    TensorBoard purges the cut attempt's later events (each step once), W&B continues the same run
    id (the steps it already has are the same numbers: CPU training replays bit for bit)."""
    pytest.importorskip(logger)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    args = ["train", *TRAIN, "position=[alibi]", "steps=6", "eval_every=3", "checkpoint_every=3", f"logger={logger}",
            f"out={out}"]
    from poslsh_cli.core import files

    monkeypatch.setattr(files, "_FAULT_COUNTS", {})  # the fault fires at its first pass in this process
    monkeypatch.setenv("POSLSH_FAULT", "step:5")
    monkeypatch.setenv("POSLSH_FAULT_SIGNAL", "RAISE")
    assert poslsh(*args).exit_code != 0
    monkeypatch.delenv("POSLSH_FAULT")
    r = poslsh(*args)
    assert r.exit_code == 0, r.output
    cell = next((out / "work").glob("*/metrics.csv")).parent
    m = pd.read_csv(cell / "metrics.csv")
    assert list(m.step) == list(range(1, 7))
    if logger == "tensorboard":
        got = _tensorboard_scalars(cell)
        assert [s for s, _ in got["loss"]] == list(range(1, 7))
        assert np.allclose([v for _, v in got["loss"]], m.loss, rtol=1e-6)
        val = m.dropna(subset=["val_bpb"])
        assert [s for s, _ in got["val_bpb"]] == list(val.step)
    else:
        first, resumed = _wandb_history(cell)  # the cut attempt, then the resumed one (same run id)
        assert sorted(first) == [1, 2, 3, 4, 5] and sorted(resumed) == [4, 5, 6]
        hist = {**first, **resumed}
        assert np.allclose([hist[s]["loss"] for s in range(1, 7)], m.loss, rtol=1e-6)
        assert np.allclose([first[s]["loss"] for s in (4, 5)], [resumed[s]["loss"] for s in (4, 5)], rtol=1e-6)
        assert len({f.parent.name.rsplit("-", 1)[-1] for f in (cell / "wandb").glob("offline-run-*/run-*.wandb")}) == 1
    res = poslsh("train", *TRAIN, "logger=mlflow", f"out={tmp_path / 'bad'}")
    assert res.exit_code != 0 and "logger" in res.stderr


def test_every_file_of_a_training_run_has_the_mode_the_umask_gives(trained):
    """Weights, checkpoints and tables alike: 0666 less the umask (0644 under the usual 022), like
    any file a program creates, not the 0600 of a temporary file."""
    import os
    import stat

    mask = os.umask(0)
    os.umask(mask)
    files = [p for p in trained.rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files)
    odd = {str(p.relative_to(trained)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files
           if stat.S_IMODE(p.stat().st_mode) != 0o666 & ~mask}
    assert not odd, odd


def test_a_one_step_run_trains_and_records_its_final_losses(tmp_path):
    """steps=1: the last step is the first, so the final evaluation writes into the cell's work folder
    before any metrics line made it."""
    out = tmp_path / "one"
    res = poslsh("train", *TRAIN, "steps=1", "position=[alibi]", "seed=[0]", "device=cpu", f"out={out}")
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 1 and np.isfinite(df.val_loss).all()


# ---------------------------------------------------------------------------------------------
# the gap to ALiBi against tokens (train's claim)


def _train_run(tmp_path, gap_of_step, seeds=(0, 1, 2), noise=0.002, total=1000):
    """A train run on disk with only what the gap claim reads: results rows and each cell's metrics."""
    g = np.random.default_rng(0)
    rows = []
    for seed in seeds:
        for pos, s in (("alibi", 0), ("poslsh", 10)):
            cell = tmp_path / "work" / f"{pos}-{seed}-{total}"
            (cell / "final").mkdir(parents=True)
            steps = np.arange(100, total + 100, 100)
            base = 3.0 - 0.5 * np.log(steps / 100)
            bpb = base + (gap_of_step(steps) + noise * g.standard_normal(len(steps)) if pos == "poslsh" else 0)
            pd.DataFrame({"step": steps, "tokens": steps * 4096, "loss": bpb, "val_loss": bpb, "val_bpb": bpb}
                         ).to_csv(cell / "metrics.csv", index=False)
            rows.append(dict(position=pos, s=s, seed=seed, seq_len=256, steps=total, tokens=total * 4096, params=1,
                             train_loss=1.0, val_loss=1.0, val_bpb=float(bpb[-1]), val_ppl=2.7, seconds=1.0,
                             tokens_per_s=1.0, pretrain="", init="", checkpoint=f"work/{pos}-{seed}-{total}/final",
                             step_seconds=0.1, attn_dropout=0.0, passes=1.0, sigmas="standard"))
    return pd.DataFrame(rows)


def test_the_gap_claim_over_one_seed_shows_its_fit_and_decides_nothing(tmp_path):
    """One seed: the slope of its gap with the interval of the fit's residuals (no seed spread), shown,
    and the claim INCONCLUSIVE however clearly the gap shrank; three seeds decide the same curves."""
    shrinking = lambda steps: 0.2 * (1 - steps / 1000)  # noqa: E731
    for seeds, want in (((0,), Status.INCONCLUSIVE), ((0, 1, 2), Status.SUPPORTED)):
        run = tmp_path / str(len(seeds))
        v = [v for v in registry.get("train").report(run, _train_run(run, shrinking, seeds=seeds)).verdicts
             if "shrinks" in v.claim]
        assert len(v) == 1 and v[0].status is want, (seeds, v[0].evidence)
        if len(seeds) == 1:
            assert "1 seed: slope of the mean gap, interval of its fit (undecided: a verdict needs 3 training " \
                   "seeds)" in v[0].evidence, v[0].evidence


def test_gap_to_alibi_is_judged_over_the_second_half_of_training(tmp_path):
    from poslsh_cli.experiments.train import report as tr

    shrinking = _train_run(tmp_path / "a", lambda st: 0.3 / np.sqrt(st / 100))
    sec = registry.get("train").report(tmp_path / "a", shrinking)
    v = [v for v in sec.verdicts if "shrinks" in v.claim]
    assert len(v) == 1 and v[0].status is Status.SUPPORTED and "3 seeds, one slope each" in v[0].evidence
    assert "poslsh s=10" in v[0].claim and "second half of training" in v[0].claim
    assert "gap at step 500 +0.13" in v[0].evidence and "change over the second half -0.03" in v[0].evidence
    # the curves fall by 0.5 ln(10/8) = 0.1116 between step 800 and 1000 (alibi's; poslsh's also by its gap's change)
    assert "validation still fell" in v[0].evidence
    table = [t for t in sec.tables if "fell over the last 20%" in t.columns][0]
    assert table[table.scheme == "alibi"]["fell over the last 20%"].iloc[0] == pytest.approx(0.5 * np.log(10 / 8), abs=1e-4)
    growing = _train_run(tmp_path / "b", lambda st: 0.05 * np.log(st))
    assert status_of(registry.get("train").report(tmp_path / "b", growing), "shrinks") is Status.NOT_SUPPORTED
    flat = _train_run(tmp_path / "c", lambda st: 0.1 + 0 * st, noise=0.05)
    assert status_of(registry.get("train").report(tmp_path / "c", flat), "shrinks") is Status.INCONCLUSIVE
    # the gap appears over the first half, then shrinks: a fit over the whole curve sees it grow
    appears = _train_run(tmp_path / "d", lambda st: np.where(st <= 500, 0.1 * st / 500, 0.1 - 1e-4 * (st - 500)))
    assert status_of(registry.get("train").report(tmp_path / "d", appears), "shrinks") is Status.SUPPORTED
    # a scheme ahead of exact ALiBi (a gap below zero, as RoPE's) shrinks its gap as the gap rises towards zero
    ahead = _train_run(tmp_path / "e", lambda st: -0.3 / np.sqrt(st / 100))
    v = [v for v in registry.get("train").report(tmp_path / "e", ahead).verdicts if "shrinks" in v.claim][0]
    assert v.status is Status.SUPPORTED and "change over the second half +0.03" in v.evidence, v.evidence
    assert "a gap below 0 shrinks as it rises" in v.evidence
    # a gap that starts just below zero and grows through it is behind exact ALiBi over the half: it grows
    crossing = _train_run(tmp_path / "g", lambda st: -0.004 + 0.02 * (st - 500) / 500)
    assert status_of(registry.get("train").report(tmp_path / "g", crossing), "shrinks") is Status.NOT_SUPPORTED
    widening = _train_run(tmp_path / "f", lambda st: -0.05 * np.log(st))
    assert status_of(registry.get("train").report(tmp_path / "f", widening), "shrinks") is Status.NOT_SUPPORTED
    # a run that trains T/2 and T judges each, and says which in the claim (and its name)
    both = pd.concat([_train_run(tmp_path / "h", lambda st: 0.3 / np.sqrt(st / 100), total=t) for t in (500, 1000)])
    v = {x.claim: x for x in registry.get("train").report(tmp_path / "h", both).verdicts if "shrinks" in x.claim}
    assert sorted(v) == [f"the gap of poslsh s=10 to exact ALiBi shrinks over the second half of training [{t} steps]"
                         for t in (1000, 500)], sorted(v)
    assert len({x.name for x in v.values()}) == 2 and "500 steps: gap at step 250" in next(iter(
        x.evidence for c, x in v.items() if c.endswith("[500 steps]")))
    paths = tr.plot_gap(tmp_path / "a", shrinking)
    assert [p.name for p in paths if p.suffix == ".png"] == ["gap_vs_tokens.png"]


def test_the_passes_sentence_shows_small_fractions_of_a_pass():
    """A short run reads a small fraction of its corpus: the sentence says how small (it read '0.00 to 0.00
    passes' beside a table showing 0.0008)."""
    from poslsh_cli.experiments.train.report import passes_findings

    text = passes_findings(pd.DataFrame({"passes": [0.000812, 0.00162]}))[0]
    assert "less than once: 0.000812 to 0.00162 passes" in text, text


def test_throughput_is_read_from_the_median_step_so_a_paused_run_shows_its_speed(tmp_path):
    """tokens/s in the report is tokens per step over the median step time: a cell paused or killed and
    resumed (its wall-clock seconds inflated) shows the speed it trained at, as step_seconds does."""
    df = _train_run(tmp_path, lambda steps: 0.0 * steps).assign(tokens_per_s=1.0)  # 1.0: as if paused for hours
    table = registry.get("train").report(tmp_path, df).tables[0]
    assert (table.tokens_per_s == 4096 / 0.1).all(), table.tokens_per_s.tolist()


def test_the_train_table_shows_seconds_a_tiny_run_took_and_says_what_its_loss_is_in():
    """A 0.25 s run reads 0.25 s, not 0; whole seconds from 100 on; the training loss in nats per token
    beside bits per byte, the wall time that of the session that finished the cell."""
    from poslsh_cli.app import registry

    summary = registry.get("train").summary  # on migrated rows, as the command runs it

    row = dict(position="alibi", s=0, seed=0, seq_len=64, params=1000, train_loss=1.0, val_bpb=2.0, val_ppl=3.0,
               step_seconds=0.01, tokens_per_s=5.0, seconds=0.25, wall_seconds=1234.5)
    head, rows = summary(pd.DataFrame([row]))
    got = dict(zip(head, rows[0]))
    assert got["training s"] == "0.25" and got["wall s (finishing session)"] == "1234"
    assert "train loss (nats/token)" in head
