"""Real ALiBi architectures (BLOOM, MPT, Falcon-RW): capture, their own slopes and bias
conventions, proved on tiny random models with 6 heads (not a power of two) built from a config
and saved to disk: exact ALiBi recomputed from the captured q, k, v equals the model's own
attention output (the input of its output projection)."""
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import poslsh
from poslsh_cli.attention import laplacian_weight, reference_attention
from poslsh_cli.lm.capture import capture_qkv
from poslsh_cli.lm.documents import builtin_text, tokenize
from poslsh_cli.lm.pretrained import load
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.models import minilm_path
from poslsh_cli.numerics.sampling import standard_alibi_slopes

H, N = 6, 80


def tiny_alibi(family, **over):
    import transformers as tf

    common = dict(vocab_size=30522)
    if family == "bloom":
        return tf.BloomForCausalLM(tf.BloomConfig(**common, hidden_size=48, n_layer=2, n_head=H, **over))
    if family == "mpt":
        return tf.MptForCausalLM(tf.MptConfig(**common, d_model=48, n_layers=2, n_heads=H, max_seq_len=256,
                                              expansion_ratio=2, **over))
    if family == "falcon":
        cfg = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=H, alibi=True, multi_query=False,
                   new_decoder_architecture=False, parallel_attn=False, bias=True)
        cfg.update(over)
        return tf.FalconForCausalLM(tf.FalconConfig(**common, **cfg))
    raise ValueError(family)


def save_alibi(family, path, **over):
    torch.manual_seed(0)
    model = tiny_alibi(family, **over)
    with torch.no_grad():  # random biases and non-trivial weights, so nothing cancels by accident
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        src = minilm_path() / name
        if src.exists():
            shutil.copy(src, path / name)
    return path


def naive_tolerance(q, k, v, weight, scale, offset=0.0):
    """The float64 reference and the tolerance for a float32 implementation of it: twice the naive
    float32 error, plus the rounding of a logit offset the model adds (BLOOM ``slope * j``, MPT
    ``slope * (j - (T-1))``: up to ``max slope * (T-1)`` in size, rounded at eps of that size and
    carried to the output by at most ``2 max |v|``)."""
    ref, _ = reference_attention(q, k, v, weight, True, scale)
    naive, _ = reference_attention(q.float(), k.float(), v.float(), weight, True, scale, dtype=torch.float32)
    eps = torch.finfo(torch.float32).eps
    return ref, 2 * (naive.double() - ref).abs().max().item() + 4 * eps + 2 * eps * offset * v.abs().max().item()


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_exact_alibi_from_captured_tensors_equals_the_models_own_attention(family, tmp_path):
    path = save_alibi(family, tmp_path / family)
    m = load(path)
    assert m.model_type == family and m.causal and m.alibi_sigmas.shape == (H,)
    if family == "bloom":  # BLOOM's slopes are the standard ones, also for 6 heads
        np.testing.assert_allclose(1 / m.alibi_sigmas, standard_alibi_slopes(H), rtol=1e-6)
    else:  # MPT: slopes of the next power of two (8), reordered, alibi_bias_max = 8
        base = 1 / 2.0 ** (np.arange(1, 9) * 8 / 8)
        np.testing.assert_allclose(1 / m.alibi_sigmas, np.concatenate([base[1::2], base[::2]])[:H], rtol=1e-6)
    ids = tokenize(m.tokenizer, builtin_text(), N)
    for layer, c in capture_qkv(m, ids, [0, 1]).items():
        assert c.q.shape == (H, N, 8) and c.output.shape == (H, N, 8)
        w = laplacian_weight(N, torch.as_tensor(m.alibi_sigmas))
        offset = float((1 / m.alibi_sigmas).max()) * (N - 1)
        ref, tol = naive_tolerance(c.q[None].double(), c.k[None].double(), c.v[None].double(), w, c.scaling, offset)
        err = (ref[0] - c.output.double()).abs().max().item()
        assert err <= tol, (family, layer, err, tol)


def test_falcon_adds_its_bias_before_scaling_and_rounds_it_to_bfloat16(tmp_path):
    """Falcon-RW: sigma_eff = sqrt(d) / slope. Its own attention equals exact ALiBi with the bias it
    really uses (slope * j rounded to bfloat16 by transformers) to float tolerance, and exact ALiBi
    with the effective sigma up to that rounding."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    path = save_alibi("falcon", tmp_path / "falcon")
    m = load(path)
    d = 48 // H
    slopes = torch.as_tensor(standard_alibi_slopes(H)).bfloat16().double().numpy()
    np.testing.assert_allclose(m.alibi_sigmas, np.sqrt(d) / slopes, rtol=1e-12)
    ids = tokenize(m.tokenizer, builtin_text(), N)
    bias = build_alibi_tensor(torch.ones(1, N, dtype=torch.long), H, torch.float32)[:, 0, :].double()  # (H, N)
    for layer, c in capture_qkv(m, ids, [0, 1]).items():
        q, k, v = (t[None].double() for t in (c.q, c.k, c.v))
        own_bias = torch.exp((bias[:, None, :] - bias[:, :, None]) / np.sqrt(d))  # exp(b(j) - b(i)), scaled
        ref, tol = naive_tolerance(q, k, v, own_bias, c.scaling, float((1 / m.alibi_sigmas).max()) * (N - 1))
        assert (ref[0] - c.output.double()).abs().max().item() <= tol
        exact = reference_attention(q, k, v, laplacian_weight(N, torch.as_tensor(m.alibi_sigmas)), True, c.scaling)[0]
        gap = (exact[0] - c.output.double()).abs().max().item()
        assert gap < 0.05  # the bfloat16 rounding of slope * j, nothing else


def test_output_error_uses_the_models_own_slopes_and_reports_its_own_attention(tmp_path):
    path = save_alibi("bloom", tmp_path / "bloom")
    out = tmp_path / "run"
    r = poslsh("output-error", f"model={path}", f"n={N}", "s=[2,8]", "trials=1", f"out={out}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "results.csv")
    assert df.causal.all()
    own = df[df.method == "model_own"]
    assert len(own) == 2 * H and (own.rel_fro < 1e-5).all()  # its own attention is exact ALiBi
    np.testing.assert_allclose(sorted(df.sigma.unique()), sorted(1 / standard_alibi_slopes(H)), rtol=1e-6)
    r = poslsh("output-error", f"model={path}", f"n={N}", "s=[2]", "trials=1", "alibi=standard",
               "layers=[0]", f"out={tmp_path / 'std'}")
    assert r.exit_code == 0 and "model_own" not in set(pd.read_csv(tmp_path / "std" / "results.csv").method)


def test_bad_alibi_checkpoints(tmp_path):
    broken = save_alibi("bloom", tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="model.safetensors cannot be read"):
        load(broken)
    rotary = save_alibi("falcon", tmp_path / "rotary", alibi=False)
    with pytest.raises(ConfigError, match="alibi=false uses rotary embeddings"):
        load(rotary)
    r = poslsh("output-error", f"model={rotary}", "n=32", "s=[1]", f"out={tmp_path / 'x'}")
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "rotary" in r.stderr
    assert not (tmp_path / "x").exists()
    r = poslsh("output-error", f"model={broken}", "n=32", "s=[1]", f"out={tmp_path / 'y'}")
    assert r.exit_code == 2 and "model.safetensors cannot be read" in r.stderr
    for model, reason in ((broken, "model.safetensors cannot be read"), (rotary, "rotary")):
        r = poslsh("perplexity", str(model), "lengths=[32]", f"out={tmp_path / 'p'}")
        assert r.exit_code == 2 and reason in r.stderr, r.output
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # one line, no tokenizer chatter before it
        assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("family", ["bloom", pytest.param("mpt", marks=pytest.mark.slow),
                                    pytest.param("falcon", marks=pytest.mark.slow)])
def test_perplexity_own_equals_the_projects_exact_alibi_and_kl_is_reported(family, tmp_path):
    """attention=own runs the model's forward untouched; attention=alibi swaps in the project's
    exact ALiBi with the model's own slopes: the same loss (Falcon: up to its bfloat16 bias)."""
    path = save_alibi(family, tmp_path / family)
    out = tmp_path / "ppl"
    r = poslsh("perplexity", str(path), "lengths=[32,64]", "attention=[own,alibi,poslsh]", "s=[4]",
               "swapped_at=every", "max_tokens=1000", f"out={out}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "results.csv").set_index(["attention", "length"])
    assert set(df.position) == {"alibi"} and (df.bits_per_token > 0).all()
    for length in (32, 64):
        own, alibi = df.loc[("own", length)], df.loc[("alibi", length)]
        assert own.kl == 0 and own.tokens == alibi.tokens
        rel = abs(alibi.loss - own.loss) / own.loss
        assert rel < (2e-3 if family == "falcon" else 1e-5), (family, length, rel)
        assert alibi.kl < (1e-3 if family == "falcon" else 1e-8)
        drawn = df.loc[("poslsh", length)]  # three mask draws by default
        assert len(drawn) == 3 and (drawn.kl > alibi.kl).all()
    # bits per byte = summed NLL / ln 2 / UTF-8 bytes covered by the predicted tokens
    from poslsh_cli.lm.data import HFTokenizer, load_corpus
    from poslsh_cli.lm.windows import eval_windows

    c = load_corpus("builtin", tokenizer=HFTokenizer.load(path))
    row = df.loc[("own", 32)]
    assert row.bytes == sum(w.nbytes for w in eval_windows(c.val, 32, max_tokens=1000, token_bytes=c.val_bytes))
    assert row.bits_per_byte == pytest.approx(row.bits_per_token * row.tokens / row.bytes, rel=1e-12)


BAICHUAN_CODE = '''
import math
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class BaichuanConfig(PretrainedConfig):
    model_type = "baichuan"

    def __init__(self, vocab_size=30522, hidden_size=48, num_attention_heads=6, num_hidden_layers=2,
                 model_max_length=256, **kw):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_attention_heads, self.num_hidden_layers = num_attention_heads, num_hidden_layers
        self.model_max_length = model_max_length
        super().__init__(**kw)


def _get_interleave(n):
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    p = 2 ** math.floor(math.log2(n))
    return power_of_2(p) + _get_interleave(2 * p)[0::2][: n - p]


class BaichuanAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        self.W_pack = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x, alibi_mask):
        B, T, _ = x.shape
        q, k, v = self.W_pack(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        w = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + alibi_mask[:, :T, :T]
        out = torch.softmax(w, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class BaichuanModel(PreTrainedModel):
    config_class = BaichuanConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([BaichuanAttention(config) for _ in range(config.num_hidden_layers)])
        self.post_init()

    def alibi_mask(self, n):  # built in forward, as Baichuan's own code does
        slopes = torch.tensor(_get_interleave(self.config.num_attention_heads))
        future = torch.triu(torch.full((n, n), float("-inf")), 1)
        return slopes[:, None, None] * torch.arange(n)[None, None, :] + future[None]

    def forward(self, input_ids, **kw):
        h = self.embed_tokens(input_ids)
        mask = self.alibi_mask(input_ids.shape[1])
        for layer in self.layers:
            h = h + layer(h, mask)
        return (h,)
'''


def test_baichuan_remote_code_is_captured_only_when_allowed(tmp_path):
    """A local stand-in for Baichuan-13B's remote code (its published structure: W_pack as
    [Q|K|V], o_proj, standard slopes added after scaling): refused without trust_remote_code,
    captured with it, and its own attention equals exact ALiBi. Not the real Baichuan code, which
    cannot be fetched offline."""
    import json

    path = tmp_path / "baichuan"
    path.mkdir()
    (path / "modeling_baichuan.py").write_text(BAICHUAN_CODE)
    import importlib.util

    spec = importlib.util.spec_from_file_location("modeling_baichuan_test", path / "modeling_baichuan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    model = mod.BaichuanModel(mod.BaichuanConfig())
    model.save_pretrained(path, safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "modeling_baichuan.BaichuanConfig", "AutoModel": "modeling_baichuan.BaichuanModel"}
    (path / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (minilm_path() / name).exists():
            shutil.copy(minilm_path() / name, path / name)
    with pytest.raises(ConfigError, match="trust_remote_code"):
        load(path)
    m = load(path, trust_remote_code=True)
    np.testing.assert_allclose(1 / m.alibi_sigmas, standard_alibi_slopes(H))
    ids = tokenize(m.tokenizer, builtin_text(), N)
    for layer, c in capture_qkv(m, ids, [0, 1]).items():
        w = laplacian_weight(N, torch.as_tensor(m.alibi_sigmas))
        ref, tol = naive_tolerance(c.q[None].double(), c.k[None].double(), c.v[None].double(), w, c.scaling,
                                   float((1 / m.alibi_sigmas).max()) * (N - 1))
        assert (ref[0] - c.output.double()).abs().max().item() <= tol
