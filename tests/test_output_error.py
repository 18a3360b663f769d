"""poslsh output-error end to end: the shipped MiniLM, tiny decoders, bad input, replay."""
import json

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import RUN, poslsh, status_of
from poslsh_cli.verdicts.claims import Status
from poslsh_cli.app import registry
from poslsh_cli.attention import alibi_chunked, poslsh_attention
from poslsh_cli.numerics.metrics import output_errors
from poslsh_cli.numerics.sampling import Partitions, alibi_sigmas

from test_capture import save_tiny



def test_minilm_rows_columns_and_replay(tmp_path):
    out = tmp_path / "run"
    r = poslsh("output-error", "n=96", "layers=[0,5]", "s=[1,8]", "trials=2", "save_qkv=true", f"out={out}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "results.csv")
    for col in ["model", "layer", "head", "sigma", "causal", "n", "s", "trial", "seed", "method", "rel_fro",
                "max_row_rel", "seconds", "qkv_file"]:
        assert col in df.columns
    assert set(df.method) == {"poslsh", "no_bias", "fixed_block", "windowed"}
    assert (df.model == "minilm").all() and not df.causal.any()
    p = df[df.method == "poslsh"]
    assert len(p) == 2 * 2 * 2 * 12
    np.testing.assert_allclose(sorted(p.sigma.unique()), sorted(alibi_sigmas(12)))
    assert (df.rel_fro >= 0).all() and (df.max_row_rel >= df.rel_fro * 0.999).all()
    # the saved tensors and a row's seed reproduce the row exactly
    row = p[(p.layer == 5) & (p.s == 8) & (p.trial == 1)].iloc[3]
    data = np.load(out / row.qkv_file)
    assert data["q"].shape == (12, 96, 32) and data["input_ids"].shape == (96,)
    q, k, v = (torch.as_tensor(data[x])[None] for x in ("q", "k", "v"))
    r = poslsh("sample", "n=96", f"sigma={row.sigma}", "s=8", f"seed={row.seed}", f"out={tmp_path / 'masks'}")
    assert r.exit_code == 0, r.output
    m = np.load(tmp_path / "masks" / "masks.npz")
    h = int(row["head"])
    part = Partitions(96, float(row.sigma), m["widths"], m["shifts"])
    sl = slice(h, h + 1)
    scale = float(data["scaling"])
    exact = alibi_chunked(q[:, sl].double(), k[:, sl].double(), v[:, sl].double(),
                          torch.tensor([row.sigma], dtype=torch.float64), False, scale=scale)[0]
    approx = poslsh_attention(q[:, sl], k[:, sl], v[:, sl], [part], False, scale=scale)[0]
    rel, _ = output_errors(exact, approx)
    assert rel[0] == pytest.approx(row.rel_fro, rel=1e-6)


def test_error_falls_with_s_on_minilm(tmp_path):
    r = poslsh("output-error", "n=256", "layers=[2]", "s=[1,4,16,64]", "trials=2", "baselines=[no_bias]",
               f"out={tmp_path}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "results.csv")
    med = df[df.method == "poslsh"].groupby("s")["rel_fro"].median()
    assert med.is_monotonic_decreasing
    assert med[64] < df[df.method == "no_bias"]["rel_fro"].median()
    assert poslsh("plot", tmp_path).exit_code == 0
    assert (tmp_path / "figures" / "output_error_vs_s.png").exists()
    assert (tmp_path / "figures" / "output_error_heatmap.pdf").exists()


def test_decoder_checkpoint_path_is_causal(tmp_path):
    path = save_tiny("qwen3", tmp_path / "qwen3")
    out = tmp_path / "run"
    r = poslsh("output-error", f"model={path}", "n=64", "s=[2]", "trials=1", "sigma=4", f"out={out}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "results.csv")
    assert df.causal.all() and (df.sigma == 4.0).all() and set(df.layer) == {0, 1}
    assert df.model.iloc[0] == str(path)
    cfg = (out / "config.yaml").read_text()
    assert "name: custom" in cfg and str(path) in cfg
    r = poslsh("output-error", f"model={path}", "n=64", "s=[2]", "trials=1", "causal=false", "layers=[1]",
               "heads=[0,3]", "baselines=[]", f"out={tmp_path / 'bi'}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "bi" / "results.csv")
    assert not df.causal.any() and sorted(df["head"].unique()) == [0, 3] and set(df.method) == {"poslsh"}


@pytest.mark.parametrize("args,needle", [
    (["model={tmp}/nope"], "does not exist"),
    (["model={tmp}"], "no config.json"),
    (["model=minilm", "n=1000"], "exceeds the model's 512 positions"),
    (["text={tmp}/short.txt", "n=64"], "fewer than n=64"),
    (["text={tmp}/missing.txt"], "no such file"),
    (["text={tmp}/latin.txt"], "latin.txt is not UTF-8: byte offset 6 "),
    (["text={tmp}/short.txt", "encoding=nope"], "encoding='nope'"),
    (["layers=[9]", "n=32"], "layer 9 out of range"),
    (["heads=[12]", "n=32"], "head 12 out of range"),
    (["model=mistral-7b"], "has no path"),
    (["sigma=0"], "sigma must be > 0"),
    (["baselines=[nope]"], "unknown baseline"),
    (["dtype=int8"], "dtype must be"),
    (["causal=maybe"], "causal must be"),
])
def test_bad_input_one_line_nothing_written(tmp_path, monkeypatch, args, needle):
    monkeypatch.delenv("POSLSH_MODELS", raising=False)
    (tmp_path / "short.txt").write_text("only a handful of words here")
    (tmp_path / "latin.txt").write_bytes("Le café est prêt. ".encode("latin-1") * 100)
    out = tmp_path / "out"
    r = poslsh("output-error", *[a.format(tmp=tmp_path) for a in args], "s=[1]", "trials=1", f"out={out}")
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not out.exists()


def test_checkpoint_without_safetensors_and_unsupported(tmp_path):
    import transformers as tf

    path = save_tiny("llama", tmp_path / "bin")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"x")
    r = poslsh("output-error", f"model={path}", "n=32", "s=[1]", "trials=1", f"out={tmp_path / 'o1'}")
    assert r.exit_code == 2 and "no *.safetensors" in r.stderr
    gpt2 = tmp_path / "gpt2"
    tf.GPT2Model(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(gpt2)
    r = poslsh("output-error", f"model={gpt2}", "n=32", "s=[1]", "trials=1", f"out={tmp_path / 'o2'}")
    assert r.exit_code == 2 and "cannot capture architecture 'gpt2'" in r.stderr
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_preset_reads_poslsh_models(tmp_path, monkeypatch):
    save_tiny("mistral", tmp_path / "Mistral-7B-v0.1")
    monkeypatch.setenv("POSLSH_MODELS", str(tmp_path))
    r = poslsh("output-error", "model=mistral-7b", "n=32", "s=[1]", "trials=1", "layers=[0]",
               f"out={tmp_path / 'run'}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "run" / "results.csv")
    assert (df.model == "mistral-7b").all() and df.causal.all()
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["status"] == "complete"


def test_paper_output_metrics_equal_a_numpy_recount():
    from poslsh_cli.numerics.metrics import paper_output_metrics

    g = np.random.default_rng(0)
    e = g.standard_normal((3, 50, 8))
    a = e + 0.1 * g.standard_normal((3, 50, 8))
    m = paper_output_metrics(torch.as_tensor(e), torch.as_tensor(a))
    for h in range(3):
        d = np.linalg.norm(e[h] - a[h])
        assert m["rel_sym"][h] == pytest.approx(d / (0.5 * (np.linalg.norm(e[h]) + np.linalg.norm(a[h]))), rel=1e-12)
        row = np.linalg.norm(e[h] - a[h], axis=1) / (0.5 * (np.linalg.norm(e[h], axis=1) + np.linalg.norm(a[h], axis=1)))
        np.testing.assert_allclose([m["row_rel_median"][h], m["row_rel_p90"][h], m["row_rel_p99"][h]],
                                   np.quantile(row, [0.5, 0.9, 0.99]), rtol=1e-12)
        cos = (e[h] * a[h]).sum() / (np.linalg.norm(e[h]) * np.linalg.norm(a[h]))
        assert m["cosine"][h] == pytest.approx(cos, rel=1e-12)
    same = paper_output_metrics(torch.as_tensor(e), torch.as_tensor(e))
    assert (same["rel_sym"] == 0).all() and np.allclose(same["cosine"], 1)


def test_official_convention_is_the_papers_script_computation(tmp_path):
    """convention=official: softmax(K Q^T / sqrt(d) + log M~) V, bidirectional, recomputed here
    densely in float64 from the saved q, k, v and the row's masks (the script's formula, with the
    log clamped at 1e-20); exact ALiBi likewise with log L*. backend=dense gives the same rows as
    the block path."""
    out = tmp_path / "run"
    r = poslsh("output-error", "n=64", "layers=[1]", "heads=[0,11]", "s=[3]", "trials=1", "convention=official",
               "causal=true", "baselines=[]", "save_qkv=true", f"out={out}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "results.csv")
    assert (df.convention == "official").all() and not df.causal.any() and not df.exp_overflow.any()
    data = np.load(out / df.qkv_file.iloc[0])
    for _, row in df.iterrows():
        i = list(data["heads"]).index(int(row["head"]))
        # the saved tensors are what the official computation used: keys in the queries' place
        Kq, Qk, V = (torch.as_tensor(data[x][i]).double() for x in ("q", "k", "v"))
        assert float(data["scaling"]) == pytest.approx(1 / np.sqrt(Kq.shape[-1]))
        r2 = poslsh("sample", "n=64", f"sigma={row.sigma}", "s=3", f"seed={row.seed}",
                    f"out={tmp_path / ('m%d' % i)}")
        assert r2.exit_code == 0
        m = np.load(tmp_path / ("m%d" % i) / "masks.npz")
        bins = torch.as_tensor(m["bins"])  # (s, n)
        Mt = (bins[:, :, None] == bins[:, None, :]).double().mean(0)
        idx = torch.arange(64, dtype=torch.float64)
        Ls = torch.exp(-(idx[:, None] - idx[None, :]).abs() / row.sigma)
        S = Kq @ Qk.T / np.sqrt(Kq.shape[-1])
        o1 = torch.softmax(S + Ls.clamp_min(1e-20).log(), -1) @ V
        o2 = torch.softmax(S + Mt.clamp_min(1e-20).log(), -1) @ V
        rel = (o1 - o2).norm() / (0.5 * (o1.norm() + o2.norm()))
        assert row.rel_sym == pytest.approx(float(rel), rel=1e-5)
        cos = (o1 * o2).sum() / (o1.norm() * o2.norm())
        assert row.cosine == pytest.approx(float(cos), rel=1e-6)
    dense = tmp_path / "dense"
    r = poslsh("output-error", "n=64", "layers=[1]", "heads=[0,11]", "s=[3]", "trials=1", "convention=official",
               "baselines=[]", "backend=dense", f"out={dense}")
    assert r.exit_code == 0, r.output
    np.testing.assert_allclose(pd.read_csv(dense / "results.csv").rel_sym, df.rel_sym, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# output-error: decay, and the baselines


def output_table(poslsh_at_64, baselines=("no_bias", "fixed_block"), exponent=-0.5):
    rows = []
    for layer in (0, 1):
        for head in range(4):
            for s in (1, 8, 16, 32, 64):
                for t in range(2):
                    rows.append(dict(model="m", layer=layer, head=head, sigma=2.0, causal=False, n=64, s=s, trial=t,
                                     seed=t, method="poslsh", rel_fro=poslsh_at_64 * (s / 64) ** exponent * (1 + 0.01 * t),
                                     max_row_rel=1.0, seconds=0.1, window=-1))
            for b in baselines:
                rows.append(dict(model="m", layer=layer, head=head, sigma=2.0, causal=False, n=64, s=0, trial=0,
                                 seed=-1, method=b, rel_fro=0.2, max_row_rel=1.0, seconds=0.1, window=-1))
    return pd.DataFrame(rows)


def test_baseline_verdicts_need_their_baseline():
    sec = registry.get('output-error').report(RUN, output_table(0.05))
    assert status_of(sec, "no_bias baseline") is Status.SUPPORTED and status_of(sec, "fixed_block baseline") is Status.SUPPORTED
    assert status_of(sec, "falls like") is Status.SUPPORTED
    sec = registry.get('output-error').report(RUN, output_table(0.5))
    assert status_of(sec, "no_bias baseline") is Status.NOT_SUPPORTED
    sec = registry.get('output-error').report(RUN, output_table(0.05, baselines=()))  # baselines=[]
    assert status_of(sec, "no_bias baseline") is Status.NOT_MEASURED and status_of(sec, "fixed_block baseline") is Status.NOT_MEASURED
    sec = registry.get('output-error').report(RUN, output_table(0.05, baselines=("no_bias",)))
    assert status_of(sec, "no_bias baseline") is Status.SUPPORTED and status_of(sec, "fixed_block baseline") is Status.NOT_MEASURED


def test_windowed_sentence_follows_the_numbers():
    df = output_table(0.05)
    win = df[df.method == "no_bias"].assign(method="windowed", window=8)
    sec = registry.get('output-error').report(RUN, pd.concat([df, win.assign(rel_fro=0.01)]))
    assert any("is more accurate than Positional LSH" in p for p in sec.paragraphs)
    sec = registry.get('output-error').report(RUN, pd.concat([df, win.assign(rel_fro=0.5)]))
    assert any("is less accurate than Positional LSH" in p for p in sec.paragraphs)
