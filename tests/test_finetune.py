"""Pretrained causal LMs in ``poslsh train``: a tiny random Llama (RoPE) with a real tokenizer (the
shipped MiniLM's), converted to every scheme and fine-tuned a few steps: it loads with
``AutoModelForCausalLM.from_pretrained(trust_remote_code=True)`` as the architecture with its scheme
(with its tokenizer; plain loading refuses: tests/test_serving.py), ``perplexity`` restores its scheme,
and the bits per byte ``perplexity`` reports equal an independent computation: transformers' own
forward for rope, a float64 dense reference attention for the others. LoRA (merged and as an
adapter), ALiBi checkpoints with their own slopes, a configuration trained from scratch, and
every bad input as one line."""
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import poslsh
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.models import minilm_path
from poslsh_cli.lm.trained import train_info

SCHEMES = ["rope", "none", "alibi", "poslsh", "fixed_block", "windowed"]
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")
COMMON = ["seq_len=32", "batch=4", "steps=3", "warmup=1", "eval_every=3", "eval_tokens=1024", "checkpoint_every=2",
          "lr=1e-3", "data=pydoc-topics", "device=cpu"]


def with_tokenizer(path):
    for name in TOKENIZER:
        shutil.copy(minilm_path() / name, path / name)
    return path


def save_llama(path, vocab=30522, tokenizer=True):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    tf.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return with_tokenizer(path) if tokenizer else path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def finetuned(llama, tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("ft") / "run"
    r = poslsh("train", f"init={llama}", f"position=[{','.join(SCHEMES)}]", "s=[2]", *COMMON, f"out={out}")
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("POSLSH_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield mp
    mp.undo()


def finals(run):
    df = pd.read_csv(run / "results.csv")
    return {p: run / c for p, c in zip(df.position, df.checkpoint)}


def test_every_scheme_is_saved_loadable_with_its_tokenizer_and_scheme(finetuned, llama):
    import transformers as tf

    df = pd.read_csv(finetuned / "results.csv")
    assert sorted(df.position) == sorted(SCHEMES)
    assert (df.tokenizer == str(llama)).all() and (df.steps == 3).all()
    base = tf.AutoModelForCausalLM.from_pretrained(llama)
    for position, path in finals(finetuned).items():
        model = tf.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
        assert type(model).__name__ == "LlamaForCausalLM"
        assert model.config.poslsh["position"] == position
        assert model.config.model_type == "llama"  # the architecture itself, with the scheme installed
        assert len(tf.AutoTokenizer.from_pretrained(path)) == 30522
        changed = any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), base.state_dict().values()))
        assert changed, position  # fine-tuned, not a copy
        info = json.loads((path / "poslsh_train.json").read_text())
        assert info["init"] == str(llama) and train_info(path).position == position and "scheme" not in info


def reference_nll(model, state, windows):
    """Summed NLL (nats) of the scored tokens of ``windows`` under ``model`` (float64 softmax)."""
    total = 0.0
    with torch.no_grad():
        for w in windows:
            x = torch.as_tensor(w.tokens, dtype=torch.long)[None]
            if state is not None:
                state.eval_key = "perplexity"
            logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), -1)
            total -= float(logp[w.score_from - 1:].gather(-1, x[0, w.score_from:, None]).sum())
    return total


def reference_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """The scheme's attention through the float64 dense reference (the oracle of every fast path)."""
    from poslsh_cli.attention import reference_attention, reference_weight

    state = module.poslsh_position
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    n = query.shape[-2]
    spec = state.attention_spec(module.layer_idx, n, scaling)
    out, _ = reference_attention(query.double(), key.double(), value.double(), reference_weight(spec, n), True,
                                 scaling)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


@pytest.mark.slow
def test_no_command_ever_asks_to_run_custom_code(finetuned, tmp_path, monkeypatch):
    """A converted checkpoint's config names its own auto_map; reading its tokenizer (generate,
    perplexity, eval) never reaches transformers' 'trust remote code? [y/N]' prompt, which waits on
    input() in a terminal: here input() fails the test."""
    import builtins

    from poslsh_cli.lm.checkpoint import load_tokenizer

    def asked(*a, **k):
        raise AssertionError(f"a command stopped to ask: {a}")

    monkeypatch.setattr(builtins, "input", asked)
    path = finals(finetuned)["poslsh"]
    assert "auto_map" in json.loads((path / "config.json").read_text())
    assert len(load_tokenizer(path)) == 30522
    r = poslsh("generate", str(path), "prompt=hello world", "max_new_tokens=3")
    assert r.exit_code == 0, r.output
    r = poslsh("perplexity", str(path), "lengths=[32]", "trials=1", "max_tokens=256", f"out={tmp_path / 'p'}")
    assert r.exit_code == 0, r.output


def test_perplexity_restores_each_scheme_and_equals_an_independent_forward(finetuned, tmp_path):
    import transformers as tf

    from poslsh_cli.lm.data import HFTokenizer, load_corpus
    from poslsh_cli.lm.windows import eval_windows
    from poslsh_cli.lm.loading import load_model
    from poslsh_cli.numerics.sampling import derive_seed

    out = tmp_path / "ppl"
    r = poslsh("perplexity", str(finetuned), "lengths=[32,64]", "trials=2", "max_tokens=1024", f"out={out}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "results.csv")
    assert len(df) == 2 * (len(SCHEMES) + 1)  # Positional LSH twice: two mask draws
    tf.AttentionInterface.register("poslsh_reference", reference_attention_forward)
    for position, path in finals(finetuned).items():
        info = json.loads((path / "poslsh_train.json").read_text())
        corpus = load_corpus(info["data"], val_every=info["val_every"], tokenizer=HFTokenizer.load(path))
        for _, row in df[df.position == position].iterrows():
            windows = list(eval_windows(corpus.val, int(row.length), None, 1024, corpus.val_bytes))
            assert sum(w.nbytes for w in windows) == row.bytes
            if position == "rope":  # transformers' own forward, its own RoPE and SDPA
                model = tf.AutoModelForCausalLM.from_pretrained(path).eval()
                nll = reference_nll(model, None, windows)
            else:
                model, state = load_model(path)
                assert state.position.value == position
                if position == "poslsh":
                    assert row.seed == derive_seed(0, "perplexity", row.checkpoint, "own", 0, int(row.trial))
                    state.seed = int(row.seed)
                model.set_attn_implementation("poslsh_reference")
                nll = reference_nll(model, state, windows)
            assert row.bits_per_byte == pytest.approx(nll / math.log(2) / row.bytes, rel=2e-5), (position, row.length)
            assert row.loss == pytest.approx(nll / row.tokens, rel=2e-5)
    own = df[df.position == "poslsh"].groupby("length").bits_per_byte
    assert (own.nunique() == 2).all()  # two draws, two different values


@pytest.mark.slow
def test_lora_merged_and_adapter(llama, tmp_path, monkeypatch):
    import transformers as tf

    monkeypatch.setenv("POSLSH_CACHE", str(tmp_path / "cache"))
    for save in ("merged", "adapter"):
        out = tmp_path / save
        r = poslsh("train", f"init={llama}", "position=[poslsh]", "s=[2]", "lora_rank=4", f"lora_save={save}",
                   *COMMON, f"out={out}")
        assert r.exit_code == 0, r.output
        row = pd.read_csv(out / "results.csv").iloc[0]
        assert row.trainable == 2 * 4 * (2 * (32 + 32) + 2 * (32 + 16))  # rank 4; q, o: 32->32; k, v: 32->16; 2 layers
        path = out / row.checkpoint
        # merged: the checkpoint's modeling files (trust_remote_code); an adapter through transformers' peft
        model = tf.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=save == "merged")
        assert hasattr(model, "peft_config") == (save == "adapter")
        r = poslsh("perplexity", str(path), "lengths=[32]", "trials=1", "max_tokens=512", f"out={tmp_path / ('p' + save)}")
        assert r.exit_code == 0, r.output
        p = pd.read_csv(tmp_path / ("p" + save) / "results.csv").iloc[0]
        assert p.position == "poslsh" and np.isfinite(p.bits_per_byte)
    base = tf.AutoModelForCausalLM.from_pretrained(llama).state_dict()
    merged = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / row.checkpoint,
                                                     trust_remote_code=True).state_dict()
    assert torch.equal(base["model.layers.0.mlp.up_proj.weight"], merged["model.layers.0.mlp.up_proj.weight"])
    assert not torch.equal(base["model.layers.0.self_attn.q_proj.weight"], merged["model.layers.0.self_attn.q_proj.weight"])


def test_alibi_checkpoint_keeps_its_own_slopes(tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_alibi_models import save_alibi

    from poslsh_cli.lm.pretrained import load
    from poslsh_cli.lm.loading import load_model

    monkeypatch.setenv("POSLSH_CACHE", str(tmp_path / "cache"))
    bloom = save_alibi("bloom", tmp_path / "bloom")
    out = tmp_path / "run"
    r = poslsh("train", f"init={bloom}", "position=[alibi,poslsh]", "s=[2]", "alibi=model", *COMMON, f"out={out}")
    assert r.exit_code == 0, r.output
    own = load(bloom).alibi_sigmas
    for position, path in finals(out).items():
        model, state = load_model(path)
        np.testing.assert_allclose(state.sigmas, own)
        assert state.native == (position == "alibi")
    r = poslsh("train", f"init={bloom}", "position=[rope]", *COMMON, f"out={tmp_path / 'r'}")
    assert r.exit_code == 2 and "no rotary embedding" in r.output
    rotary = save_alibi("falcon", tmp_path / "rotary", alibi=False)
    r = poslsh("train", f"init={rotary}", "position=[alibi]", "alibi=model", *COMMON, f"out={tmp_path / 'f'}")
    assert r.exit_code == 2 and "rotary embeddings (alibi=false) has no ALiBi slopes for alibi=model" in r.output
    assert not (tmp_path / "f").exists() and not (tmp_path / "r").exists()


def test_arch_trains_a_configuration_from_scratch(llama, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setenv("POSLSH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    r = poslsh("train", f"arch={llama}", "position=[alibi]", *COMMON, f"out={out}")
    assert r.exit_code == 0, r.output
    row = pd.read_csv(out / "results.csv").iloc[0]
    trained = load_file(out / row.checkpoint / "model.safetensors")
    base = load_file(llama / "model.safetensors")
    assert trained.keys() == base.keys() and row.params == sum(v.numel() for v in base.values())
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(trained[w], base[w], atol=0.05)  # fresh weights, not the checkpoint's


@pytest.mark.parametrize("case", ["no_tokenizer", "mismatch", "no_field", "offline", "no_peft", "both", "lora_scratch"])
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, monkeypatch):
    monkeypatch.setenv("POSLSH_CACHE", str(tmp_path / "cache"))
    args = ["position=[alibi]", *COMMON]
    if case == "no_tokenizer":
        args.append(f"init={save_llama(tmp_path / 'm', tokenizer=False)}")
        needle = "no tokenizer beside the weights"
    elif case == "mismatch":
        args.append(f"init={save_llama(tmp_path / 'm', vocab=1000)}")
        needle = "the tokenizer has 30522 tokens but the model's vocabulary is 1000"
    elif case == "no_field":
        (tmp_path / "d.jsonl").write_text(json.dumps({"body": "some text " * 100}) + "\n")
        args += [f"init={save_llama(tmp_path / 'm')}", f"data={tmp_path / 'd.jsonl'}"]
        needle = "has no text field 'text' (fields: body; set data_field=)"
    elif case == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
        args += [f"init={save_llama(tmp_path / 'm')}", "data=hf:wikitext:wikitext-103-raw-v1"]
        needle = "it needs the Hugging Face hub or a local copy"
    elif case == "no_peft":
        monkeypatch.setitem(sys.modules, "peft", None)
        args += [f"init={save_llama(tmp_path / 'm')}", "lora_rank=4"]
        needle = "lora_rank= needs peft: pip install peft"
    elif case == "both":
        args += [f"init={save_llama(tmp_path / 'm')}", f"arch={tmp_path / 'm'}"]
        needle = "exclude each other"
    else:
        args += ["lora_rank=4"]
        needle = "lora_rank= fine-tunes pretrained weights: give init="
    if case in ("no_field", "offline"):  # their own data= replaces the common one
        args.remove("data=pydoc-topics")
    r = poslsh("train", *args, f"out={tmp_path / 'out'}")
    lines = [x for x in r.output.strip().splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.output
    assert not (tmp_path / "out").exists()


def test_init_preset_names_resolve_under_poslsh_models(llama, tmp_path, monkeypatch):
    from poslsh_cli.lm.convert import resolve_ref

    root = tmp_path / "models"
    (root / "Mistral-7B-v0.1").mkdir(parents=True)
    monkeypatch.setenv("POSLSH_MODELS", str(root))
    assert resolve_ref("mistral-7b", "init") == (root / "Mistral-7B-v0.1").resolve()
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_ref(str(tmp_path / "nope"), "init")


def test_paper_scale_presets_read_their_corpus_from_poslsh_data(monkeypatch, tmp_path):
    from poslsh_cli.app import registry
    from poslsh_cli.experiments.train.command import skip_reason

    exp = registry.get("train")
    monkeypatch.delenv("POSLSH_DATA", raising=False)
    spec = registry.compose_spec(exp, ["experiment=finetune_mistral_7b_gpu_paper"])
    assert spec.data == "hf:wikitext:wikitext-103-raw-v1" and spec.lora_rank == 64 and spec.init == "mistral-7b"
    monkeypatch.setenv("POSLSH_DATA", str(tmp_path / "corpus.jsonl"))
    for preset in ("finetune_mistral_7b_gpu_paper", "train_qwen3_0_6b_gpu_paper", "train_gpu_paper"):
        spec = registry.compose_spec(exp, [f"experiment={preset}"])
        assert spec.data == str(tmp_path / "corpus.jsonl")
        assert skip_reason(spec)  # no CUDA here (or no checkpoint): reproduce says why
