"""``poslsh perplexity``: bits per byte of trained models at several evaluation lengths, under
their own position scheme and with another attention swapped in at inference.

``poslsh perplexity RUN_OR_CHECKPOINT... lengths=[...] attention=[own,alibi,poslsh] s=[...]``:
each train run directory expands to its cells' final checkpoints. Bits per byte = mean
next-byte cross-entropy / ln 2 over every predicted position of non-overlapping windows of the
evaluation length (``stride=`` for sliding windows); perplexity = exp(mean cross-entropy).
Evaluation text: each checkpoint's own validation split (checked against the corpus hash it was
trained on), or ``data=PATH``. Lengths default to L, 2L, 4L, 8L of the training length L (the
shape of the ALiBi paper's Figure 1).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from poslsh_cli.claims import Section, Status, Verdict, combine
from poslsh_cli.config import ConfigError, Spec, check, key
from poslsh_cli.experiment import Experiment, MemoryNeed, check_device, choices, resolve_device
from poslsh_cli.positions import Position
from poslsh_cli.sampling import derive_seed

COLUMNS = ("checkpoint", "position", "attention", "s", "length", "trial", "seed", "tokens", "loss", "bits_per_byte",
           "ppl", "seconds", "trained_len", "trained_s", "finetuned", "run_seed", "bits_per_token", "kl")
LN2 = math.log(2.0)


#: Attention swapped in at inference: ``own`` (the model's forward as trained) or any position
#: scheme that can replace another model's attention (every one but ``rope``, which changes q and k).
Attention = choices("Attention", [p for p in Position if p is not Position.ROPE], __name__, OWN="own")


@dataclass(frozen=True)
class PerplexitySpec(Spec):
    checkpoints: tuple[str, ...] = key("train run directories or checkpoint directories (or give them as plain "
                                       "arguments: poslsh perplexity RUN...)", [], empty=True)
    lengths: Optional[tuple[int, ...]] = key("evaluation lengths in bytes; null: L, 2L, 4L, 8L of each checkpoint's "
                                             "training length", None, ge=2)
    attention: tuple[Attention, ...] = key("attention at inference: own (as trained), "
                                           + ", ".join(a.value for a in Attention if a is not Attention.OWN),
                                           [Attention.OWN], noun="attention")
    s: tuple[int, ...] = key("Positional-LSH masks per head at inference (attention=poslsh)", [10], ge=1)
    window_sigmas: float = key("windowed: keys with |i-j| <= ceil(c sigma_h)", 4.0, gt=0)
    trials: int = key("mask draws per Positional-LSH point", 1, ge=1)
    stride: Optional[int] = key("sliding windows advancing by stride (each scores its last stride bytes); "
                                "null: non-overlapping windows", None, ge=1)
    data: Optional[str] = key("a text file or folder to evaluate on; null: each checkpoint's validation split", None)
    max_tokens: int = key("bytes of evaluation text used per length", 65536, ge=2)
    batch: int = key("windows per forward pass", 4, ge=1)
    device: str = key("auto (CUDA when present), cpu, cuda, cuda:N", "auto")

    def check(self) -> None:
        check_device(self.device)


@dataclass
class Checkpoint:
    path: Path
    name: str  # as shown in results: relative to the run it came from, or the path
    info: dict  # poslsh_train.json (empty for a foreign checkpoint)
    position: str
    trained_len: int
    tokens: Any = None  # evaluation token ids: bytes for poslsh's byte models, the checkpoint's tokens otherwise
    bytes_per_token: float = 1.0  # UTF-8 bytes of the evaluation text per token


@dataclass
class Context:
    checkpoints: dict[str, Checkpoint]
    device: Any
    loaded: dict = field(default_factory=dict)  # name -> (model, own PositionState)
    meta: dict = field(default_factory=dict)


def _expand(entry: str) -> list[tuple[Path, str]]:
    """A checkpoint directory, or a train run directory -> its cells' final checkpoints."""
    from poslsh_cli.rundir import results

    p = Path(entry).expanduser().resolve()
    if not p.exists():
        raise ConfigError(f"{entry} does not exist")
    if (p / "config.json").is_file():
        return [(p, str(p))]
    if (p / "config.yaml").is_file() and ((p / "cells").is_dir() or (p / "results.csv").is_file()):
        df = results(p)
        if len(df) and "checkpoint" not in df.columns:
            raise ConfigError(f"{entry}: not a train run (its results have no checkpoint column)")
        if not len(df):
            raise ConfigError(f"{entry}: the train run has no finished cell yet")
        return [(p / c, f"{p.name}/{c}") for c in df.checkpoint]
    if p.is_dir():
        found = sorted(q.parent for q in p.rglob("final/config.json"))
        if found:
            return [(q, str(q.relative_to(p.parent))) for q in found]
    raise ConfigError(f"{entry}: neither a checkpoint directory (config.json) nor a train run")


def memory(spec: PerplexitySpec) -> MemoryNeed | None:
    """Peak bytes at the longest evaluation length: the weights (float32), the float64 logits and
    log-probabilities of a batch (twice when another attention is compared with the model's own),
    the hidden states, and the attention's own memory (per-sample outputs of Positional LSH, the
    exact path's bounded chunks). None when a checkpoint cannot be read yet (prepare says why)."""
    from poslsh_cli.attention import CHUNK_ELEMENTS
    from poslsh_cli.capture import weights_bytes

    need, what = 0.0, ""
    try:
        entries = [x for e in spec.checkpoints for x in _expand(e)]
    except ConfigError:
        return None
    for path, name in entries:
        try:
            cfg = json.loads((path / "config.json").read_text())
            info = json.loads((path / "poslsh_train.json").read_text()) if (path / "poslsh_train.json").exists() else {}
        except (OSError, ValueError):
            return None
        L = max(spec.lengths) if spec.lengths is not None else 8 * int(info.get("seq_len", 0) or 0)
        hidden = int(cfg.get("hidden_size") or cfg.get("d_model") or cfg.get("n_embd") or 64)
        heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or cfg.get("n_heads") or 1)
        vocab = int(cfg.get("vocab_size") or 256)
        s = max(spec.s) if Attention.POSLSH in spec.attention else int(info.get("s", 0) or 0)
        act = spec.batch * L * (3 * 8.0 * vocab + 16 * 4.0 * hidden) + spec.batch * 4.0 * max(1, s) * L * hidden * 2
        b = weights_bytes(path) + act + 2 * 4.0 * CHUNK_ELEMENTS
        if b > need:
            need, what = b, f"{name} at length {L}"
    return MemoryNeed(need, what, spec.device) if what else None


def prepare(spec: PerplexitySpec) -> Context:
    from poslsh_cli.capture import check_checkpoint, refuse_rotary_falcon
    from poslsh_cli.data import load_corpus

    from poslsh_cli.experiments.train import fast_cpu_math

    check(len(spec.checkpoints) > 0, "give at least one train run or checkpoint (poslsh perplexity RUN...)")
    device = resolve_device(spec.device)
    fast_cpu_math()
    cks: dict[str, Checkpoint] = {}
    corpora: dict[tuple, Any] = {}
    for entry in spec.checkpoints:
        for path, name in _expand(entry):
            check_checkpoint(path)
            info_file = path / "poslsh_train.json"
            info = json.loads(info_file.read_text()) if info_file.exists() else {}
            cfg = json.loads((path / "config.json").read_text())
            refuse_rotary_falcon(path, cfg.get("model_type"), bool(cfg.get("alibi")))
            foreign = not info
            position = (cfg.get("poslsh") or {}).get("position") or (
                "alibi" if cfg.get("model_type") in ("bloom", "mpt") or cfg.get("alibi") else "own")
            trained = int(info.get("seq_len", 0))
            if spec.lengths is None and not trained:
                raise ConfigError(f"{path}: no training length recorded; give lengths=[...]")
            if spec.data is not None:
                src = (spec.data, 0.0)
            elif info.get("data"):
                src = (info["data"], float(info.get("val_fraction", 0.1)))
            else:  # a checkpoint poslsh did not train: the builtin text's validation part
                src = ("builtin", 0.1)
            if src not in corpora:
                corpora[src] = load_corpus(src[0], src[1] or 1e-9, min_bytes=0)
            corpus = corpora[src]
            if spec.data is None and info.get("data_sha256") and corpus.sha256 != info["data_sha256"]:
                raise ConfigError(f"{path}: data={src[0]} is not the corpus it was trained on (hash differs); "
                                  "give data=PATH to evaluate on other text")
            tokens = corpus.val if spec.data is None else _whole(corpus)
            per_token = 1.0
            if foreign and cfg.get("vocab_size") != 256:
                tokens, per_token = _tokenize(path, tokens)
            need = max(spec.lengths or [trained])
            if len(tokens) < need:
                raise ConfigError(f"the evaluation text has {len(tokens)} tokens, fewer than one window of {need}")
            cks[name] = Checkpoint(path, name, info, position, trained, tokens, per_token)
    return Context(cks, device, meta={"evaluated": {n: c.info.get("data_sha256") for n, c in cks.items()}})


def _tokenize(path: Path, data: Any) -> tuple[Any, float]:
    """Token ids of the evaluation bytes with the checkpoint's own tokenizer, and bytes per token."""
    import numpy as np

    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ConfigError(f"{path}: not byte-level and no tokenizer to read text with ({str(exc).splitlines()[0]})") from None
    tok.model_max_length = 1 << 62  # the whole text is encoded once, then cut into windows: no length warning
    ids = np.asarray(tok(bytes(data).decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"],
                     dtype=np.int64)
    return ids, len(data) / max(1, len(ids))


def _whole(corpus: Any) -> Any:
    import numpy as np

    return np.concatenate([corpus.train, corpus.val])


def lengths_of(spec: PerplexitySpec, ck: Checkpoint) -> tuple[int, ...]:
    return spec.lengths if spec.lengths is not None else tuple(ck.trained_len * m for m in (1, 2, 4, 8))


def stochastic(attention: Attention, ck: Checkpoint) -> bool:
    return attention is Attention.POSLSH or (attention is Attention.OWN and ck.position == Position.POSLSH.value)


def cells(spec: PerplexitySpec, ctx: Context | None = None) -> list[dict[str, Any]]:
    out = []
    for name, ck in (ctx.checkpoints.items() if ctx is not None else []):
        for att in spec.attention:
            for s in (spec.s if att is Attention.POSLSH else (0,)):
                for length in lengths_of(spec, ck):
                    for trial in range(spec.trials if stochastic(att, ck) else 1):
                        out.append({"checkpoint": name, "attention": att.value, "s": s, "length": length,
                                    "trial": trial})
    return out


def _model(ctx: Context, ck: Checkpoint) -> tuple[Any, Any]:
    from poslsh_cli.positions import load_model

    if ck.name not in ctx.loaded:
        ctx.loaded.clear()  # one model in memory at a time
        ctx.loaded[ck.name] = load_model(ck.path, str(ctx.device))
    return ctx.loaded[ck.name]


def scheme_for(spec: PerplexitySpec, attention: Attention, s: int, own: Any, seed: int) -> Any:
    """The position state for ``attention``: the trained one for ``own``; otherwise the named
    scheme with the checkpoint's sigmas (its ALiBi slopes)."""
    from poslsh_cli.positions import PositionState

    if attention is Attention.OWN:
        return own
    return PositionState(Position(attention.value), own.sigmas, num_samples=s, window_sigmas=spec.window_sigmas,
                         seed=seed)


def evaluate_swapped(model: Any, own: Any, state: Any, tokens: Any, length: int, stride: int | None,
                     max_tokens: int, batch: int, key: str) -> tuple[float, int, float]:
    """(sum of losses, predicted positions, sum of KL(own || swapped)) over the evaluation windows:
    the model under ``state``, and, when ``state`` is not its own, also under ``own`` on the same
    windows, for the KL divergence of the next-token distributions (nats per position)."""
    import numpy as np
    import torch

    from poslsh_cli.data import eval_windows
    from poslsh_cli.positions import install

    windows = list(eval_windows(tokens, length, stride, max_tokens))
    device = next(model.parameters()).device
    total, count, kl = 0.0, 0, 0.0
    for st in {id(own): own, id(state): state}.values():
        st.eval_key = key
    try:
        with torch.no_grad():
            for a in range(0, len(windows), batch):
                group = windows[a:a + batch]
                x = torch.as_tensor(np.stack([w.tokens for w in group]), device=device)
                install(model, state)
                logp = torch.log_softmax(model(input_ids=x).logits.double()[:, :-1], dim=-1)  # (b, L-1, V)
                nll = -logp.gather(-1, x[:, 1:, None])[..., 0]
                ref = None
                if state is not own:
                    install(model, own)
                    ref = torch.log_softmax(model(input_ids=x).logits.double()[:, :-1], dim=-1)
                for i, w in enumerate(group):  # target p >= score_from is predicted at p - 1
                    total += float(nll[i, w.score_from - 1:].sum())
                    count += length - w.score_from
                    if ref is not None:
                        r, p = ref[i, w.score_from - 1:], logp[i, w.score_from - 1:]
                        kl += float((r.exp() * (r - p)).sum())
    finally:
        install(model, own)
        for st in (own, state):
            st.eval_key = None
    return total, count, kl


def run_cell(spec: PerplexitySpec, key: dict[str, Any], ctx: Context, work: Any = None) -> tuple[list[dict], dict]:
    ck = ctx.checkpoints[key["checkpoint"]]
    att, s, length, trial = Attention(key["attention"]), key["s"], key["length"], key["trial"]
    model, own = _model(ctx, ck)
    seed = derive_seed(spec.seed, "perplexity", ck.name, att.value, s, trial)
    state = scheme_for(spec, att, s, own, seed)
    t0 = time.perf_counter()
    total, count, kl = evaluate_swapped(model, own, state, ck.tokens, length, spec.stride, spec.max_tokens,
                                        spec.batch, key=f"perplexity-{trial}")
    loss = total / count
    used_s = s if att is Attention.POSLSH else (int(ck.info.get("s", 0)) if stochastic(att, ck) else 0)
    row = {"checkpoint": ck.name, "position": ck.position, "attention": att.value, "s": used_s, "length": length,
           "trial": trial, "seed": seed if stochastic(att, ck) else -1, "tokens": count, "loss": loss,
           "bits_per_byte": loss / LN2 / ck.bytes_per_token, "ppl": math.exp(loss), "seconds": time.perf_counter() - t0,
           "trained_len": ck.trained_len, "trained_s": int(ck.info.get("s", 0)),
           "finetuned": "yes" if ck.info.get("init") else "no", "run_seed": ck.info.get("seed", -1),
           "bits_per_token": loss / LN2, "kl": kl / count if att is not Attention.OWN else 0.0}
    return [row], {}


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    """Bits per byte per (checkpoint scheme, attention, s) and evaluation length, mean over
    trials and training seeds."""
    lengths = sorted(df.length.unique())
    head = ["trained", "finetuned", "attention", "s"] + [f"L={n}" for n in lengths]
    rows = []
    keys = ["position", "trained_s", "finetuned", "attention", "s"]
    for k, g in df.groupby(keys, sort=False):
        by = g.groupby("length").bits_per_byte.mean()
        rows.append([k[0] + (f" s={k[1]}" if k[1] else ""), k[2], k[3], str(k[4]) if k[4] else "-"]
                    + [f"{by[n]:.4f}" if n in by else "-" for n in lengths])
    return head, rows


# ---------------------------------------------------------------------------------------------
# figures


ORDER = ("none", "fixed_block", "windowed", "alibi", "poslsh", "rope")
MARKERS = {"own": "o", "alibi": "s", "poslsh": "^", "windowed": "D", "fixed_block": "x", "none": "v"}


def _scheme(r: Any) -> str:
    return r["position"] + (f" s={r['trained_s']}" if r["trained_s"] else "")


def _schemes(df: Any) -> list[str]:
    """Trained schemes in a fixed order (no bias first, Positional LSH by s), so colours are stable."""
    keys = {(_scheme(r), ORDER.index(r["position"]) if r["position"] in ORDER else len(ORDER), int(r["trained_s"] or 0))
            for _, r in df[["position", "trained_s"]].drop_duplicates().iterrows()}
    return [k for k, *_ in sorted(keys, key=lambda t: (t[1], t[2], t[0]))]


def plot(run: Path, df: Any) -> list[Path]:
    """bits per byte against evaluation length under each model's own attention (one colour per
    trained scheme, shaded: range over seeds and draws), the same models at the training length with
    another attention swapped in, and bits per byte against inference-time s."""
    from poslsh_cli.plotting import pyplot, save

    plt = pyplot()
    paths = []
    groups = [("from scratch", df[df.finetuned != "yes"]), ("fine-tuned", df[df.finetuned == "yes"])]
    groups = [(t, g) for t, g in groups if len(g)]
    schemes = _schemes(df)
    color = {k: f"C{i % 10}" for i, k in enumerate(schemes)}
    width = 5.6 * len(groups) + 1.8
    fig, axes = plt.subplots(2, len(groups), figsize=(width, 8.0), squeeze=False,
                             gridspec_kw={"height_ratios": (1.2, 1)})
    for col, (title, g) in enumerate(groups):
        own = g[g.attention == "own"]
        curves = {lab: h.groupby("length").bits_per_byte.agg(["mean", "min", "max"]).reset_index()
                  for lab, h in own.assign(label=own.apply(_scheme, axis=1)).groupby("label", sort=False)}
        best = min(float(c["mean"].min()) for c in curves.values()) if curves else 0.0
        for row, ax in enumerate(axes[:, col]):
            for lab, agg in curves.items():
                ax.plot(agg.length, agg["mean"], "-", marker="o", ms=3.5, color=color[lab], label=lab)
                ax.fill_between(agg.length, agg["min"], agg["max"], color=color[lab], alpha=0.15, lw=0)
            ax.axvline(int(g.trained_len.max()), color="k", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.25)
            ax.set_ylabel("bits per byte (own attention)")
            if row == 0:
                ax.set_title(f"{title}: length extrapolation")
            else:
                lo, hi = zoom_limits([v for c in curves.values() for v in c["min"]],
                                     [v for c in curves.values() for v in c["max"]], best)
                ax.set_ylim(lo, hi)
                ax.set_title(f"zoom: the curves within 0.3 of the best ({best:.3f})")
                ax.set_xlabel("evaluation length (bytes); dotted: training length")
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_legend_handles_labels()[0]}
    fig.legend([handles[k] for k in schemes if k in handles], [k for k in schemes if k in handles],
               loc="center right", title="trained with", frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 1.8 / width, 1))
    paths += save(fig, run, "bpb_vs_length")

    swapped = df[df.attention != "own"]
    if len(swapped):
        fig, axes = plt.subplots(1, len(groups), figsize=(5.6 * len(groups) + 1.8, 0.9 + 0.38 * len(schemes)),
                                 squeeze=False)
        for ax, (title, g) in zip(axes[0], groups):
            g = g[g.length == g.trained_len]
            rows = [k for k in schemes if k in set(g.apply(_scheme, axis=1))]
            g = g.assign(scheme=g.apply(_scheme, axis=1))
            for att, h in g.groupby("attention"):
                for (sch, s), hh in h.groupby(["scheme", "s"]):
                    lab = att if att != "poslsh" else f"poslsh s={s}"
                    ax.plot(hh.bits_per_byte.mean(), rows.index(sch), MARKERS.get(att, "o"), ms=6,
                            mfc="none" if att != "own" else None, color=color[sch] if att == "own" else "0.25",
                            label=lab)
            ax.set_yticks(range(len(rows)), rows)
            ax.invert_yaxis()
            ax.set_xlabel("bits per byte at the training length")
            ax.set_title(f"{title}: attention swapped at inference")
            ax.grid(True, axis="x", alpha=0.25)
        from matplotlib.lines import Line2D

        labels = sorted({lab for ax in axes[0] for lab in ax.get_legend_handles_labels()[1]},
                        key=lambda t: (t != "own", t))
        marks = [Line2D([], [], ls="", marker=MARKERS.get(lab.split()[0], "o"), ms=6, color="0.25",
                        mfc="0.25" if lab == "own" else "none") for lab in labels]
        fig.legend(marks, [f"{lab} (filled: the scheme's colour)" if lab == "own" else lab for lab in labels],
                   loc="center right", title="run with", frameon=False)
        fig.tight_layout(rect=(0, 0, 1 - 1.8 / (5.6 * len(groups) + 1.8), 1))
        paths += save(fig, run, "bpb_swapped")

    p = df[df.attention == "poslsh"]
    if p.s.nunique() > 1:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for i, ((pos, ts, length), g) in enumerate(p.groupby(["position", "trained_s", "length"])):
            agg = g.groupby("s").bits_per_byte.mean()
            ax.plot(agg.index, agg.values, "o-", ms=3.5, color=f"C{i % 10}",
                    label=f"trained {pos}{f' s={ts}' if ts else ''}, L={length}")
            own = df[(df.attention == "own") & (df.position == pos) & (df.trained_s == ts) & (df.length == length)
                     & (df.checkpoint.isin(g.checkpoint))]
            if len(own):
                ax.axhline(own.bits_per_byte.mean(), color=f"C{i % 10}", lw=0.9, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("Positional-LSH masks per head at inference (s)")
        ax.set_ylabel("bits per byte")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend()
        ax.set_title("Inference-time s (dashed: the model's own attention)")
        paths += save(fig, run, "bpb_vs_s")
    return paths


def zoom_limits(lows: list[float], highs: list[float], best: float, within: float = 0.3) -> tuple[float, float]:
    """y-limits that show every value within ``within`` of ``best`` and no more: the span of those
    values padded by 8%, so close curves are drawn apart instead of flattened."""
    vals = [v for v in list(lows) + list(highs) if v == v and v <= best + within]
    lo, hi = min(vals + [best]), max(vals + [best])
    pad = max(0.08 * (hi - lo), 1e-3)
    return lo - pad, hi + pad


# ---------------------------------------------------------------------------------------------
# report: the paper's downstream claims, computed from the measurements

#: Extrapolation: bits per byte at 4L may exceed the value at L by at most this much.
EXTRAPOLATION_MARGIN = 0.05


def _own(df: Any) -> Any:
    return df[df.attention == "own"]


def _scheme_bpb(g: Any, position: str, s: int, length: int) -> Any:
    """Per training seed: bits per byte of one scheme at one length (mean over mask draws)."""
    sel = g[(g.position == position) & (g.length == length)]
    if position == "poslsh":
        sel = sel[sel.trained_s == s]
    return sel.groupby("run_seed").bits_per_byte.mean()


def _seeds(k: int) -> str:
    return f"{k} seed" + ("" if k == 1 else "s")


def report(run: Path, df: Any) -> Section:
    import numpy as np
    import pandas as pd
    from scipy import stats

    sec = Section("perplexity", run, "Language modelling: from scratch, fine-tuning, length extrapolation")
    head, rows = summary(df)
    sec.tables.append(pd.DataFrame(rows, columns=head))
    own = _own(df)
    scratch, tuned = own[own.finetuned != "yes"], own[own.finetuned == "yes"]
    L = int(df.trained_len.max()) if len(df) else 0

    # 1. from scratch: Positional LSH reaches exact ALiBi and beats no positional information
    rule = ("at the training length L, mean bits per byte over seeds; 'reaches' when Positional LSH - ALiBi <= "
            "the larger range (max - min) over the two schemes' seeds, i.e. not worse beyond the seed-to-seed "
            "spread (better counts); needs two seeds of at least one, else INCONCLUSIVE")
    alibi = _scheme_bpb(scratch, "alibi", 0, L)
    for s in sorted(scratch[scratch.position == "poslsh"].trained_s.unique()):
        p = _scheme_bpb(scratch, "poslsh", s, L)
        claim = f"from scratch, Positional LSH s={s} reaches the bits per byte of exact ALiBi"
        if alibi.empty or p.empty:
            sec.verdicts.append(Verdict(claim, Status.NOT_MEASURED, "missing alibi or poslsh runs", rule))
            continue
        spread = max(np.ptp(alibi) if len(alibi) > 1 else 0.0, np.ptp(p) if len(p) > 1 else 0.0)
        gap = float(p.mean() - alibi.mean())
        if len(alibi) < 2 and len(p) < 2:
            status = Status.INCONCLUSIVE
        else:
            status = Status.SUPPORTED if gap <= spread else Status.NOT_SUPPORTED
        sec.verdicts.append(Verdict(claim, status, f"L={L}: poslsh {p.mean():.4f} ({_seeds(len(p))}), alibi "
                                    f"{alibi.mean():.4f} ({_seeds(len(alibi))}), difference {gap:+.4f}, seed spread "
                                    f"{spread:.4f}", rule))
    none = _scheme_bpb(scratch, "none", 0, L)
    ps = scratch[scratch.position == "poslsh"].trained_s
    if len(ps):
        s_ref = 10 if (ps == 10).any() else int(ps.max())
        p = _scheme_bpb(scratch, "poslsh", s_ref, L)
        claim = f"from scratch, Positional LSH s={s_ref} beats the model without positional bias"
        if none.empty:
            sec.verdicts.append(Verdict(claim, Status.NOT_MEASURED, "no position=none run", "lower mean bits per byte"))
        else:
            spread = max(np.ptp(none) if len(none) > 1 else 0.0, np.ptp(p) if len(p) > 1 else 0.0)
            gap = float(none.mean() - p.mean())
            status = Status.SUPPORTED if gap > spread else Status.NOT_SUPPORTED
            sec.verdicts.append(Verdict(claim, status, f"L={L}: none {none.mean():.4f}, poslsh {p.mean():.4f} "
                                        f"(none - poslsh = {gap:+.4f}; seed spread {spread:.4f})",
                                        "none - poslsh larger than the seed-to-seed spread"))

    # 2. fine-tuning: approaches exact ALiBi as s grows; clearly better than fixed blocks
    if tuned.empty:
        for claim in ("fine-tuned, Positional LSH approaches exact ALiBi as s grows",
                      "fine-tuned, Positional LSH is clearly better than fixed blocks"):
            sec.verdicts.append(Verdict(claim, Status.NOT_MEASURED, "no fine-tuned checkpoints (train with pretrain=rope)",
                                        "needs checkpoints fine-tuned from one pretrained model"))
    else:
        Lt = int(tuned.trained_len.max())
        a = _scheme_bpb(tuned, "alibi", 0, Lt)
        svals = sorted(tuned[tuned.position == "poslsh"].trained_s.unique())
        gaps = {s: float(_scheme_bpb(tuned, "poslsh", s, Lt).mean() - a.mean()) for s in svals} if len(a) else {}
        rule = ("gap = bits per byte of Positional LSH s minus exact ALiBi, both fine-tuned from the same model; "
                "SUPPORTED when its Spearman rank correlation with s is <= -0.8 over at least four s, NOT SUPPORTED "
                "when >= 0, else INCONCLUSIVE")
        if len(gaps) < 4:
            st = Status.NOT_MEASURED if not gaps else Status.INCONCLUSIVE
            ev = "fewer than four s" if gaps else "no alibi or poslsh fine-tuning runs"
        else:
            rho = float(stats.spearmanr(list(gaps), list(gaps.values())).statistic)
            st = Status.SUPPORTED if rho <= -0.8 else Status.NOT_SUPPORTED if rho >= 0 else Status.INCONCLUSIVE
            ev = f"Spearman {rho:.2f}"
        ev += "; gaps " + ", ".join(f"s={s}: {g:+.4f}" for s, g in gaps.items()) if gaps else ""
        sec.verdicts.append(Verdict("fine-tuned, Positional LSH approaches exact ALiBi as s grows", st, ev, rule))
        fb = _scheme_bpb(tuned, "fixed_block", 0, Lt)
        rule = ("Positional LSH at the largest s closes at least half of the gap between fixed blocks and exact "
                "ALiBi: fixed_block - poslsh >= 0.5 (fixed_block - alibi), and that gap is positive")
        if fb.empty or not gaps:
            sec.verdicts.append(Verdict("fine-tuned, Positional LSH is clearly better than fixed blocks",
                                        Status.NOT_MEASURED, "missing fixed_block, alibi or poslsh runs", rule))
        else:
            smax = max(gaps)
            pv = float(_scheme_bpb(tuned, "poslsh", smax, Lt).mean())
            need = 0.5 * float(fb.mean() - a.mean())
            ok = need > 0 and float(fb.mean()) - pv >= need
            sec.verdicts.append(Verdict("fine-tuned, Positional LSH is clearly better than fixed blocks",
                                        Status.SUPPORTED if ok else Status.NOT_SUPPORTED,
                                        f"L={Lt}: fixed_block {float(fb.mean()):.4f}, poslsh s={smax} {pv:.4f}, "
                                        f"alibi {float(a.mean()):.4f}", rule))

    # 3. length extrapolation: Positional LSH (and ALiBi) stay robust at 4L; RoPE / none degrade more
    rule = (f"bits per byte at 4L minus at L (own attention, from scratch): at most {EXTRAPOLATION_MARGIN} for "
            "SUPPORTED; the comparison needs the same lengths measured for rope or none")
    deltas = {}
    for (pos, ts), g in scratch.groupby(["position", "trained_s"]):
        at = g.groupby("length").bits_per_byte.mean()
        if L in at.index and 4 * L in at.index:
            deltas[pos + (f" s={ts}" if ts else "")] = float(at[4 * L] - at[L])
    posl = {k: v for k, v in deltas.items() if k.startswith("poslsh")}
    if not posl:
        sec.verdicts.append(Verdict("Positional LSH stays robust at 4x the training length", Status.NOT_MEASURED,
                                    "no poslsh checkpoint evaluated at L and 4L", rule))
    else:
        st = combine(Status.SUPPORTED if d <= EXTRAPOLATION_MARGIN else Status.NOT_SUPPORTED for d in posl.values())
        sec.verdicts.append(Verdict("Positional LSH stays robust at 4x the training length", st,
                                    "; ".join(f"{k}: {v:+.4f}" for k, v in deltas.items()), rule))
        others = {k: v for k, v in deltas.items() if k in ("rope", "none")}
        if others:
            worse = all(v > max(posl.values()) for v in others.values())
            sec.verdicts.append(Verdict("RoPE and no-position models degrade more at 4L than Positional LSH",
                                        Status.SUPPORTED if worse else Status.NOT_SUPPORTED,
                                        "; ".join(f"{k}: {v:+.4f}" for k, v in others.items())
                                        + f"; poslsh worst {max(posl.values()):+.4f}",
                                        "each of rope / none degrades by more than every Positional-LSH model"))
    swapped = df[df.attention != "own"]
    if len(swapped):
        sec.paragraphs.append(f"{len(swapped)} rows evaluate a model with another attention than its own "
                              "(the figure 'attention swapped at inference', the 'attention' column of results.csv).")
    return sec


def reproduce_overrides(root: Path) -> list[str]:
    """Every run of this reproduce scale that holds trained checkpoints (``work/*/final``), found
    by what it holds, so the train presets are not named here."""
    def trained(p: Path) -> bool:  # a run, or a one-job multirun of it (reproduce with a launcher)
        return any(p.glob("work/*/final/config.json")) or any(p.glob("*/work/*/final/config.json"))

    runs = sorted(p for p in Path(root).iterdir() if p.is_dir() and trained(p)) if Path(root).is_dir() else []
    return ["checkpoints=[" + ",".join(f"'{p}'" for p in runs) + "]"]


def skip_reason(spec: PerplexitySpec) -> str | None:
    if not spec.checkpoints:
        return "nothing to evaluate: no trained checkpoints (the training presets did not run)"
    for c in spec.checkpoints:
        if not Path(c).exists():
            return f"nothing to evaluate: no train run at {c}"
    return None


EXPERIMENT = Experiment(
    name="perplexity",
    spec=PerplexitySpec,
    help="""Bits per byte (and perplexity) of trained models at several evaluation lengths, under
    their own scheme and with attention swapped at inference.

    poslsh perplexity RUN_OR_CHECKPOINT... lengths=[L,2L,4L,8L] attention=[own,alibi,poslsh]
    s=[...]: non-overlapping windows (stride= for sliding windows) of each checkpoint's
    validation text (data=PATH for another text).""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    plot=plot,
    report=report,
    presets=("perplexity",),
    order=60,
    positional="checkpoints",
    skip_reason=skip_reason,
    reproduce_overrides=reproduce_overrides,
    memory=memory,
)
