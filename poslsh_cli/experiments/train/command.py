"""``poslsh train``: train a decoder under a position scheme: the paper's from-scratch and
fine-tuning experiments, at laptop scale on the CPU (the project's byte-level Qwen3) and at the
paper's scale on GPUs (a pretrained checkpoint with its own tokenizer, several processes).

Cells: every (seed, position, s) combination (s only for poslsh), each a sub-run in
``work/<cell>/`` with its own append-only ``metrics.csv``, step checkpoints
(``checkpoints/step-NNNNNNNN``, loadable by ``AutoModelForCausalLM.from_pretrained``, with the
tokenizer) and the final model in ``final/``. Everything random derives from the cell's seed: the
initial weights, the batch of step t (from (seed, t)) and the masks of step t, layer l, head h; so
a run killed at any point and started again with the same ``out=`` continues from its last
checkpoint and ends with the same weights and losses as an uninterrupted run (CPU).

The model (:mod:`poslsh_cli.lm.convert`): the byte model built from the size keys; ``init=`` a
pretrained causal LM (Llama, Mistral, Qwen2/3, BLOOM, MPT, Falcon-RW; a directory or a model
preset) converted to the scheme, with its own tokenizer, optionally with LoRA adapters
(``lora_rank=``); ``arch=`` a checkpoint's configuration and tokenizer trained from scratch.
``pretrain=P pretrain_steps=N`` first trains one model with scheme P (shared by every cell of a
seed, itself resumable), then trains each cell's scheme from it.

Several processes (``torchrun --nproc_per_node=N -m poslsh_cli train ...``, or a SLURM job with
one task per GPU): data-parallel (DDP, or FSDP with ``parallel=fsdp``); the global batch of step t
is the one a single process draws, each rank takes its contiguous share (and ``accumulate=``
micro-batches of it), so the losses equal one process's; rank 0 writes everything
(:mod:`poslsh_cli.core.distributed`). Lengths and batches count tokens (bytes for the byte model).
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

from poslsh_cli.experiments.train.report import metric_files, plot, report, summary
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.base import Experiment, LMShape, MemoryNeed, attention_bytes, attention_plan, lm_bytes
from poslsh_cli.experiments.devices import Precision, cuda_skip_reason
from poslsh_cli.lm.positions import with_model_columns
from poslsh_cli.experiments.train.stage import TRAIN_EVAL, Stage, micro_batch, train_stage
from poslsh_cli.experiments.train.spec import Parallel, TrainCell, TrainContext, TrainSpec, trains_every_seed
from poslsh_cli.lm import evaluate as evaluation
from poslsh_cli.attention.scheme import Position, SchemeKeys, model_label, randomized, sigma_label
from poslsh_cli.core import distributed as dist
from poslsh_cli.lm.checkpoint import peft_module, read_config
from poslsh_cli.lm.convert import open_source, resolve_ref, tokenizer_of
from poslsh_cli.lm.evaluate import fast_cpu_math
from poslsh_cli.lm.loading import Arch
from poslsh_cli.lm.trained import train_info
from poslsh_cli.store.cellwork import read_log
from poslsh_cli.store.readers import read_json

COLUMNS = ("position", "s", "seed", "seq_len", "steps", "tokens", "params", "train_loss", "val_loss", "val_bpb",
           "val_ppl", "seconds", "tokens_per_s", "pretrain", "init", "checkpoint", "wall_seconds", "step_seconds",
           "attn_dropout", "passes", "trainable", "world_size", "tokenizer", "bits_per_token", "train_eval_loss",
           "train_eval_sample", "sigmas", *evaluation.columns("val_"))


def _byte_config(spec: TrainSpec) -> dict:
    return Arch.of(spec, max(32 * max(spec.seq_len), 8192)).config()


def prepare(spec: TrainSpec) -> TrainContext:
    import torch

    from poslsh_cli.lm.data import load_corpus

    world = dist.world().size
    micro_batch(spec, world)
    device = torch.device(dist.device(str(spec.device)))
    if spec.precision is Precision.FP16 and device.type != "cuda":
        raise ConfigError("precision=fp16 needs CUDA (its loss scaling is CUDA's); use precision=bf16 on the CPU")
    if spec.parallel is Parallel.FSDP and world == 1:
        raise ConfigError("parallel=fsdp shards the model over several processes: start it with torchrun "
                          "--nproc_per_node=N")
    if spec.lora_rank:
        peft_module()
    fast_cpu_math()
    source = open_source(spec.init, spec.arch, spec.alibi.value, _byte_config(spec))
    for p in list(spec.position) + ([spec.pretrain] if spec.pretrain is not None else []):
        source.check_position(p)
    tokenizer = tokenizer_of(source)
    corpus = load_corpus(spec.data, spec.val_fraction, min_tokens=max(spec.seq_len) + 1, val_every=spec.val_every,
                         field=spec.data_field, tokenizer=tokenizer, encoding=spec.encoding)
    vocab = int(source.config.get("vocab_size") or 0)
    top = int(max(corpus.train.max(initial=0), corpus.val.max(initial=0))) if len(corpus.train) else 0
    if top >= vocab:
        raise ConfigError(f"data={spec.data}: token id {top} does not fit the model's vocabulary of {vocab}")
    meta = {"corpus": corpus_meta(corpus, spec), "model_source": source.describe(), "world_size": world}
    short = min(spec.steps)
    if spec.warmup_fraction is None and spec.warmup >= short and short > 1 and dist.is_main():
        print(f"poslsh train: warmup={spec.warmup} is not shorter than steps={short}: the learning rate warms up over "
              f"{short - 1} steps and does not decay (warmup_fraction=0.1: 10% of each stage)", file=sys.stderr)
    return TrainContext(corpus, source, device, meta=meta, world=world)


def corpus_meta(corpus: Any, spec: TrainSpec) -> dict:
    """What meta.json records of the corpus: source and hashes, split, sizes, and the passes every
    cell makes over its training tokens."""
    read = max(spec.steps) * spec.batch * (max(spec.seq_len) + 1)
    return {**corpus.meta, "sha256": corpus.sha256, "documents": corpus.documents,
            "val_documents": corpus.val_documents, "train_tokens": len(corpus.train), "val_tokens": len(corpus.val),
            "train_text_bytes": corpus.train_text_bytes, "val_every": spec.val_every,
            "passes_per_cell": round(corpus.passes(read), 4)}


def cells(spec: TrainSpec, ctx: Any = None) -> list[dict[str, Any]]:
    """Every (steps, L, seed, position, s) combination (s only for randomised schemes), and each
    attention-dropout control (the dropout_positions again with it); the seeds past ``first_seeds``
    only for the schemes of ``all_seeds``. The steps, the length and the
    dropout enter the key only when used, so runs without them keep their cells. The shorter
    trainings come first (a run at several lengths has its shortest models soonest)."""
    out, every_seed = [], trains_every_seed(spec)
    for steps in sorted(spec.steps):
        st = {"steps": steps} if len(spec.steps) > 1 else {}
        for L in spec.seq_len:
            at = {"seq_len": L} if len(spec.seq_len) > 1 else {}
            for i, seed in enumerate(spec.seed):
                for d in spec.attn_dropout:
                    for p in (spec.position if d == 0 else [p for p in spec.position if p in spec.dropout_positions]):
                        drop = {"attn_dropout": d} if d > 0 else {}
                        for s in (spec.s if randomized(p) else (0,)):
                            if i >= spec.first_seeds and not every_seed(p, s, d):
                                continue
                            out.append({"position": p.value, "s": s, "seed": seed, **at, **drop, **st})
    return out


# ---------------------------------------------------------------------------------------------
# one stage: a model trained for ``steps`` steps under one scheme


def run_cell(spec: TrainSpec, key: dict[str, Any], ctx: TrainContext, work: Any) -> tuple[list[dict], dict]:
    t0 = time.perf_counter()
    cell = TrainCell.of(key, spec)
    position, s, seed, L, dropout, steps = cell.position, cell.s, cell.seed, cell.seq_len, cell.attn_dropout, cell.steps
    init = Path(ctx.source.path) if ctx.source.kind.value == "init" else None
    if spec.pretrain is not None:
        at = f"-L{L}" if len(spec.seq_len) > 1 else ""
        base = Stage(SchemeKeys.of(spec, position=spec.pretrain, s=spec.s[0], seed=seed), spec.pretrain_steps,
                     L, init, f"pretrain {spec.pretrain.value}")
        init = train_stage(spec, ctx, work.shared(f"pretrain-{spec.pretrain.value}-seed{seed}{at}"), base)
    label = (model_label(position.value, s, dropout) + f" seed={seed}" + (f" L={L}" if len(spec.seq_len) > 1 else "")
             + (f" steps={steps}" if len(spec.steps) > 1 else ""))
    final = train_stage(spec, ctx, work, Stage(SchemeKeys.of(spec, position=position, s=s, seed=seed), steps,
                                               L, init, label, dropout,
                                               lora=spec.lora_rank > 0,
                                               first_step=spec.pretrain_steps if spec.pretrain is not None else 0))
    if not dist.is_main():
        return [], {}
    m = read_log(work.path / "metrics.csv")
    train_eval, _ = read_json(work.path / TRAIN_EVAL)
    tail = m.tail(max(1, len(m) // 10))
    last = m[m.val_loss.notna()].iloc[-1]  # the evaluation of the final weights (the last step's)
    pre = spec.pretrain_steps * spec.batch * L if spec.pretrain is not None else 0
    row = {"position": position.value, "s": s, "seed": seed, "seq_len": L, "steps": steps,
           "tokens": int(m.tokens.iloc[-1]), "params": _param_count(final if not spec.lora_rank else ctx.source.path),
           "train_loss": float(tail.loss.mean()), "val_loss": float(last.val_loss), "val_bpb": float(last.val_bpb),
           "val_ppl": math.exp(float(last.val_loss)), "seconds": float(m.seconds.iloc[-1]),
           "tokens_per_s": float(m.tokens.iloc[-1] / m.step.iloc[-1] / m.step_seconds.median()),  # pauses aside
           "pretrain": spec.pretrain.value if spec.pretrain else "", "init": str(spec.init or spec.arch or ""),
           "checkpoint": work.relative(final), "wall_seconds": time.perf_counter() - t0,
           "step_seconds": float(m.step_seconds.median()), "attn_dropout": dropout,
           "passes": ctx.corpus.passes(float(m.tokens.iloc[-1]) + pre),
           "trainable": _trainable(final), "world_size": ctx.world, "tokenizer": ctx.corpus.tokenizer,
           "bits_per_token": float(last.val_loss) / math.log(2.0),
           "train_eval_loss": float(train_eval["loss"]) if isinstance(train_eval, dict) else math.nan,
           "train_eval_sample": train_eval.get("sampling", "first") if isinstance(train_eval, dict) else "",
           "sigmas": _sigmas(final, position),
           **{c: float(last[c]) if c in last.index else math.nan
              for c in evaluation.columns("val_")}}
    return [row], {}


def _param_count(path: Path) -> int:
    """Parameters stored in a checkpoint's safetensors files, from their headers (nothing loaded)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="np") as fh:
            total += sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
    return int(total)


def _sigmas(final: Path, position: Position) -> str:
    """The trained scheme's bandwidths (:func:`~poslsh_cli.attention.scheme.sigma_label`); empty for the
    schemes that have none (rope, none)."""
    if position in (Position.ROPE, Position.NONE):
        return ""
    return sigma_label(train_info(final).sigmas)


def _trainable(final: Path) -> int:
    """Parameters the stage trained (all of them, or the LoRA adapters'), as recorded with it."""
    return train_info(final).trainable


def memory(spec: TrainSpec) -> Optional[MemoryNeed]:
    """Peak bytes of one process's training step in the largest cell: the model (the byte model's
    sizes, or init= / arch='s config.json) at the longest L with its micro-batch, on the path each
    scheme trains on (:func:`~poslsh_cli.experiments.base.lm_bytes`: optimizer state only for the
    LoRA adapters with lora_rank, sharded with parallel=fsdp; activations at half width under bf16
    or fp16, only each layer's input with gradient_checkpointing). None while the model cannot be
    read (prepare says why)."""
    from poslsh_cli.lm.data import VOCAB

    world = dist.world().size
    try:
        batch, device = micro_batch(spec, world), dist.device(str(spec.device))
        if spec.init is None and spec.arch is None:
            shape = LMShape(VOCAB, spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.head_dim,
                            spec.intermediate)
        else:
            shape = LMShape.of_config(read_config(resolve_ref(spec.init or spec.arch, "init" if spec.init else "arch")))
    except (ConfigError, OSError, ValueError):
        return None
    # LoRA adapters (rank r, in and out of hidden width) on the four attention projections of every layer
    trainable = 4 * 2 * spec.lora_rank * shape.hidden * shape.layers if spec.lora_rank else None
    n = max(spec.seq_len)
    need = MemoryNeed(0.0, "")
    for p in list(spec.position) + ([spec.pretrain] if spec.pretrain is not None else []):
        plan = attention_plan(p, device, n, grad=True)
        s = max(spec.s) if randomized(p) else 0
        att = attention_bytes(p, device, n, batch, shape.heads, shape.head_dim, s, training=True)
        b = lm_bytes(shape, batch, n, att,
                     training=True, trainable=trainable, shards=world if spec.parallel is Parallel.FSDP else 1,
                     recompute=spec.gradient_checkpointing, elem=4.0 if spec.precision is Precision.FP32 else 2.0)
        if b > need.bytes:
            need = MemoryNeed(b, f"a training step of {batch} x {n} tokens, {p.value} on {plan.label}", spec.device)
    return need


def skip_reason(spec: TrainSpec) -> Optional[str]:
    """Why ``poslsh reproduce`` skips a preset here: no CUDA for a GPU preset, or no checkpoint
    for init= / arch= (a model preset looks in $POSLSH_MODELS)."""
    why = cuda_skip_reason(spec.device)
    if why:
        return why
    for name, ref in (("init", spec.init), ("arch", spec.arch)):
        if ref is not None:
            try:
                path = resolve_ref(ref, name)
            except ConfigError as exc:
                return str(exc)
            if not (path / "config.json").is_file():
                return f"{name}={ref}: no checkpoint at {path}"
    return None


EXPERIMENT = Experiment(
    name="train",
    spec=TrainSpec,
    help="""Train a decoder under a position scheme (none, alibi, poslsh, fixed_block, windowed, rope):
    the project's byte-level Qwen3, or a pretrained causal LM converted to the scheme.

    List values sweep: 'position=[none,alibi,poslsh]' 's=[10,20]' 'seed=[0,1]' trains every combination,
    each in its own sub-run with metrics.csv, resumable checkpoints (AutoModelForCausalLM loads
    them) and final/. pretrain=rope pretrain_steps=N fine-tunes every cell from one shared
    pretrained model. init=CHECKPOINT starts from a pretrained causal LM with its own tokenizer
    (Llama, Mistral, Qwen2/3, BLOOM, MPT, Falcon-RW; lora_rank=R for LoRA), arch=CHECKPOINT trains
    its architecture from scratch.

    Several processes: torchrun --standalone --nproc_per_node=N -m poslsh_cli train ... (DDP;
    parallel=fsdp shards the model); accumulate=, precision=bf16, gradient_checkpointing=true.""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    plot=plot,
    report=report,
    migrate=with_model_columns,
    presets=("train_pilot", "train_official", "train_confirm", "train_pilot_l1024", "train_confirm_l1024",
             "train_stability_l1024", "train_first", "train", "train_finetune", "train_long", "train_gpu", "train_long_gpu",
             "finetune_mistral_7b_gpu", "train_qwen3_0_6b_gpu", "train_official_qwen3_0_6b_gpu",
             "finetune_official_mistral_7b_gpu"),
    opt_in=("train_pilot", "train_pilot_l1024", "train_confirm_l1024", "train_stability_l1024", "train_first",
            "train_long"),
    order=50,
    skip_reason=skip_reason,
    distributed=True,
    snapshot_files=metric_files,
    memory=memory,
)
