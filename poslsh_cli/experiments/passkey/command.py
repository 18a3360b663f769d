"""``poslsh passkey CKPT... lengths=[...] depths=[...]``: synthetic passkey retrieval (Mohtashami &
Jaggi 2023): a random number hidden at a depth of a long filler text, asked for at its end.

Each prompt is ``length`` tokens: repeated filler sentences, at ``depth`` (0: the start, 1: just
before the question) the needle "The pass key is K. Remember it. K is the pass key.", then "What
is the pass key? The pass key is" and the answer " K". The answer is scored teacher-forced in one
forward pass, under the checkpoint's own scheme: ``correct`` when every answer token is the
model's top-1 prediction (what greedy decoding would write), with the answer's NLL and the share
of its tokens predicted. ``trials`` keys per (length, depth); Positional-LSH masks are drawn per
trial (``seed`` replays them).

``distances=[...]`` places the needle by its distance from the question instead, in units of a
bandwidth (``distance_sigma``, else each checkpoint's largest sigma): the needle's last token
``round(c sigma)`` tokens before the question's first, where ALiBi's bias still gives it
``exp(-c)`` of its weight at distance 0. A model whose bias puts almost no weight beyond a few
sigma is asked for a key it can reach.
"""
from __future__ import annotations

import math

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from poslsh_cli.core.config import Spec, check, key

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.base import (Experiment, MemoryNeed, checkpoint_forward_bytes, checkpoints_skip_reason,
                                         largest_checkpoint_need, trained_runs_overrides)
from poslsh_cli.experiments.devices import Device, resolve_device
from poslsh_cli.lm.checkpoint import check_checkpoint, checkpoints_of, read_config, saved_scheme
from poslsh_cli.attention.scheme import model_label, sigma_label
from poslsh_cli.numerics.sampling import derive_seed
from poslsh_cli.verdicts.claims import Section
from poslsh_cli.lm.generate import codec
from poslsh_cli.lm.install import install
from poslsh_cli.lm.loading import load_model
from poslsh_cli.lm.trained import train_info, training_run
from poslsh_cli.verdicts import plotting

COLUMNS = ("checkpoint", "position", "s", "trained_len", "length", "depth", "trial", "seed", "key", "correct",
           "answer_tokens", "answer_top1", "answer_nll", "sigmas", "distance_sigmas", "distance_tokens")

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeySpec(Spec):
    checkpoints: tuple[str, ...] = key("train run directories or checkpoint directories (or give them as plain "
                                       "arguments: poslsh passkey RUN...)", [], empty=True)
    lengths: Optional[tuple[int, ...]] = key("prompt lengths in tokens; null: L, 2L, 4L of each checkpoint's "
                                             "training length", None, ge=16)
    depths: tuple[float, ...] = key("where the needle sits: 0 the start of the filler, 1 its end", [0.0, 0.25, 0.5,
                                                                                                   0.75, 1.0])
    distances: Optional[tuple[float, ...]] = key(
        "instead of depths: the needle's distance from the question in units of distance_sigma (its last token "
        "round(c sigma) tokens before the question); null: depths=", None, gt=0)
    distance_sigma: Optional[float] = key("the bandwidth distances= are measured in; null: each checkpoint's largest "
                                          "sigma (give it for rope checkpoints, which have none)", None, gt=0)
    trials: int = key("keys per (length, depth)", 5, ge=1)
    digits: int = key("digits of the pass key", 5, ge=1)
    device: Device = key("auto (CUDA when present), cpu, cuda, cuda:N", Device("auto"))

    def check(self) -> None:
        for d in self.depths:
            check(0.0 <= d <= 1.0, f"depths must lie in [0, 1], got {d}")


@dataclass
class PasskeyContext:
    checkpoints: dict[str, tuple[Path, int]]  # name -> (path, training length)
    device: Any
    loaded: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)  # lines printed before the cells (folders searched)
    #: name -> the bandwidth its distances are measured in (distances= only)
    unit: dict = field(default_factory=dict)


def prepare(spec: PasskeySpec) -> PasskeyContext:
    check(len(spec.checkpoints) > 0, "give at least one train run or checkpoint (poslsh passkey RUN...)")
    cks = {}
    found, notes = checkpoints_of(spec.checkpoints)
    for path, name in found:
        check_checkpoint(path)
        info = train_info(path)
        trained = info.seq_len
        if spec.lengths is None and not trained:
            raise ConfigError(f"{path}: no training length recorded; give 'lengths=[...]'")
        cks[name] = (path, trained)
    ctx = PasskeyContext(cks, resolve_device(spec.device), notes=notes)
    if spec.distances is not None:
        ctx.unit = {name: distance_unit(spec, path, name) for name, (path, _) in cks.items()}
        check_distances(spec, ctx)
    return ctx


def check_distances(spec: PasskeySpec, ctx: PasskeyContext) -> None:
    """Refuse, before any cell runs, a distance whose needle does not fit a prompt length of some
    checkpoint (one line naming the first such pair)."""
    for name, (path, trained) in ctx.checkpoints.items():
        encode = codec(path)[0]
        for n in lengths_of(spec, trained):
            for c in spec.distances:
                gap = int(round(c * ctx.unit[name]))
                try:
                    prompt(encode, n, 0.0, "9" * spec.digits, gap)
                except ConfigError as exc:
                    raise ConfigError(f"distances={c:g} at sigma {ctx.unit[name]:g} ({name}): {exc}; ask for shorter "
                                      "distances or longer lengths=") from None


def distance_unit(spec: PasskeySpec, path: Path, name: str) -> float:
    """The bandwidth a checkpoint's needle distances are measured in: ``distance_sigma``, else the
    largest sigma of the scheme it was trained with (a checkpoint with none needs distance_sigma)."""
    if spec.distance_sigma is not None:
        return float(spec.distance_sigma)
    scheme = saved_scheme(read_config(path))
    if scheme is None or scheme.position.value in ("rope", "none") or not len(scheme.sigmas):
        raise ConfigError(f"{name} has no bandwidth of its own to measure distances= in (no position scheme saved "
                          "by poslsh train, or one without a bias: rope, none): give distance_sigma=")
    return float(max(scheme.sigmas))


def lengths_of(spec: PasskeySpec, trained: int) -> tuple[int, ...]:
    return spec.lengths if spec.lengths is not None else tuple(trained * m for m in (1, 2, 4))


def memory(spec: PasskeySpec) -> MemoryNeed | None:
    """Peak bytes of the longest prompt of the largest checkpoint, one forward pass under its own
    scheme (:func:`~poslsh_cli.experiments.base.checkpoint_forward_bytes`); None while a
    checkpoint cannot be read (prepare says why)."""
    def each(path: Path, name: str, device: Any) -> Any:
        info = train_info(path)
        lengths = lengths_of(spec, info.seq_len)
        if lengths and max(lengths) > 0:
            yield checkpoint_forward_bytes(path, 1, max(lengths), device), f"{name} at length {max(lengths)}"

    return largest_checkpoint_need(spec, each)


def cells(spec: PasskeySpec, ctx: PasskeyContext | None = None) -> list[dict[str, Any]]:
    if ctx is None:
        return []
    if spec.distances is not None:
        return [{"checkpoint": name, "length": n, "distance": c} for name, (_, trained) in ctx.checkpoints.items()
                for n in lengths_of(spec, trained) for c in spec.distances]
    return [{"checkpoint": name, "length": n, "depth": d} for name, (_, trained) in ctx.checkpoints.items()
            for n in lengths_of(spec, trained) for d in spec.depths]


def prompt(encode: Any, length: int, depth: float, passkey: str, gap: int | None = None) -> tuple[list[int], int]:
    """Token ids of one prompt of exactly ``length`` tokens and the number of answer tokens at its
    end, the needle at ``depth`` of the filler or, given ``gap``, that many filler tokens before the
    question; one clear error when the length cannot hold the needle, the gap and the question."""
    needle, question, answer = encode(NEEDLE.format(key=passkey)), encode(QUESTION), encode(" " + passkey)
    room = length - len(needle) - len(question) - len(answer)
    if room < 0:
        raise ConfigError(f"length={length} is too short for the pass-key prompt "
                          f"({len(needle) + len(question) + len(answer)} tokens without filler)")
    if gap is not None and gap > room:
        raise ConfigError(f"length={length} is too short for the needle {gap} tokens before the question "
                          f"({len(needle) + len(question) + len(answer) + gap} tokens with the gap)")
    unit = encode(FILLER)
    filler = (unit * (room // max(1, len(unit)) + 1))[:room]
    at = room - gap if gap is not None else int(round(depth * room))
    return filler[:at] + needle + filler[at:] + question + answer, len(answer)


def run_cell(spec: PasskeySpec, key: dict[str, Any], ctx: PasskeyContext, work: Any = None) -> tuple[list[dict], dict]:
    import numpy as np
    import torch

    name, n = key["checkpoint"], int(key["length"])  # and a depth, or a distance in sigmas
    c = key.get("distance")
    gap = None if c is None else int(round(float(c) * ctx.unit[name]))
    depth = float(key.get("depth", math.nan))
    path, trained = ctx.checkpoints[name]
    if name not in ctx.loaded:
        ctx.loaded.clear()
        model, own = load_model(path, str(ctx.device))
        ctx.loaded[name] = (model, own, codec(path)[0])
    model, own, encode = ctx.loaded[name]
    info = train_info(path)
    rows = []
    for trial in range(spec.trials):
        seed = derive_seed(spec.seed, "passkey", name, n, depth, trial) if c is None else \
            derive_seed(spec.seed, "passkey-distance", name, n, float(c), trial)
        rng = np.random.default_rng(seed)
        passkey = str(int(rng.integers(10 ** (spec.digits - 1), 10 ** spec.digits)))
        ids, m = prompt(encode, n, depth, passkey, gap)
        state = dataclasses.replace(own, seed=seed, plans=set(), _cache={}, _forgetting=None)
        state.eval_key = "passkey"
        install(model, state)
        x = torch.as_tensor(ids, device=ctx.device)[None]
        with torch.no_grad():
            logits = model(input_ids=x, use_cache=False).logits[0, -m - 1:-1].double()  # predicts the answer
        target = x[0, -m:]
        top1 = (logits.argmax(-1) == target).double()
        nll = float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        rows.append({"checkpoint": name, "position": own.position.value, "s": int(own.s),
                     "run": training_run(path), "run_seed": info.seed, "attn_dropout": info.attn_dropout,
                     "trained_len": trained, "length": n, "depth": depth, "trial": trial, "seed": seed,
                     "key": passkey, "correct": int(bool(top1.all())), "answer_tokens": m,
                     "answer_top1": float(top1.mean()), "answer_nll": nll,
                     "sigmas": sigma_label(own.sigmas) if own.position.value != "rope" else "",
                     "distance_sigmas": math.nan if c is None else float(c),
                     "distance_tokens": -1 if gap is None else gap})
    install(model, own)
    return rows, {}


def migrate(df: Any) -> Any:
    """Rows with the run a checkpoint came from, its training seed and its attention dropout, as each
    row records them (from the checkpoint's training record); rows written before they were recorded
    get them from the checkpoint's name (``<run>/work/<cell>/final``, as
    :func:`poslsh_cli.lm.checkpoint.expand_checkpoints` names a train run's checkpoints; -1 and 0 when
    the name says none), the one migration of passkey's results."""
    name = df.checkpoint.astype(str)
    run = name.str.split("/").str[0].where(name.str.contains("/work/"), "")
    seed = name.str.extract(r"_seed-(\d+)", expand=False).fillna("-1").astype(int)
    drop = name.str.extract(r"_attn_dropout-([0-9.]+)", expand=False).fillna("0").astype(float)
    if "run_seed" in df.columns:  # recorded rows keep theirs; a row written before (a resumed run) gets the name's
        old = df.run_seed.isna()
        run = df.run.astype(object).where(~old, run).fillna("").astype(str).str.split("/").str[0]
        seed = df.run_seed.where(~old, seed).astype(int)
        drop = df.attn_dropout.where(~old, drop).astype(float)
    return df.assign(run=run, run_seed=seed, attn_dropout=drop)


def _scheme(df: Any) -> Any:
    d = df
    return [model_label(r.position, r.s, r.attn_dropout, r.sigmas) for r in d.itertuples()]


def binomial_interval(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a success rate from ``k`` of ``n``; with no success
    (or no failure) the one-sided bound at ``level`` (0 of 75: below 3.9%, the rule of three)."""
    from scipy import stats

    if n <= 0:
        return math.nan, math.nan
    if k == 0:
        return 0.0, float(1 - (1 - level) ** (1 / n))
    if k == n:
        return float((1 - level) ** (1 / n)), 1.0
    a = (1 - level) / 2
    return float(stats.beta.ppf(a, k, n - k + 1)), float(stats.beta.ppf(1 - a, k + 1, n - k))


def by_distance(df: Any) -> bool:
    """Whether a run placed its needles by distance from the question (``distances=``), not by depth."""
    return "distance_sigmas" in df.columns and bool(df.distance_sigmas.notna().any())


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    """Per trained model (run and scheme) and prompt length (and needle distance, with distances=):
    the keys retrieved over every training seed, depth and key, their share with its exact binomial
    95% interval (one-sided at 0 or all: a count that never varied says how small or large the rate
    may be, not that it is known exactly), and how close the answer came (top-1 share of its tokens,
    its NLL in nats)."""
    d = df
    d = d.assign(scheme=_scheme(d))
    far = by_distance(d)
    head = ["run", "scheme", "L", "length", *(["needle distance"] if far else []), "retrieved", "accuracy",
            "95% bound (exact binomial)", "seeds", "answer tokens top-1", "answer NLL"]
    rows = []
    keys = ["run", "scheme", "trained_len", "length", *(["distance_sigmas"] if far else [])]
    for group, g in d.groupby(keys, sort=False):
        run, scheme, L, n = group[:4]
        k, total = int(g.correct.sum()), len(g)
        lo, hi = binomial_interval(k, total)
        bound = f"below {hi:.1%}" if k == 0 else f"above {lo:.1%}" if k == total else f"[{lo:.1%}, {hi:.1%}]"
        where = [f"{group[4]:g} σ ({int(g.distance_tokens.iloc[0])} tokens)"] if far else []
        rows.append([run or "-", scheme, str(int(L)), str(int(n)), *where, f"{k}/{total}", f"{k / total:.2f}", bound,
                     str(g.run_seed.nunique()), f"{g.answer_top1.mean():.2f}", f"{g.answer_nll.mean():.2f}"])
    return head, rows


def floor_finding(df: Any) -> Optional[str]:
    """When no model retrieved a single key: the experiment is at its floor, said with the binomial
    bound of each model's count and how the answer's NLL compares with a uniform guess over the
    key's digits (ln 10 nats a digit)."""
    if df.empty or int(df.correct.sum()) > 0:
        return None
    per_model = df.groupby(["checkpoint", "length"]).size()
    n = int(per_model.min())
    _, hi = binomial_interval(0, n)
    digits = int(df.key.astype(str).str.len().max()) if "key" in df.columns else 0
    guess = digits * math.log(10.0)
    nll = df.answer_nll
    return (f"At its floor: no model retrieved a key at any length ({int(len(df))} prompts, "
            f"{df.checkpoint.nunique()} models). Each model's 0 of at least {n} keys per length bounds its accuracy "
            f"below {hi:.1%} (one-sided 95%), nothing more; the answer's NLL was {nll.min():.1f} to {nll.max():.1f} "
            f"nats" + (f", against {guess:.1f} for a uniform guess over its {digits} digits" if digits else "")
            + ". The models of this size do not learn retrieval from their training: this experiment decides no "
            "comparison between schemes.")


def plot(run: Path, df: Any) -> list[Path]:
    plt = plotting.pyplot()
    d = df
    d = d.assign(scheme=[f"{r} {sc}" if r else sc for r, sc in zip(d.run, _scheme(d))])
    schemes = list(dict.fromkeys(d.scheme))
    place = "distance_sigmas" if by_distance(d) else "depth"
    cols = min(6, len(schemes))
    rows = -(-len(schemes) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1, 3.0 * rows), squeeze=False)
    for ax in axes.flat[len(schemes):]:
        ax.axis("off")
    for ax, scheme in zip(axes.flat, schemes):
        g = d[d.scheme == scheme].pivot_table(index=place, columns="length", values="correct", aggfunc="mean")
        im = ax.imshow(g.values, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(g.shape[1]), [str(c) for c in g.columns], fontsize=8)
        ax.set_yticks(range(g.shape[0]), [f"{r:g}" for r in g.index], fontsize=8)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_title(scheme, fontsize=9)
    for row in axes:
        row[0].set_ylabel("needle distance (σ)" if place == "distance_sigmas" else "needle depth")
    fig.colorbar(im, ax=axes.ravel().tolist(), label="pass-key accuracy")
    return plotting.save(fig, run, "passkey")


def report(run: Path, df: Any) -> Section:
    sec = Section("passkey", run, "Pass-key retrieval against prompt length and needle "
                  + ("distance from the question" if by_distance(df) else "depth"))
    sec.add_table(*summary(df))
    where = (f"per needle distance from the question ({df.distance_sigmas.nunique()} distances, in units of sigma: "
             "ALiBi's bias keeps exp(-c) of a key's weight c sigma back)" if by_distance(df)
             else f"over {df.depth.nunique()} depths")
    keys = int(df.groupby(["checkpoint", "length", "distance_sigmas" if by_distance(df) else "depth"]).size().max())
    sec.paragraphs.append(f"Accuracy: the share of keys whose every answer token is the model's top-1 prediction "
                          f"(teacher-forced), {where} and "
                          f"{keys} keys each, per trained "
                          "model, pooled over its training seeds, with the exact binomial 95% interval of that count "
                          "(each model under its own attention, one mask draw per key for Positional LSH); chance is "
                          "about 0 for a key of several digits.")
    floor = floor_finding(df)
    if floor:
        sec.paragraphs.insert(0, floor)
    return sec


def reproduce_overrides(root: Path, spec: PasskeySpec) -> list[str]:
    return trained_runs_overrides(root, spec.checkpoints)


def skip_reason(spec: PasskeySpec) -> Optional[str]:
    return checkpoints_skip_reason(spec.checkpoints, spec.device)


EXPERIMENT = Experiment(
    name="passkey",
    spec=PasskeySpec,
    help="""Synthetic pass-key retrieval: a random number hidden at a depth of a filler text, asked
    for at its end; accuracy against prompt length and depth (or distance from the question in sigmas,
    distances=) under each checkpoint's scheme.""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    plot=plot,
    report=report,
    migrate=migrate,
    positional="checkpoints",
    presets=("passkey", "passkey_confirm_l1024", "passkey_qwen3_0_6b_gpu", "passkey_mistral_7b_gpu"),
    opt_in=("passkey_confirm_l1024",),
    skip_reason=skip_reason,
    reproduce_overrides=reproduce_overrides,
    order=75,
    memory=memory,
)
