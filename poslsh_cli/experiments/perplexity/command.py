"""``poslsh perplexity``: bits per byte of trained models at several evaluation lengths, under
their own position scheme and with another attention swapped in at inference.

``poslsh perplexity RUN_OR_CHECKPOINT... lengths=[...] attention=[own,alibi,poslsh] s=[...]``:
each train run directory expands to its cells' final checkpoints. Windows and lengths are in the
checkpoint's tokens (bytes for byte models). ``loss`` is the mean NLL per predicted token (nats);
bits per byte = summed NLL / ln 2 / UTF-8 bytes the predicted tokens cover, over every predicted
position of non-overlapping windows of the evaluation length (``stride=`` for sliding windows), so
byte models and BPE models compare on one scale; perplexity = exp(loss), per token.
Evaluation text: each checkpoint's own validation split (checked against the corpus hash it was
trained on), or ``data=PATH``. Lengths default to L, 2L, 4L, 8L of the training length L (the
shape of the ALiBi paper's Figure 1). A swapped-in attention is evaluated at the training length
(``swapped_at=every``: at each length), and not where it is the model's own computation.
"""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from poslsh_cli.experiments.perplexity.claims import OWN
from poslsh_cli.experiments.perplexity.plots import plot
from poslsh_cli.experiments.perplexity.report import report, summary
from poslsh_cli.experiments.perplexity.across import section as registered_section
from poslsh_cli.experiments.perplexity.groups import migrate
from poslsh_cli.experiments.perplexity import extrapolation, finetune
from poslsh_cli.core.config import ENCODING_HELP, Spec, check, check_encoding, key
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.base import Experiment, MemoryNeed, checkpoints_skip_reason, choices, trained_runs_overrides
from poslsh_cli.experiments.devices import Device, resolve_device
from poslsh_cli.attention.scheme import Position, model_label, randomized, scheme_key, sigma_label
from poslsh_cli.lm.checkpoint import checkpoints_of, expand_checkpoints
from poslsh_cli.lm import evaluate as evaluation
from poslsh_cli.numerics.sampling import Sampler, derive_seed
from poslsh_cli.lm.checkpoint import (
    check_checkpoint, late_fall, read_config, refuse_rotary_falcon, saved_scheme, weights_bytes)
from poslsh_cli.lm.evaluate import WINDOW_SUMS, evaluate, fast_cpu_math
from poslsh_cli.lm.loading import load_model
from poslsh_cli.lm.trained import train_info, training_run

COLUMNS = ("checkpoint", "position", "attention", "s", "length", "trial", "seed", "tokens", "loss", "bits_per_byte",
           "ppl", "seconds", "trained_len", "trained_s", "finetuned", "run_seed", "bits_per_token", "kl", "bytes",
           "attn_dropout", "sigmas", "protocol", "trained_run", "trained_steps", "text_tokens", "trained_fall",
           *evaluation.columns())
LN2 = math.log(2.0)


class Protocol(str, enum.Enum):
    """How windows longer than the training length are scored."""

    #: windows of the evaluation length side by side, every position but the first scored
    NONOVERLAPPING = "nonoverlapping"
    #: the ALiBi paper's and the Positional-LSH paper's code: windows of the evaluation length
    #: stepped by the training length L, only the last L positions of each scored (each with
    #: length - L tokens of context); at lengths up to L the same as nonoverlapping
    SLIDING = "sliding"


#: Attention swapped in at inference: ``own`` (the model's forward as trained) or any position
#: scheme that can replace another model's attention (every one but ``rope``, which changes q and k).
Attention = choices("Attention", [p for p in Position if p is not Position.ROPE], __name__, OWN=OWN)


@dataclass(frozen=True)
class PerplexitySpec(Spec):
    checkpoints: tuple[str, ...] = key("train run directories or checkpoint directories (or give them as plain "
                                       "arguments: poslsh perplexity RUN...)", [], empty=True)
    lengths: Optional[tuple[int, ...]] = key("evaluation lengths in tokens (bytes for byte models); null: L, 2L, "
                                             "4L, 8L of each checkpoint's training length", None, ge=2)
    attention: tuple[Attention, ...] = key("attention at inference: own (as trained), "
                                           + ", ".join(a.value for a in Attention if a is not Attention.OWN),
                                           [Attention.OWN], noun="attention")
    s: tuple[int, ...] = scheme_key("s", [10], "at inference (attention=poslsh)")
    sampler: Optional[Sampler] = scheme_key("sampler", None, "of swapped-in or re-drawn masks; null: the "
                                            "checkpoint's own")
    window_sigmas: float = scheme_key("window_sigmas", 4.0)
    trials: int = key("mask draws per Positional-LSH point (own or swapped in)", 3, ge=1)
    swapped_at: Literal["trained", "every"] = key(
        "lengths at which a swapped-in attention is evaluated: trained (the checkpoint's training length; the "
        "shortest of lengths= when that is not among them) or every (each evaluation length)", "trained")
    stride: Optional[int] = key("sliding windows advancing by stride tokens (each scores its last stride tokens); "
                                "null: non-overlapping windows", None, ge=1)
    protocol: tuple[Protocol, ...] = key("scoring of lengths beyond training (list sweeps, each a row): "
                                         "nonoverlapping (every token of side-by-side windows) or sliding (windows "
                                         "stepped by the training length L, only their last L tokens scored: the "
                                         "ALiBi and Positional-LSH papers' protocol)", [Protocol.NONOVERLAPPING],
                                         noun="protocol")
    data: Optional[str] = key("a text file or folder to evaluate on; null: each checkpoint's validation split", None)
    encoding: str = key(ENCODING_HELP + " (data=; a checkpoint's own split is read as it was trained)", "utf-8")
    max_tokens: Optional[int] = key("evaluation text, in tokens from its start, that every cell reads (with "
                                    "side_tokens: the own attention at the training length); null: all of it "
                                    "(the whole validation split)", 65536, ge=2)
    side_tokens: Optional[int] = key("evaluation text beyond the training length and with another attention swapped "
                                     "in, when smaller than max_tokens: the own attention at the training length is "
                                     "then scored on it too, so every comparison reads one text; null: max_tokens",
                                     None, ge=2)
    extrapolate: Literal["every", "longest"] = key(
        "which models are evaluated beyond their training length and with attention swapped in: every one, or only "
        "those trained for the most steps in their train run (a run trained at T/2 and T: the T models)", "every")
    batch: int = key("windows per forward pass", 4, ge=1)
    device: Device = key("auto (CUDA when present), cpu, cuda, cuda:N", Device("auto"))

    def check(self) -> None:
        check_encoding(self.encoding)


@dataclass
class Checkpoint:
    path: Path
    name: str  # as shown in results: relative to the run it came from, or the path
    info: Any  # lm.trained.TrainInfo (recorded=False for a foreign checkpoint)
    position: str
    trained_len: int
    tokens: Any = None  # evaluation token ids: bytes for byte models, the checkpoint's own tokens otherwise
    token_bytes: Any = None  # UTF-8 bytes each evaluation token covers
    run: str = ""  # the train run it belongs to (lm.trained.training_run)

    @property
    def steps(self) -> int:
        """Optimizer steps of the stage that made it (0: not recorded)."""
        return self.info.steps


#: Which evaluation text a cell reads: the main one (max_tokens) or the side one (side_tokens).
MAIN, SIDE = "main", "side"


def text_limit(spec: "PerplexitySpec", text: str) -> Optional[int]:
    """Tokens of the evaluation text a cell reads from its start (None: all of it)."""
    return spec.max_tokens if text == MAIN or spec.side_tokens is None else spec.side_tokens


def has_side_text(spec: "PerplexitySpec") -> bool:
    """Whether the side text differs from the main one (only then do cells name their text)."""
    return spec.side_tokens is not None and (spec.max_tokens is None or spec.side_tokens < spec.max_tokens)


@dataclass
class PerplexityContext:
    checkpoints: dict[str, Checkpoint]
    device: Any
    loaded: dict = field(default_factory=dict)  # name -> (model, own PositionState)
    meta: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)  # lines printed before the cells (folders searched)


def memory(spec: PerplexitySpec) -> MemoryNeed | None:
    """Peak bytes at the longest evaluation length: the weights (float32), the float64 logits and
    log-probabilities of a batch (twice when another attention is compared with the model's own),
    the hidden states, and the attention's own memory (per-sample outputs of Positional LSH, the
    exact path's bounded chunks). None when a checkpoint cannot be read yet (prepare says why)."""
    from poslsh_cli.attention import CHUNK_ELEMENTS

    need, what = 0.0, ""
    try:
        entries = [x for e in spec.checkpoints for x in expand_checkpoints(e)]
    except ConfigError:
        return None
    for path, name in entries:
        try:
            cfg = read_config(path)
            info = train_info(path)
        except (OSError, ValueError, ConfigError):
            return None
        L = max(spec.lengths) if spec.lengths is not None else 8 * info.seq_len
        hidden = int(cfg.get("hidden_size") or cfg.get("d_model") or cfg.get("n_embd") or 64)
        vocab = int(cfg.get("vocab_size") or 256)
        s = max(spec.s) if any(drawn(a) for a in spec.attention) else info.s
        act = spec.batch * L * (3 * 8.0 * vocab + 16 * 4.0 * hidden) + spec.batch * 4.0 * max(1, s) * L * hidden * 2
        b = weights_bytes(path) + act + 2 * 4.0 * CHUNK_ELEMENTS
        if b > need:
            need, what = b, f"{name} at length {L}"
    return MemoryNeed(need, what, spec.device) if what else None


def prepare(spec: PerplexitySpec) -> PerplexityContext:
    check(len(spec.checkpoints) > 0, "give at least one train run or checkpoint (poslsh perplexity RUN...)")
    check(spec.stride is None or Protocol.SLIDING not in spec.protocol,
          "stride= and protocol=sliding both choose the windows: give one (sliding steps by the training length)")
    device = resolve_device(spec.device)
    fast_cpu_math()
    cks: dict[str, Checkpoint] = {}
    corpora: dict[tuple, Any] = {}
    found, notes = checkpoints_of(spec.checkpoints)
    for path, name in found:
        check_checkpoint(path)
        info = train_info(path)
        cfg = read_config(path)
        refuse_rotary_falcon(path, cfg.get("model_type"), bool(cfg.get("alibi")))
        scheme = saved_scheme(cfg)
        position = scheme.position.value if scheme else (
            Position.ALIBI.value if cfg.get("model_type") in ("bloom", "mpt") or cfg.get("alibi") else Attention.OWN.value)
        trained = info.seq_len
        if spec.lengths is None and not trained:
            raise ConfigError(f"{path}: no training length recorded; give 'lengths=[...]'")
        if Protocol.SLIDING in spec.protocol and not trained:
            raise ConfigError(f"{path}: no training length recorded, which protocol=sliding steps by")
        corpus = _corpus_for(spec, path, info, cfg, corpora)
        tokens = corpus.val
        need = max(spec.lengths or [trained])
        if len(tokens) < need:
            raise ConfigError(f"the evaluation text has {len(tokens)} tokens, fewer than one window of {need}")
        for what, limit in (("max_tokens", spec.max_tokens), ("side_tokens", spec.side_tokens)):
            if limit is not None and limit < need:
                raise ConfigError(f"{what}={limit} is shorter than one window of {need} tokens")
        cks[name] = Checkpoint(path, name, info, position, trained, tokens, corpus.val_bytes, training_run(path))
    return PerplexityContext(cks, device, meta={"evaluated": {n: c.info.data_sha256 for n, c in cks.items()}},
                             notes=notes)


def _corpus_for(spec: PerplexitySpec, path: Path, info: Any, cfg: dict, corpora: dict) -> Any:
    """The evaluation text of one checkpoint, tokenised as it reads: its own validation split
    (checked against the hash it was trained on), or all of ``data=``; bytes for byte models, the
    checkpoint's own tokenizer otherwise."""
    from poslsh_cli.lm.data import VOCAB, ByteTokenizer, HFTokenizer, load_corpus

    byte_model = cfg.get("vocab_size") == VOCAB and not (path / "tokenizer.json").exists() \
        and not (path / "tokenizer_config.json").exists()
    tok = ByteTokenizer() if byte_model else HFTokenizer.load(path)
    if spec.data is not None:
        args = dict(data=spec.data, whole=True, encoding=spec.encoding)
    elif info.data:
        args = dict(data=info.data, val_fraction=float(info.val_fraction), val_every=int(info.val_every),
                    field=info.data_field, encoding=info.encoding)
    else:  # a checkpoint poslsh did not train: the builtin corpus's validation documents
        args = dict(data="builtin")
    keyed = (tuple(sorted(args.items())), tok.digest)
    if keyed not in corpora:
        corpora[keyed] = load_corpus(tokenizer=tok, **args)
    corpus = corpora[keyed]
    if spec.data is None and info.data_sha256 and corpus.sha256 != info.data_sha256:
        raise ConfigError(f"{path}: data={args['data']} is not the corpus it was trained on (hash differs); "
                          "give data=PATH to evaluate on other text")
    return corpus


def lengths_of(spec: PerplexitySpec, ck: Checkpoint) -> tuple[int, ...]:
    return spec.lengths if spec.lengths is not None else tuple(ck.trained_len * m for m in (1, 2, 4, 8))


def drawn(attention: Attention) -> bool:
    """Whether a swapped-in attention draws its masks at random (its s and mask draws matter): the
    method's declaration says; the model's own attention is not swapped in."""
    return attention is not Attention.OWN and randomized(attention.value)


def stochastic(attention: Attention, ck: Checkpoint) -> bool:
    """Whether a cell's attention draws masks: the swapped-in one's, or the scheme the checkpoint was
    trained with (a checkpoint this project did not train runs its own attention, never drawn)."""
    if attention is not Attention.OWN:
        return drawn(attention)
    return ck.position != Attention.OWN.value and randomized(ck.position)


def same_as_own(attention: Attention, s: int, ck: Checkpoint) -> bool:
    """Whether swapping ``attention`` (with ``s`` masks) into ``ck`` gives the model as trained:
    exact ALiBi into an ALiBi model (attention dropout is off at inference), Positional LSH with the
    trained s into a Positional-LSH model (the own rows already draw its masks). Only for models this
    project trained: a foreign ALiBi model's own forward is its library's code, not ours."""
    if attention is Attention.OWN or attention.value != ck.position or not ck.info.recorded:
        return False
    return not drawn(attention) or s == ck.info.s


def swapped_lengths(spec: PerplexitySpec, ck: Checkpoint) -> tuple[int, ...]:
    """Where a swapped-in attention is evaluated (``swapped_at``)."""
    lengths = lengths_of(spec, ck)
    if spec.swapped_at == "every":
        return lengths
    return (ck.trained_len,) if ck.trained_len in lengths else (min(lengths),)


def cells(spec: PerplexitySpec, ctx: PerplexityContext | None = None) -> list[dict[str, Any]]:
    """One cell per (checkpoint, attention, s, length, mask draw, text). A swapped-in attention is
    evaluated at the lengths of :func:`swapped_lengths` and not where it equals the model's own;
    lengths beyond the training length only for the models :func:`extrapolated` picks. With a side
    text (:func:`has_side_text`) the own attention at the training length reads the main text and
    the side one, everything else the side one; cells name their text only then."""
    out = []
    side = has_side_text(spec)
    cks = ctx.checkpoints if ctx is not None else {}
    for name, ck in cks.items():
        for att in spec.attention:
            for s in (spec.s if drawn(att) else (0,)):
                if same_as_own(att, s, ck):
                    continue
                for length in (lengths_of(spec, ck) if att is Attention.OWN else swapped_lengths(spec, ck)):
                    if (length > ck.trained_len or att is not Attention.OWN) and not extrapolated(spec, ck, cks):
                        continue
                    own_at_L = att is Attention.OWN and length <= ck.trained_len
                    texts = ([MAIN, SIDE] if own_at_L else [SIDE]) if side else [MAIN]
                    for protocol in protocols_at(spec, ck, length):
                        for trial in range(spec.trials if stochastic(att, ck) else 1):
                            for text in texts:
                                out.append({"checkpoint": name, "attention": att.value, "s": s, "length": length,
                                            "trial": trial, **({"protocol": protocol.value}
                                                               if protocol is not Protocol.NONOVERLAPPING else {}),
                                            **({"text": text} if side else {})})
    return out


def extrapolated(spec: PerplexitySpec, ck: Checkpoint, cks: dict[str, Checkpoint]) -> bool:
    """Whether ``ck`` is evaluated beyond its training length and with attention swapped in: always
    with ``extrapolate=every``; with ``longest`` only when no checkpoint of its train run (same training
    length) trained for more steps."""
    if spec.extrapolate == "every":
        return True
    peers = [c.steps for c in cks.values() if c.run == ck.run and c.trained_len == ck.trained_len]
    return ck.steps >= max(peers)


def protocols_at(spec: PerplexitySpec, ck: Checkpoint, length: int) -> list[Protocol]:
    """The protocols evaluated at ``length``: at lengths up to the training length sliding scores
    the same windows as nonoverlapping, so it runs there only when nonoverlapping is not asked
    (the report reads the nonoverlapping row for both)."""
    if length <= ck.trained_len and Protocol.NONOVERLAPPING in spec.protocol:
        return [Protocol.NONOVERLAPPING]
    return list(spec.protocol)


def _model(ctx: PerplexityContext, ck: Checkpoint) -> tuple[Any, Any]:
    if ck.name not in ctx.loaded:
        ctx.loaded.clear()  # one model in memory at a time
        ctx.loaded[ck.name] = load_model(ck.path, str(ctx.device))
    return ctx.loaded[ck.name]


def scheme_for(spec: PerplexitySpec, attention: Attention, s: int, own: Any, seed: int) -> Any:
    """The position state for ``attention``: the trained one for ``own`` (with its masks drawn from
    ``seed`` when they are random); otherwise the named scheme with the checkpoint's sigmas (its
    ALiBi slopes). Random masks of layer l, head h come from ``derive_seed(seed, "masks", "eval",
    "perplexity", l, h)``: the row's ``seed`` replays them."""
    import dataclasses

    sampler = spec.sampler.value if spec.sampler is not None else own.sampler
    if attention is Attention.OWN:
        return dataclasses.replace(own, seed=seed, sampler=sampler, plans=set(), _cache={}) if _random(own) else own
    return dataclasses.replace(own.swapped(attention.value, s, seed, sampler=sampler),
                               window_sigmas=spec.window_sigmas)


def _random(state: Any) -> bool:
    return randomized(state.position)


def run_cell(spec: PerplexitySpec, key: dict[str, Any], ctx: PerplexityContext, work: Any = None) -> tuple[list[dict], dict]:
    ck = ctx.checkpoints[key["checkpoint"]]
    att, s, length, trial = Attention(key["attention"]), key["s"], key["length"], key["trial"]
    model, own = _model(ctx, ck)
    seed = derive_seed(spec.seed, "perplexity", ck.name, att.value, s, trial)
    state = scheme_for(spec, att, s, own, seed)
    t0 = time.perf_counter()
    protocol = Protocol(key.get("protocol", Protocol.NONOVERLAPPING.value))
    sliding = protocol is Protocol.SLIDING and length > ck.trained_len
    limit = text_limit(spec, key.get("text", MAIN))
    said = f"{ck.name} {model_label(att.value, s if drawn(att) else 0)} length {length} {protocol.value}"
    ev = evaluate(model, state, ck.tokens, length, ck.trained_len if sliding else spec.stride,
                  None if limit is None else max(limit, length), spec.batch, key="perplexity",
                  own=own if att is not Attention.OWN else state, token_bytes=ck.token_bytes, tail=sliding,
                  progress=None if work is None else lambda done, total: work.progress(done, total, said))
    loss = ev.loss
    used_s = s if drawn(att) else (ck.info.s if stochastic(att, ck) else 0)
    row = {"checkpoint": ck.name, "position": ck.position, "attention": att.value, "s": used_s, "length": length,
           "trial": trial, "seed": seed if stochastic(att, ck) else -1, "tokens": ev.predicted, "loss": loss,
           "bits_per_byte": ev.bits_per_byte, "ppl": math.exp(loss), "seconds": time.perf_counter() - t0,
           "trained_len": ck.trained_len, "trained_s": ck.info.s,
           "finetuned": "yes" if ck.info.init else "no", "run_seed": ck.info.seed,
           "bits_per_token": loss / LN2, "kl": ev.kl / ev.predicted if att is not Attention.OWN else 0.0,
           "bytes": ev.nbytes, "attn_dropout": float(ck.info.attn_dropout),
           "sigmas": (sigma_label(ck.info.sigmas)
                      if ck.position not in (Position.ROPE.value, Position.NONE.value) else ""),
           "protocol": protocol.value, **ev.accuracy(), "trained_run": ck.run, "trained_steps": ck.steps,
           "text_tokens": len(ck.tokens) if limit is None else min(len(ck.tokens), max(limit, length)),
           "trained_fall": late_fall(ck.path)}
    col = {c: i for i, c in enumerate(WINDOW_SUMS)}
    windows = [{"checkpoint": ck.name, "attention": att.value, "s": used_s, "length": length, "trial": trial,
                "protocol": protocol.value, "text_tokens": row["text_tokens"], "window": i, "bits": float(w[col["nll"]]) / LN2,
                "bytes": int(w[col["bytes"]]), "tokens": int(w[col["predicted"]]), "top1": int(w[col["top1"]])}
               for i, w in enumerate(ev.windows)]
    return [row], {"windows": windows}


def reproduce_overrides(root: Path, spec: PerplexitySpec) -> list[str]:
    return trained_runs_overrides(root, spec.checkpoints)


def skip_reason(spec: PerplexitySpec) -> str | None:
    return checkpoints_skip_reason(spec.checkpoints, spec.device)


#: the modules that declare the rest of its claims, imported with the command (``poslsh claims`` lists them)
CLAIM_MODULES = (extrapolation, finetune)

EXPERIMENT = Experiment(
    name="perplexity",
    spec=PerplexitySpec,
    help="""Bits per byte (and perplexity) of trained models at several evaluation lengths, under
    their own scheme and with attention swapped at inference.

    poslsh perplexity RUN_OR_CHECKPOINT... 'lengths=[L,2L,4L,8L]' 'attention=[own,alibi,poslsh]'
    's=[...]': non-overlapping windows (stride= for sliding windows) of each checkpoint's
    validation text (data=PATH for another text).""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    plot=plot,
    report=report,
    across_runs=registered_section,
    migrate=migrate,
    presets=("perplexity_official", "perplexity_confirm", "perplexity_confirm_l1024", "perplexity", "perplexity_finetune", "perplexity_long", "perplexity_mistral_7b_gpu", "perplexity_qwen3_0_6b_gpu",
             "perplexity_official_qwen3_0_6b_gpu", "perplexity_official_mistral_7b_gpu"),
    opt_in=("perplexity_confirm_l1024", "perplexity_long"),
    order=60,
    positional="checkpoints",
    skip_reason=skip_reason,
    reproduce_overrides=reproduce_overrides,
    memory=memory,
)
