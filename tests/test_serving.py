"""A converted model used as a model: padded batches, decoding through a key/value cache, and
loading that never computes another function.

Sizes: sequences of 300 and 220 tokens (three 128-token tiles), bandwidths 2 .. 16 so that
Positional LSH has many blocks; every check is against the same model's own unpadded full
forward (float32, within 1e-5) or the float64 reference.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import poslsh
from poslsh_cli.attention import AttentionSpec, reference_weight
from poslsh_cli.attention.positioned import (allowed_from_mask, is_causal_padding, positioned_attention,
                                             positions_from_padding)
from poslsh_cli.attention.reference import reference_attention
from poslsh_cli.lm.checkpoint import POSLSH_MODEL_TYPE
from poslsh_cli.lm.convert import save
from poslsh_cli.lm.trained import TrainInfo
from poslsh_cli.lm.loading import Arch, build_model, load_model
from poslsh_cli.lm.positions import PositionState
from poslsh_cli.numerics.methods import Method

SCHEMES = ["none", "alibi", "poslsh", "fixed_block", "windowed", "rope"]
SIGMAS = np.array([2.0, 4.0, 8.0, 16.0])
ARCH = Arch(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, head_dim=16, max_positions=4096)
TOL = 1e-5


def _model(position: str):
    state = PositionState(position, SIGMAS, s=8 if position == "poslsh" else 0, seed=3)
    return build_model(ARCH, state, seed=1).eval()


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (1, 300), generator=g), torch.randint(0, 256, (1, 220), generator=g)


@pytest.mark.parametrize("method", list(Method))
def test_positioned_attention_equals_the_float64_reference(method):
    """At positions 0..n-1 with the causal mask, the positioned path is the method itself."""
    n, H = 300, 4
    rng = [np.random.default_rng(h) for h in range(H)]
    spec = AttentionSpec.build(method, SIGMAS, n, True, s=6, rng=rng, window_sigmas=2.0)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, H, n, 16, generator=g) for _ in range(3))
    q_pos, k_pos = positions_from_padding(None, 2, n, n, "cpu")
    out = positioned_attention(q, k, v, spec, q_pos, k_pos, allowed_from_mask(None, 2, n, n, "cpu"))
    ref, _ = reference_attention(q, k, v, reference_weight(spec, n), True)
    assert (out.double() - ref).abs().max().item() < 2e-5


def test_positions_come_from_the_padding_never_from_what_a_query_sees():
    """Left and right padding: real tokens numbered from 0, queries at their own position; a
    sliding window in the mask (keys a query cannot see) shifts no position; a cache step's queries
    and keys are the last tokens the padding describes."""
    real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    q_pos, k_pos = positions_from_padding(real, 2, 5, 5, "cpu")
    assert k_pos[0, 2:].tolist() == [0, 1, 2] and k_pos[1, :3].tolist() == [0, 1, 2]
    assert q_pos[0, 2:].tolist() == [0, 1, 2] and q_pos[1, :3].tolist() == [0, 1, 2]
    causal, window = torch.ones(5, 5).tril().bool(), torch.ones(5, 5).triu(-1).bool()
    mask = (causal[None] & window[None] & real[:, None, :])[:, None]  # (B, 1, m, n): a window of 2
    assert torch.equal(allowed_from_mask(mask, 2, 5, 5, "cpu"), mask[:, 0])
    # causal attention over the real tokens may run each sequence alone; a window may not
    assert is_causal_padding((causal[None] & real[:, None, :]), real) and is_causal_padding(causal[None], None)
    assert not is_causal_padding(mask[:, 0], real) and not is_causal_padding((causal & window)[None], None)
    assert torch.equal(positions_from_padding(real, 2, 5, 5, "cpu")[0], q_pos)
    # one query decoded after 4 left-padded tokens, through a cache that holds the last 3 of 6 keys
    q_pos, k_pos = positions_from_padding(torch.tensor([[0, 0, 1, 1, 1, 1]]), 1, 1, 3, "cpu")
    assert q_pos.tolist() == [[3]] and k_pos.tolist() == [[1, 2, 3]]


def _greedy(model, ids, new_tokens: int, **kw):
    """Greedy generation: (sequences (B, n + new), logits (B, new, vocab) of every generated step)."""
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("position", SCHEMES)
def test_padded_batches_and_cached_decoding_give_the_unpadded_logits(position, tokens):
    a, b = tokens
    model = _model(position)
    with torch.no_grad():
        la, lb = model(a, use_cache=False).logits[0], model(b, use_cache=False).logits[0]
        n, m = a.shape[1], b.shape[1]
        for side in ("left", "right"):
            x = torch.zeros(2, n, dtype=torch.long)
            mask = torch.zeros(2, n, dtype=torch.long)
            x[0], mask[0] = a[0], 1
            span = slice(n - m, n) if side == "left" else slice(0, m)
            x[1, span], mask[1, span] = b[0], 1
            out = model(x, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        use_cache=False).logits
            assert (out[0] - la).abs().max().item() < TOL, side
            assert (out[1, span] - lb).abs().max().item() < TOL, side
        # a prompt, then one token at a time through the cache: the same logits as one forward
        out = model(a[:, :200], use_cache=True)
        steps, cache = [out.logits[0]], out.past_key_values
        for t in range(200, n):
            out = model(a[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits[0])
            cache = out.past_key_values
        assert (torch.cat(steps) - la).abs().max().item() < TOL
        greedy = [_greedy(model, a[:, :40], 24, use_cache=c) for c in (True, False)]
    assert torch.equal(greedy[0][0], greedy[1][0]) and (greedy[0][1] - greedy[1][1]).abs().max().item() < TOL
    if position != "rope":
        assert "positioned" in model.poslsh_position.plans


def _windowed_model(position: str, window: int = 48):
    """The test model with Qwen3's sliding-window attention in every layer (a key more than ``window``
    tokens back is masked, on top of the scheme)."""
    import transformers as tf

    from poslsh_cli.lm.install import install

    config = tf.Qwen3Config(**ARCH.config(), use_sliding_window=True, sliding_window=window, max_window_layers=0)
    assert set(config.layer_types) == {"sliding_attention"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = tf.Qwen3ForCausalLM(config)
    state = PositionState(position, SIGMAS, s=8 if position == "poslsh" else 0, seed=3)
    return install(model, state).eval()


@pytest.mark.parametrize("position", ["poslsh", "alibi"])
def test_a_sliding_window_mask_keeps_the_positions_of_cached_and_padded_decoding(position, tokens):
    """Under a sliding-window mask (window 48) the keys a query cannot see are still tokens: a
    100-token prompt and 60 tokens decoded through the cache give the full forward's logits, alone
    and as a left-padded batch (each row against its sequence alone)."""
    a, b = tokens[0][:, :160], tokens[1][:, :120]
    model = _windowed_model(position)
    with torch.no_grad():
        full_a, full_b = model(a, use_cache=False).logits[0], model(b, use_cache=False).logits[0]
        out = model(a[:, :100], use_cache=True)
        steps, cache = [out.logits[0]], out.past_key_values
        for t in range(100, 160):
            out = model(a[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits[0])
        assert (torch.cat(steps) - full_a).abs().max().item() < TOL
        ids, mask = _padded([a, b], "left")  # b from column 40 on
        out = model(ids[:, :100], attention_mask=mask[:, :100], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(100, 160):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
        got = torch.cat(steps, 1)
    assert (got[0] - full_a).abs().max().item() < TOL
    assert (got[1, 40:] - full_b).abs().max().item() < TOL


@pytest.mark.parametrize("position", [p for p in SCHEMES if p != "rope"])
def test_a_padded_batch_without_a_cache_runs_each_sequence_alone_on_the_fast_path(position, tokens):
    """One padding token must not send a batch to the positioned path (O(s n^2)): a left- or
    right-padded batch without a cache gives each sequence the logits it gets alone (1e-5), and
    only the method's own path runs."""
    model = _model(position)
    state = model.poslsh_position
    with torch.no_grad():
        alone = [model(t, use_cache=False).logits[0] for t in tokens]
        for side in ("left", "right"):
            state.plans.clear()
            ids, mask = _padded(tokens, side)
            out = model(ids, attention_mask=mask, use_cache=False).logits
            for b, t in enumerate(tokens):
                n = t.shape[1]
                got = out[b, -n:] if side == "left" else out[b, :n]
                assert (got - alone[b]).abs().max().item() < TOL, side
            assert state.plans and "positioned" not in state.plans, (side, state.plans)


@pytest.mark.parametrize("method", list(Method))
def test_attention_of_each_sequence_alone_equals_the_float64_reference(method):
    """attend_each_sequence: each row's real tokens (left, right, holes, one token, none) are the
    method at positions 0 .. r-1 against the float64 reference; padding queries get 0."""
    from poslsh_cli.attention.positioned import attend_each_sequence

    n, H = 200, 4
    real = torch.ones(5, n, dtype=torch.bool)
    real[0, :37] = False  # left padding
    real[1, 150:] = False  # right padding
    real[2, 20:60] = False  # a hole
    real[3, 1:] = False  # one token
    real[4] = False  # none

    def spec_at(r):
        rng = [np.random.default_rng(h) for h in range(H)]
        return AttentionSpec.build(method, SIGMAS, r, True, s=6, rng=rng, window_sigmas=2.0)

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, H, n, 16, generator=g) for _ in range(3))
    out = attend_each_sequence(q, k, v, real, spec_at)
    for b in range(5):
        r = int(real[b].sum())
        assert out[b][:, ~real[b]].abs().max().item() == 0 if r < n else True
        if r:
            qb, kb, vb = (t[b:b + 1][:, :, real[b]].double() for t in (q, k, v))
            ref, _ = reference_attention(qb, kb, vb, reference_weight(spec_at(r), r), True)
            assert (out[b:b + 1][:, :, real[b]].double() - ref).abs().max().item() < 2e-5, b


def test_a_swapped_inline_alibi_attention_refuses_a_cache():
    from transformers import BloomConfig, BloomForCausalLM

    from poslsh_cli.core.errors import ConfigError
    from poslsh_cli.lm.install import install

    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=256, hidden_size=32, n_layer=1, n_head=4)).eval()
    install(model, PositionState("poslsh", SIGMAS, s=4))
    x = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        model(x, use_cache=False)
        with pytest.raises(ConfigError, match="without a key/value cache"):
            model(x, use_cache=True)


def _alibi_checkpoint(arch: str):
    import transformers as tf

    torch.manual_seed(0)
    if arch == "bloom":
        return tf.BloomForCausalLM(tf.BloomConfig(vocab_size=256, hidden_size=32, n_layer=2, n_head=4)).eval()
    if arch == "mpt":
        return tf.MptForCausalLM(tf.MptConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4,
                                              max_seq_len=512)).eval()
    return tf.FalconForCausalLM(tf.FalconConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, alibi=True, new_decoder_architecture=False,
                                                multi_query=False, parallel_attn=False, bias=True)).eval()


@pytest.mark.parametrize("arch", ["bloom", "mpt", "falcon"])
def test_a_swapped_inline_alibi_attention_honours_padding(arch, tokens):
    """BLOOM, MPT and Falcon-RW under a swapped scheme (their inline attention replaced): a batch
    of a 300- and a 220-token sequence, left- or right-padded, gives each the logits it gets alone,
    on the fast path (never the positioned one, whose cost grows as s n^2)."""
    from poslsh_cli.lm.install import install

    model = _alibi_checkpoint(arch)
    for position in ("poslsh", "alibi"):
        state = PositionState(position, SIGMAS, s=8 if position == "poslsh" else 0, seed=2)
        install(model, state)
        with torch.no_grad():
            alone = [model(t, use_cache=False).logits[0] for t in tokens]
            for side in ("left", "right"):
                ids, mask = _padded(tokens, side)
                out = model(ids, attention_mask=mask, use_cache=False).logits
                for b, t in enumerate(tokens):
                    n = t.shape[1]
                    got = out[b, -n:] if side == "left" else out[b, :n]
                    assert (got - alone[b]).abs().max() < TOL, (arch, position, side)
        assert "positioned" not in state.plans  # each sequence alone, on the fast path


def _padded(tokens, side):
    width = max(t.shape[1] for t in tokens)
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    mask = torch.zeros(len(tokens), width, dtype=torch.long)
    for b, t in enumerate(tokens):
        n = t.shape[1]
        sl = slice(width - n, width) if side == "left" else slice(0, n)
        ids[b, sl], mask[b, sl] = t[0], 1
    return ids, mask


PLAIN = """
import json, sys, torch
import transformers as tf
ck, ref = sys.argv[1], torch.load(sys.argv[2])
out = {}
try:
    m = tf.AutoModelForCausalLM.from_pretrained(ck)
    out["plain"] = (m(ref["x"], use_cache=False).logits - ref["logits"]).abs().max().item()
except Exception as exc:
    out["plain"] = "refused: " + str(exc).splitlines()[0]
out["imported_before_remote"] = "poslsh_cli" in sys.modules
m = tf.AutoModelForCausalLM.from_pretrained(ck, trust_remote_code=True)
out["remote"] = (m(ref["x"], use_cache=False).logits - ref["logits"]).abs().max().item()
open(sys.argv[3], "w").write(json.dumps(out))
"""


@pytest.mark.parametrize("position", ["alibi", "poslsh", pytest.param("rope", marks=pytest.mark.slow)])
def test_plain_loading_is_the_same_function_or_refuses(position, tmp_path, tokens):
    """In a process that has not imported poslsh_cli: plain from_pretrained of a converted
    checkpoint refuses (it needs trust_remote_code, whose modeling files load it through poslsh);
    a RoPE checkpoint is the architecture itself and loads plainly as the same function."""
    model = _model(position)
    save(model, tmp_path / "ck", TrainInfo.of({"scheme": model.poslsh_position.to_json()}), None)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["use_cache"] is True
    loaded, state = load_model(tmp_path / "ck")
    assert state.position.value == position
    x = tokens[0][:, :150]
    with torch.no_grad():
        logits = loaded(x, use_cache=False).logits
    torch.save({"x": x, "logits": logits}, tmp_path / "ref.pt")
    run = subprocess.run([sys.executable, "-c", PLAIN, str(tmp_path / "ck"), str(tmp_path / "ref.pt"),
                          str(tmp_path / "out.json")],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["imported_before_remote"] is False
    assert out["remote"] < TOL
    if position == "rope":
        assert cfg["model_type"] == "qwen3" and out["plain"] < TOL
    else:
        assert cfg["model_type"] == POSLSH_MODEL_TYPE
        assert out["plain"].startswith("refused:") and "custom code" in out["plain"]


def test_registered_on_import_plain_loading_is_the_same_function(poslsh_checkpoint, tokens):
    import transformers as tf

    import poslsh_cli.lm.hf  # noqa: F401  registers the poslsh model type

    x = tokens[0][:, :150]
    with torch.no_grad():
        ref = load_model(poslsh_checkpoint)[0](x, use_cache=False).logits
        plain = tf.AutoModelForCausalLM.from_pretrained(poslsh_checkpoint)(x, use_cache=False).logits
    assert (plain - ref).abs().max().item() < TOL


def test_a_scheme_re_drawn_or_swapped_keeps_the_checkpoints_sampler_and_backend(tmp_path):
    """A Sobol-sampled checkpoint on the dense backend keeps both through with_scheme (its own scheme
    re-drawn, Positional LSH or another method swapped in: the masks drawn are the Sobol ones) and
    through poslsh generate, unless the user gives others; a swapped method that does not run on
    the checkpoint's backend takes auto."""

    from poslsh_cli.lm.loading import with_scheme

    trained = PositionState("poslsh", SIGMAS, s=8, seed=3, sampler="sobol", backend="dense")
    save(build_model(ARCH, trained, seed=1).eval(), tmp_path / "ck", TrainInfo.of({"scheme": trained.to_json()}), None)
    model, own = load_model(tmp_path / "ck")
    assert (own.sampler, own.backend) == ("sobol", "dense")
    x = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    for attention, s, seed in (("own", 4, None), ("own", 0, 5), ("poslsh", 4, None), ("fixed_block", 0, None),
                               ("alibi", 0, None)):
        state = with_scheme(model, own, attention, s, seed)
        assert (state.sampler, state.backend) == ("sobol", "dense") and model.poslsh_position is state, attention
        with torch.no_grad():
            assert torch.isfinite(model(x, use_cache=False).logits).all()
        assert state.plans == {"dense"}, (attention, state.plans)
        if state.position.value == "poslsh":  # the masks are the Sobol draw of that seed
            sobol = PositionState("poslsh", SIGMAS, s=state.s, seed=state.seed, sampler="sobol")
            assert all(np.array_equal(a, b) for a, b in zip(state.attention_spec(0, 64, None).bin_table,
                                                             sobol.attention_spec(0, 64, None).bin_table))
    assert with_scheme(model, own, "none").backend == "auto"  # no attention bias: SDPA only
    state = with_scheme(model, own, "poslsh", 4, sampler="stratified", backend="blocks")
    assert (state.sampler, state.backend) == ("stratified", "blocks")
    assert with_scheme(model, own, "own", sampler="iid").sampler == "iid"
    res = poslsh("generate", str(tmp_path / "ck"), "prompt=abc", "max_new_tokens=3", "s=4")
    assert res.exit_code == 0 and "poslsh s=4 sobol" in res.stderr, res.output
    res = poslsh("generate", str(tmp_path / "ck"), "prompt=abc", "max_new_tokens=3", "s=4",
                 "sampler=iid")
    assert res.exit_code == 0 and "poslsh s=4," in res.stderr, res.output


@pytest.mark.parametrize("position", ["poslsh", pytest.param("fixed_block", marks=pytest.mark.slow),
                                      pytest.param("windowed", marks=pytest.mark.slow), "alibi"])
def test_a_forgetting_cache_decodes_the_full_forward_with_bounded_keys(position, tokens):
    """Decoding through ForgettingCache equals the full forward (1e-5), greedy generation with it
    equals generation without a cache (also for a left-padded batch), and it holds no more keys
    than the scheme can still attend to: exact ALiBi every key, windowed ALiBi its window plus one,
    Positional LSH at most its largest block."""
    from poslsh_cli.lm.kvcache import ForgettingCache

    a = tokens[0]
    model = _model(position)
    specs = [model.poslsh_position.attention_spec(layer, a.shape[1], None) for layer in range(ARCH.layers)]
    with torch.no_grad():
        full = model(a, use_cache=False).logits[0]
        cache = ForgettingCache(model)
        out = model(a[:, :100], cache=cache, use_cache=True)
        steps, kept = [out.logits[0]], []
        for t in range(100, a.shape[1]):
            out = model(a[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits[0])
            kept.append(cache.kept())
        assert (torch.cat(steps) - full).abs().max().item() < TOL
        # taking tokens back (assisted decoding's rejected drafts): the last one decodes again as before
        cache.crop(-1)
        again = model(a[:, -1:], cache=cache, use_cache=True).logits[0]
        assert (again - full[-1:]).abs().max().item() < TOL
        # the most tokens every layer lets go: all but one held for exact ALiBi (it forgets nothing), several for
        # Positional LSH but not all (it has forgotten keys they need); one more is refused, changing no layer
        most = cache.kept() - 1
        back = max(k for k in range(1, most + 1) if all(lay.refusal(k) is None for lay in cache.layers))
        if position == "alibi":
            assert back == most
        if position == "poslsh":
            assert 2 <= back < most
        if back < most:
            before = _layer_state(cache)
            with pytest.raises(ValueError, match="forgotten"):
                cache.crop(-(back + 1))
            assert _same_layers(_layer_state(cache), before)
        cache.crop(-back)  # accepted by every layer: decoding those tokens again gives the full forward's logits
        assert len({(lay.seen, lay.keys.shape[-2]) for lay in cache.layers}) == 1
        again = torch.cat([model(a[:, t:t + 1], cache=cache, use_cache=True).logits[0]
                           for t in range(a.shape[1] - back, a.shape[1])])
        assert (again - full[-back:]).abs().max().item() < TOL
        x = torch.zeros(2, 60, dtype=torch.long)
        mask = torch.zeros(2, 60, dtype=torch.long)
        x[0], mask[0] = a[0, :60], 1
        x[1, 15:], mask[1, 15:] = a[0, :45], 1
        batch, logits = _greedy(model, x, 20, attention_mask=mask, cache=ForgettingCache(model))
        alone = [_greedy(model, p, 20, use_cache=False) for p in (a[:, :60], a[:, :45])]
    assert torch.equal(batch[0], alone[0][0][0]) and torch.equal(batch[1, 15:], alone[1][0][0])
    for b in range(2):  # each row's logits at every generated step, not only the tokens they pick
        assert (logits[b] - alone[b][1][0]).abs().max().item() < TOL
    if position == "alibi":
        assert kept[-1] == a.shape[1]
    elif position == "windowed":
        assert max(kept) <= max(specs[0].window) + 2
    else:  # one offset for every layer: the largest block of any layer
        assert max(kept) <= max(p.b_max for spec in specs for p in spec.partitions) + 2
        assert max(kept) < a.shape[1] // 2


def _layer_state(cache) -> list:
    return [(lay.seen, lay.offset, lay.keys.clone(), lay.values.clone(), lay.positions.clone()) for lay in cache.layers]


def _same_layers(a: list, b: list) -> bool:
    return all(x[:2] == y[:2] and all(torch.equal(u, w) for u, w in zip(x[2:], y[2:])) for x, y in zip(a, b))


def test_a_refused_crop_leaves_every_layer_of_the_forgetting_cache_as_it_was(tokens):
    """Positional LSH, 2 layers, s=8, after 300 tokens: taking 4 tokens back is possible in layer 0
    but not in layer 1 (it would need a forgotten key). The refusal leaves every layer as it was,
    and decoding on gives the full forward's logits."""
    import copy

    from poslsh_cli.lm.kvcache import ForgettingCache

    a = torch.cat([tokens[0], tokens[1][:, :20]], 1)  # 320 tokens: 300 decoded, then 20 more after the refusal
    model = _model("poslsh")
    with torch.no_grad():
        full = model(a, use_cache=False).logits[0]
        cache = ForgettingCache(model)
        model(a[:, :100], cache=cache, use_cache=True)
        for t in range(100, 300):
            model(a[:, t:t + 1], cache=cache, use_cache=True)
        copy.deepcopy(cache.layers[0]).crop(-4)  # layer 0 alone accepts: the refusal comes from a later layer
        before = _layer_state(cache)
        with pytest.raises(ValueError, match="forgotten"):
            cache.crop(-4)
        assert _same_layers(_layer_state(cache), before)
        steps = [model(a[:, t:t + 1], cache=cache, use_cache=True).logits[0] for t in range(300, 320)]
    assert (torch.cat(steps) - full[300:]).abs().max().item() < TOL
