"""lm-evaluation-harness on checkpoints (lm-eval's ``--model poslsh``, the model ``poslsh eval``
runs: the command's own tests are in tests/test_eval.py): a local multiple-choice task (no
download), the peer check against lm-eval's own ``HFLM`` on a RoPE checkpoint (the same metrics and
the same per-choice log-likelihoods), a Positional-LSH byte-level checkpoint whose batched scores
equal a direct forward of each request alone, and a Sobol-sampled checkpoint that keeps its
sampler."""
import math
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("lm_eval")

from conftest import poslsh  # noqa: E402
from poslsh_cli.lm.convert import save  # noqa: E402
from poslsh_cli.lm.trained import TrainInfo
from poslsh_cli.lm.loading import Arch, build_model  # noqa: E402
from poslsh_cli.lm.models import minilm_path  # noqa: E402
from poslsh_cli.lm.positions import PositionState  # noqa: E402

ARCH = Arch(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, head_dim=16, max_positions=4096)


def test_byte_tokenizer_ids_are_the_bytes():
    from poslsh_cli.lm.harness import byte_tokenizer

    tok = byte_tokenizer()
    text = "héllo wörld\n\n\t€ {x} ÿ ~!"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8")) and len(tok) == 256
    assert tok.decode(ids) == text and tok.eos_token_id == 0 and tok.pad_token_id == 0
    assert tok.decode([104, 105, 0], skip_special_tokens=True) == "hi"


def test_plain_hflm_and_poslsh_agree_on_a_rope_checkpoint(task_dir, tmp_path):
    """The peer check: lm-eval's HFLM loading the checkpoint itself and PoslshLM give the same
    accuracy and, per document and choice, the same log-likelihood (float32, 1e-4 nats)."""
    import lm_eval
    import transformers as tf
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from poslsh_cli.lm.harness import PoslshLM

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    path = tmp_path / "llama"
    tf.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(minilm_path() / name, path / name)
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    outs = []
    sep = 102  # the BERT tokenizer has no bos/eos: [SEP] starts an empty context, for both
    for lm in (HFLM(pretrained=str(path), device="cpu", dtype="float32", batch_size=4, prefix_token_id=sep),
               PoslshLM(pretrained=str(path), device="cpu", batch_size=3, prefix_token_id=sep)):
        outs.append(lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc"], task_manager=manager, log_samples=True,
                                            bootstrap_iters=0, verbosity="WARNING"))
    hf, ours = (o["results"]["tiny_mc"] for o in outs)
    assert hf["acc,none"] == ours["acc,none"] and hf["acc_norm,none"] == ours["acc_norm,none"]
    a = np.array([[r[0][0] for r in s["resps"]] for s in outs[0]["samples"]["tiny_mc"]])
    b = np.array([[r[0][0] for r in s["resps"]] for s in outs[1]["samples"]["tiny_mc"]])
    assert a.shape == (20, 3) and np.isfinite(a).all() and np.abs(a - b).max() < 1e-4


def test_batched_scores_equal_a_direct_forward(poslsh_checkpoint):
    """PoslshLM scores (context, continuation) pairs in right-padded batches; each equals the
    summed log-probability of the continuation's bytes in a forward of that request alone, under
    the same masks; an empty context starts from the newline prefix token."""
    from lm_eval.api.instance import Instance

    from poslsh_cli.lm.harness import NEWLINE, PoslshLM
    from poslsh_cli.lm.loading import load_model

    pairs = [("The sky is", " blue"), ("Once upon a time there was a", " fox that ran"), ("", "abc"),
             ("x" * 300, " and a long context"), ("Hello", " world")]
    lm = PoslshLM(pretrained=str(poslsh_checkpoint), device="cpu", batch_size=4)
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    model, _ = load_model(poslsh_checkpoint)
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        c = list(ctx.encode()) or [NEWLINE]
        ids = torch.tensor([c + list(cont.encode())])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids, use_cache=False).logits[0].double(), -1)
        n = len(cont.encode())
        target = ids[0, -n:]
        want = float(logp[-n - 1:-1].gather(1, target[:, None]).sum())
        assert math.isclose(ll, want, rel_tol=0, abs_tol=1e-3), (ctx[:20], ll, want)
        assert greedy == bool((logp[-n - 1:-1].argmax(-1) == target).all())


@pytest.fixture(scope="module")
def sobol_ck(tmp_path_factory):
    """A byte-level Positional-LSH checkpoint whose masks are Sobol-sampled, on the dense backend."""
    state = PositionState("poslsh", np.array([2.0, 4.0, 8.0, 16.0]), s=8, seed=3, sampler="sobol",
                          backend="dense")
    path = tmp_path_factory.mktemp("ck") / "sobol"
    save(build_model(ARCH, state, seed=1).eval(), path, TrainInfo.of({"scheme": state.to_json(), "seq_len": 128}), None)
    return path


def test_poslsh_lm_and_eval_keep_the_checkpoints_sampler_and_backend(sobol_ck, task_dir, tmp_path):
    """PoslshLM and poslsh eval evaluate a Sobol-sampled checkpoint with Sobol masks (its own scheme,
    re-drawn with another s or seed, or Positional LSH swapped in) on its backend, unless sampler=
    says otherwise; the rows say which sampler ran."""
    import pandas as pd

    from poslsh_cli.lm.harness import PoslshLM

    for kw in ({}, {"s": 4}, {"seed": 7}, {"attention": "poslsh", "s": 4}):
        state = PoslshLM(pretrained=str(sobol_ck), device="cpu", **kw).poslsh_state
        assert (state.sampler, state.backend) == ("sobol", "dense"), kw
    state = PoslshLM(pretrained=str(sobol_ck), device="cpu", s=4, sampler="stratified", backend="blocks").poslsh_state
    assert (state.sampler, state.backend) == ("stratified", "blocks")
    for extra, sampler in (([], "sobol"), (["sampler=iid"], "iid")):
        out = tmp_path / sampler
        res = poslsh("eval", str(sobol_ck), "tasks=[tiny_mc]", f"include_path={task_dir}", "limit=4",
                     "attention=[own,poslsh]", "s=4", "batch_size=4", "device=cpu", *extra, f"out={out}")
        assert res.exit_code == 0, res.output
        df = pd.read_csv(out / "results.csv")
        assert len(df) == 4 and (df.sampler == sampler).all() and (df.position == "poslsh").all(), df


def test_registered_for_lm_eval():
    """The model is lm-eval's ``poslsh`` once the module is imported, and the package declares it
    in the ``lm_eval.models`` entry-point group that lm-eval's plugin discovery reads."""
    from importlib.metadata import entry_points

    from lm_eval.api.registry import get_model

    from poslsh_cli.lm.harness import PoslshLM

    assert get_model("poslsh") is PoslshLM
    eps = {e.name: e for e in entry_points(group="lm_eval.models")}
    assert eps["poslsh"].load() is PoslshLM
