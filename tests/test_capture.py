"""Activation capture: every supported family, proved on tiny random models saved to disk."""
import json
import shutil

import pytest
import torch

from poslsh_cli.attention import reference_attention
from poslsh_cli.lm.capture import capture_qkv
from poslsh_cli.lm.documents import builtin_text, read_text, tokenize
from poslsh_cli.lm.pretrained import load
from poslsh_cli.lm.checkpoint import check_checkpoint
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.models import minilm_path

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"]


def tiny_config(family):
    import transformers as tf

    common = dict(vocab_size=30522, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=128)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if family == "llama4_text":
        return tf.Llama4TextConfig(**common, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                                   intermediate_size_mlp=96, no_rope_layers=[1, 0], attention_chunk_size=128)
    if family == "bert":
        return tf.BertConfig(vocab_size=30522, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=256)
    raise ValueError(family)


def save_tiny(family, path):
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_config(tiny_config(family))
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = minilm_path() / name
        if src.exists():
            shutil.copy(src, path / name)
    return path


@pytest.mark.parametrize("family", ["bert", "llama", "mistral", "qwen3", "llama4_text"])
def test_captured_qkv_reproduce_the_models_attention(family, tmp_path):
    path = save_tiny(family, tmp_path / family)
    m = load(path)
    assert m.model_type == family and m.num_layers == 2 and m.num_heads == 4
    assert m.causal == (family != "bert")
    ids = tokenize(m.tokenizer, builtin_text(), 96)
    cap = capture_qkv(m, ids, [0, 1])
    assert sorted(cap) == [0, 1]
    for layer, c in cap.items():
        assert c.q.shape == c.k.shape == c.v.shape == (4, 96, 16)
        assert c.causal == m.causal
        if family != "bert":
            assert c.kv_heads == 2
            torch.testing.assert_close(c.k[0], c.k[1])  # GQA: heads 0 and 1 share kv head 0
        ref, _ = reference_attention(c.q[None], c.k[None], c.v[None], None, c.causal, scale=c.scaling)
        torch.testing.assert_close(ref[0].float(), c.output, rtol=1e-4, atol=1e-5)


def test_default_model_is_the_shipped_minilm():
    m = load(minilm_path())
    assert (m.model_type, m.num_layers, m.num_heads, m.max_positions, m.causal) == ("bert", 6, 12, 512, False)
    cap = capture_qkv(m, tokenize(m.tokenizer, builtin_text(), 128), [5])
    c = cap[5]
    assert c.q.shape == (12, 128, 32) and c.scaling == pytest.approx(32 ** -0.5)
    ref, _ = reference_attention(c.q[None], c.k[None], c.v[None], None, False, scale=c.scaling)
    torch.testing.assert_close(ref[0].float(), c.output, rtol=1e-4, atol=1e-5)


def test_builtin_text_is_the_shipped_corpus_and_pydoc_topics_is_prose():
    import hashlib

    from poslsh_cli.lm.documents import BUILTIN_SHA256
    from poslsh_cli.lm.documents import PYDOC_TOPICS

    text = builtin_text()
    assert hashlib.sha256(text.encode()).hexdigest() == BUILTIN_SHA256 and len(text) > 10_000_000
    assert read_text("builtin") == text
    topics = read_text(PYDOC_TOPICS)
    assert len(topics) > 100_000 and " the " in topics
    assert not any(line.strip() and set(line.strip()) <= set("*=-~^") for line in topics.splitlines())


def test_bad_checkpoints_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        check_checkpoint(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="no \\*.safetensors weights.*pytorch_model.bin"):
        check_checkpoint(tmp_path)


def test_unsupported_architecture_and_broken_weights(tmp_path):
    import transformers as tf

    gpt2 = tmp_path / "gpt2"
    tf.GPT2Model(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(gpt2)
    with pytest.raises(ConfigError, match="cannot capture architecture 'gpt2'"):
        load(gpt2)
    broken = save_tiny("llama", tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="model.safetensors cannot be read"):
        load(broken)


def test_short_text_and_missing_file(tmp_path):
    m = load(minilm_path())
    with pytest.raises(ConfigError, match="fewer than n=512"):
        tokenize(m.tokenizer, "just a few words", 512)
    with pytest.raises(ConfigError, match="no such file"):
        read_text(str(tmp_path / "missing.txt"))
