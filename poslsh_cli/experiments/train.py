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

The model (:mod:`poslsh_cli.convert`): the byte model built from the size keys; ``init=`` a
pretrained causal LM (Llama, Mistral, Qwen2/3, BLOOM, MPT, Falcon-RW; a directory or a model
preset) converted to the scheme, with its own tokenizer, optionally with LoRA adapters
(``lora_rank=``); ``arch=`` a checkpoint's configuration and tokenizer trained from scratch.
``pretrain=P pretrain_steps=N`` first trains one model with scheme P (shared by every cell of a
seed, itself resumable), then trains each cell's scheme from it.

Several processes (``torchrun --nproc_per_node=N -m poslsh_cli train ...``, or a SLURM job with
one task per GPU): data-parallel (DDP, or FSDP with ``parallel=fsdp``); the global batch of step t
is the one a single process draws, each rank takes its contiguous share (and ``accumulate=``
micro-batches of it), so the losses equal one process's; rank 0 writes everything
(:mod:`poslsh_cli.distributed`). Lengths and batches count tokens (bytes for the byte model).
"""
from __future__ import annotations

import enum
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from poslsh_cli.experiments.train_report import plot, report, summary
from poslsh_cli.config import ConfigError, Spec, check, key
from poslsh_cli.experiment import Experiment, Device, cuda_skip_reason
from poslsh_cli.methods import INFO
from poslsh_cli.positions import Position, method_of
from poslsh_cli.sampling import derive_seed

COLUMNS = ("position", "s", "seed", "seq_len", "steps", "tokens", "params", "train_loss", "val_loss", "val_bpb",
           "val_ppl", "seconds", "tokens_per_s", "pretrain", "init", "checkpoint", "wall_seconds", "step_seconds",
           "attn_dropout", "passes", "trainable", "world_size", "tokenizer", "bits_per_token", "train_eval_loss",
           "train_eval_sample", "sigmas")
#: the final weights' loss on ``eval_tokens`` spread over the training split (nats per token), per stage
TRAIN_EVAL = "train_eval.json"
#: the GradScaler state of an fp16 run, beside optimizer.pt in every checkpoint
SCALER = "scaler.pt"
#: how the training-split evaluation samples its windows (``train_eval_sample``): spans spread over
#: the whole split (:func:`poslsh_cli.data.spread_sample`); older runs scored its first tokens
TRAIN_SAMPLE = "spread"
METRICS = ["step", "tokens", "loss", "val_loss", "val_bpb", "lr", "seconds", "step_seconds", "tokens_per_s"]


class Precision(str, enum.Enum):
    """Arithmetic of the forward and backward passes (autocast); weights and optimizer stay float32."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class Parallel(str, enum.Enum):
    """How several processes share the model: replicated (DDP) or sharded (FSDP, ``fully_shard``)."""

    DDP = "ddp"
    FSDP = "fsdp"


class LoraSave(str, enum.Enum):
    MERGED = "merged"
    ADAPTER = "adapter"


class Slopes(str, enum.Enum):
    """Where the ALiBi slopes (the sigmas of every scheme) come from."""

    AUTO = "auto"
    MODEL = "model"
    STANDARD = "standard"


@dataclass(frozen=True)
class TrainSpec(Spec):
    seed: tuple[int, ...] = key("seeds (list sweeps): each trains its own model", [0], ge=0)
    position: tuple[Position, ...] = key("position schemes (list sweeps): none, alibi, poslsh, fixed_block, "
                                         "windowed, rope", [Position.ALIBI, Position.POSLSH], noun="position")
    s: tuple[int, ...] = key("Positional-LSH masks per head per step (list sweeps; poslsh only)", [10], ge=1)
    all_seeds: Optional[tuple[Position, ...]] = key("schemes trained with every seed; the others with the first "
                                                    "seed only (null: all)", None, noun="position")
    window_sigmas: float = key("windowed: keys with |i-j| <= ceil(c sigma_h)", 4.0, gt=0)
    attn_dropout: tuple[float, ...] = key("attention dropout (list sweeps): a value above 0 trains the schemes in "
                                          "dropout_positions again with it (the regulariser control)", [0.0], ge=0)
    dropout_positions: tuple[Position, ...] = key("schemes trained with each attn_dropout above 0 (those whose "
                                                  "training path applies dropout: none, alibi, rope)",
                                                  [Position.ALIBI], noun="position")
    data: str = key("builtin (the Python 3.11 documentation, 11.0 MB, shipped), pydoc-topics, a text file, a folder "
                    "of them, a JSON-lines file, a folder from datasets.save_to_disk, or hf:NAME[:CONFIG]", "builtin")
    data_field: str = key("the text field of JSON-lines and dataset records", "text")
    val_every: int = key("every k-th document is held out for validation (fewer than k documents: the last "
                         "val_fraction of the text)", 10, ge=2)
    val_fraction: float = key("the held-out part of a corpus with fewer than val_every documents", 0.1, gt=0)
    seq_len: tuple[int, ...] = key("training lengths L in tokens (bytes for the byte model; list sweeps: each trains "
                                   "its own model)", [256], ge=2)
    batch: int = key("sequences per step (the global batch, over every process and micro-batch)", 16, ge=1)
    accumulate: int = key("micro-batches per step per process (gradient accumulation)", 1, ge=1)
    steps: int = key("optimizer steps (per stage)", 1000, ge=1)
    lr: float = key("peak learning rate (AdamW; linear warm-up, cosine decay to 10%)", 2e-3, gt=0)
    warmup: int = key("warm-up steps", 100, ge=0)
    weight_decay: float = key("AdamW weight decay", 0.1, ge=0)
    grad_clip: float = key("gradient norm clip (0: none)", 1.0, ge=0)
    precision: Precision = key("fp32, bf16 or fp16 (autocast; fp16 with loss scaling, CUDA only)", Precision.FP32)
    gradient_checkpointing: bool = key("recompute each layer's activations in the backward pass", False)
    parallel: Parallel = key("with several processes: ddp (replicated) or fsdp (sharded, fully_shard)", Parallel.DDP)
    hidden: int = key("byte model: width", 128, ge=1)
    layers: int = key("byte model: decoder layers", 4, ge=1)
    heads: int = key("byte model: attention heads (one ALiBi slope each)", 8, ge=1)
    kv_heads: int = key("byte model: key/value heads (grouped-query attention)", 8, ge=1)
    head_dim: int = key("byte model: head dimension", 16, ge=1)
    intermediate: int = key("byte model: MLP width", 384, ge=1)
    eval_every: int = key("evaluate on the validation text every this many steps (at least five times per stage, "
                          "and at its last step; 0: five times)", 100, ge=0)
    eval_tokens: int = key("validation tokens per evaluation (non-overlapping windows of L)", 32768, ge=2)
    checkpoint_every: int = key("save a resumable checkpoint every this many steps", 200, ge=1)
    init: Optional[str] = key("a checkpoint to start from: a causal LM directory with its tokenizer (Llama, Mistral, "
                              "Qwen2/3, BLOOM, MPT, Falcon-RW), a model preset, or a byte-level checkpoint", None)
    arch: Optional[str] = key("train from scratch at a checkpoint's sizes and with its tokenizer (its config.json; "
                              "a directory or model preset); the byte-model size keys are then unused", None)
    alibi: Slopes = key("ALiBi slopes of every scheme: auto (an ALiBi checkpoint's own, else the standard slopes "
                        "of the head count), model (the checkpoint's own; ALiBi checkpoints only) or standard",
                        Slopes.AUTO)
    lora_rank: int = key("LoRA adapters of this rank on lora_targets, the rest frozen (0: full fine-tuning; needs "
                         "init= and peft)", 0, ge=0)
    lora_alpha: float = key("LoRA scale numerator (0: twice the rank)", 0.0, ge=0)
    lora_targets: Optional[tuple[str, ...]] = key("module names that get adapters (null: the attention "
                                                  "projections)", None)
    lora_save: LoraSave = key("final LoRA model: merged (full weights) or adapter (beside its base)", LoraSave.MERGED)
    pretrain: Optional[Position] = key("train this scheme first (pretrain_steps), then each cell from it", None)
    pretrain_steps: int = key("steps of the shared pretraining stage", 0, ge=0)
    device: Device = key("auto (CUDA when present), cpu, cuda, cuda:N (each process takes cuda:LOCAL_RANK)",
                         Device("auto"))

    def check(self) -> None:
        check(self.val_fraction < 1, f"val_fraction must be < 1, got {self.val_fraction}")
        check(all(d < 1 for d in self.attn_dropout), "attn_dropout must be < 1")
        if any(d > 0 for d in self.attn_dropout):
            bad = [p.value for p in self.dropout_positions if p not in DROPOUT_SCHEMES]
            check(not bad, f"attention dropout is applied only by none, alibi and rope, not {', '.join(bad)}")
        check(self.heads % self.kv_heads == 0, f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.pretrain is not None:
            check(self.pretrain_steps >= 1, "pretrain= needs pretrain_steps >= 1")
        check(self.lora_rank == 0 or self.init is not None, "lora_rank= fine-tunes pretrained weights: give init=")
        check(self.lora_rank == 0 or self.parallel is Parallel.DDP, "LoRA runs with parallel=ddp (the adapters are "
                                                                   "small; the frozen base is replicated)")


@dataclass
class Context:
    corpus: Any
    source: Any  # convert.Source
    device: Any
    meta: dict = field(default_factory=dict)
    world: int = 1


def _byte_config(spec: TrainSpec) -> dict:
    from poslsh_cli.positions import Arch

    return Arch(spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.intermediate, spec.head_dim,
                max(32 * max(spec.seq_len), 8192)).config()


def micro_batch(spec: TrainSpec, world: int) -> int:
    """Sequences per forward pass of one process; refuses a global batch that does not divide."""
    parts = world * spec.accumulate
    if spec.batch % parts:
        raise ConfigError(f"batch={spec.batch} does not divide into {world} process(es) x accumulate={spec.accumulate} "
                          f"micro-batches; use a multiple of {parts}")
    return spec.batch // parts


def prepare(spec: TrainSpec) -> Context:
    import torch

    from poslsh_cli import distributed as dist
    from poslsh_cli.convert import open_source, peft_module, tokenizer_of
    from poslsh_cli.data import load_corpus
    from poslsh_cli.lm import fast_cpu_math

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
                         field=spec.data_field, tokenizer=tokenizer)
    vocab = int(source.config.get("vocab_size") or 0)
    top = int(max(corpus.train.max(initial=0), corpus.val.max(initial=0))) if len(corpus.train) else 0
    if top >= vocab:
        raise ConfigError(f"data={spec.data}: token id {top} does not fit the model's vocabulary of {vocab}")
    meta = {"corpus": corpus_meta(corpus, spec), "model_source": source.describe(), "world_size": world}
    return Context(corpus, source, device, meta=meta, world=world)


def corpus_meta(corpus: Any, spec: TrainSpec) -> dict:
    """What meta.json records of the corpus: source and hashes, split, sizes, and the passes every
    cell makes over its training tokens."""
    read = spec.steps * spec.batch * (max(spec.seq_len) + 1)
    return {**corpus.meta, "sha256": corpus.sha256, "documents": corpus.documents,
            "val_documents": corpus.val_documents, "train_tokens": len(corpus.train), "val_tokens": len(corpus.val),
            "train_text_bytes": corpus.train_text_bytes, "val_every": spec.val_every,
            "passes_per_cell": round(corpus.passes(read), 4)}


#: Schemes whose training path applies attention dropout (PyTorch SDPA's dropout_p).
DROPOUT_SCHEMES = (Position.NONE, Position.ALIBI, Position.ROPE)


def cells(spec: TrainSpec, ctx: Any = None) -> list[dict[str, Any]]:
    """Every (L, seed, position, s) combination (s only for randomised schemes), and each
    attention-dropout control (the dropout_positions again with it). The length and the dropout
    enter the key only when used, so runs without them keep their cells."""
    out = []
    for L in spec.seq_len:
        at = {"seq_len": L} if len(spec.seq_len) > 1 else {}
        for i, seed in enumerate(spec.seed):
            for d in spec.attn_dropout:
                for p in (spec.position if d == 0 else [p for p in spec.position if p in spec.dropout_positions]):
                    if i > 0 and spec.all_seeds is not None and p not in spec.all_seeds:
                        continue
                    drop = {"attn_dropout": d} if d > 0 else {}
                    for s in (spec.s if p is not Position.ROPE and INFO[method_of(p)].randomized else (0,)):
                        out.append({"position": p.value, "s": s, "seed": seed, **at, **drop})
    return out


def learning_rate(spec: TrainSpec, step: int, steps: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to 10% of it at the last step."""
    warm = min(spec.warmup, max(steps - 1, 0))
    if step <= warm:
        return spec.lr * step / max(1, warm)
    frac = (step - warm) / max(1, steps - warm)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def eval_interval(spec: TrainSpec, steps: int) -> int:
    """Steps between evaluations: ``eval_every``, but at least five evaluations in a stage (and
    always one at its last step)."""
    five = max(1, steps // 5)
    return min(spec.eval_every, five) if spec.eval_every else five


# ---------------------------------------------------------------------------------------------
# one stage: a model trained for ``steps`` steps under one scheme


@dataclass
class Stage:
    """What a stage trains: ``label`` for progress lines, the scheme, where its weights start
    (``init``: a checkpoint, or None for fresh weights) and whether LoRA adapters are trained."""

    position: Position
    s: int
    seed: int
    steps: int
    seq_len: int
    init: Optional[Path]
    label: str
    dropout: float = 0.0
    lora: bool = False
    #: training steps the weights saw before this stage (a fine-tune after ``pretrain_steps`` of
    #: pretraining): the stage's step t draws batch, masks and dropout of global step
    #: ``first_step + t``, so fine-tuning continues the data stream instead of replaying it
    first_step: int = 0


def _build(spec: TrainSpec, ctx: Context, stage: Stage, resume: Optional[Path]) -> tuple[Any, Any]:
    """The stage's model with its scheme installed (not yet on the device or wrapped): from the
    resume checkpoint, from ``stage.init``, or fresh weights from the seed."""
    from poslsh_cli import convert
    from poslsh_cli.positions import install, set_attention_dropout

    if resume is not None and not stage.lora:
        model = convert.load_weights(resume)
    elif stage.init is not None:
        model = convert.load_weights(stage.init)
    else:
        model = convert.new_model(ctx.source, derive_seed(stage.seed, "init"))
    state = ctx.source.state(stage.position, model, stage.s, spec.window_sigmas, stage.seed)
    install(model, state)
    set_attention_dropout(model, stage.dropout)
    if stage.lora:
        model = convert.with_lora(model, spec.lora_rank, spec.lora_alpha, spec.lora_targets)
        if resume is not None:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(model, load_file(str(resume / "adapter_model.safetensors")))
    if spec.gradient_checkpointing:
        convert.base_of(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, state


def _wrap(spec: TrainSpec, ctx: Context, model: Any) -> Any:
    """The model as several processes train it (DDP or FSDP); itself in one process."""
    if ctx.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    if spec.parallel is Parallel.FSDP:
        from torch.distributed.fsdp import fully_shard

        for layer in convert_layers(model):
            fully_shard(layer)
        return fully_shard(model)
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def convert_layers(model: Any) -> list[Any]:
    """The decoder layers (the units FSDP shards one at a time)."""
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and type(m[0]).__name__.endswith(("DecoderLayer", "Block")):
            return list(m)
    return []


def _state_dicts(spec: TrainSpec, ctx: Context, model: Any, opt: Any) -> tuple[Optional[dict], Optional[dict]]:
    """Full weights and optimizer state of a sharded model, gathered on every rank (collective);
    (None, None) when the model is whole in every process."""
    if spec.parallel is not Parallel.FSDP or ctx.world == 1:
        return None, None
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, opt, options=opts)


def _save(ctx: Context, model: Any, path: Path, info: dict, opt: Any = None, full: tuple = (None, None),
          lora_save: str = "merged", scaler: Any = None) -> None:
    import torch

    from poslsh_cli.convert import save

    weights, optim = full
    save(model, path, info, ctx.source.tokenizer, lora_save, state_dict=weights)
    if opt is not None:
        torch.save(optim if optim is not None else opt.state_dict(), path / "optimizer.pt")
    if scaler is not None:  # fp16: the loss scale and its growth tracker, so a resumed run scales alike
        torch.save(scaler.state_dict(), path / SCALER)


def load_scaler(scaler: Any, checkpoint: Path) -> None:
    """Restore an fp16 run's GradScaler from its checkpoint (``scaler.pt``); a checkpoint without one
    (written by a run in another precision) is refused rather than resumed at the initial scale."""
    import torch

    path = Path(checkpoint) / SCALER
    if not path.is_file():
        raise ConfigError(f"{checkpoint} has no {SCALER} (the loss scale of an fp16 run); resume it with the "
                          "precision it was trained with")
    scaler.load_state_dict(torch.load(path, weights_only=True))


def _load_optimizer(spec: TrainSpec, ctx: Context, model: Any, opt: Any, path: Path) -> None:
    import torch

    saved = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    if spec.parallel is Parallel.FSDP and ctx.world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, opt, optim_state_dict=saved, options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(saved)


def _autocast(spec: TrainSpec, device: Any) -> Any:
    import contextlib

    import torch

    if spec.precision is Precision.FP32:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if spec.precision is Precision.BF16 else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def train_stage(spec: TrainSpec, ctx: Context, work: Any, stage: Stage) -> Path:
    """Train one stage in the cell directory ``work`` (resumable from its newest complete
    checkpoint, or from scratch with an emptied log); returns its verified ``final/``. With several
    processes rank 0 decides where to start and writes; every rank trains its share."""
    import contextlib

    import numpy as np
    import torch

    from poslsh_cli import distributed as dist
    from poslsh_cli.data import spread_sample, train_batch
    from poslsh_cli.files import atomic_write_text, fault_point, write_dir
    from poslsh_cli.lm import evaluate

    def where() -> tuple[str, Optional[str], int]:
        final = work.finished()
        if final is not None:
            return "final", str(final), 0
        last = work.checkpoints().latest()
        return ("resume", str(last[1]), last[0]) if last is not None else ("start", None, 0)

    how, at, start = dist.decide(where)
    if how == "final":
        return Path(at)
    resume = Path(at) if how == "resume" else None
    metrics = work.metrics(METRICS)
    ckpts = work.checkpoints()
    model, state = _build(spec, ctx, stage, resume)
    if resume is not None:
        work.progress(start, stage.steps, f"{stage.label} resumed from the checkpoint of step {start}")
    metrics.truncate_after("step", start)  # steps after the starting point are computed again
    model.to(ctx.device)
    model.train()
    trained = _wrap(spec, ctx, model)
    named = [(n, p) for n, p in trained.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if p.ndim >= 2]
    other = [p for n, p in named if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
    if resume is not None:
        _load_optimizer(spec, ctx, trained, opt, resume)
    scaler = torch.amp.GradScaler(ctx.device.type) if spec.precision is Precision.FP16 else None
    if scaler is not None and resume is not None:
        load_scaler(scaler, resume)
    info = {"position": stage.position.value, "s": stage.s, "seed": stage.seed, "seq_len": stage.seq_len,
            "steps": stage.steps, "data": spec.data, "data_sha256": ctx.corpus.sha256,
            "val_fraction": spec.val_fraction, "val_every": spec.val_every, "data_field": spec.data_field,
            "attn_dropout": stage.dropout, "init": str(stage.init) if stage.init else None,
            "tokenizer": ctx.corpus.tokenizer, "lora_rank": spec.lora_rank if stage.lora else 0,
            "scheme": state.to_json(), "trainable": int(sum(p.numel() for _, p in named)), "world_size": ctx.world}
    done = metrics.frame()
    elapsed = float(done.seconds.iloc[-1]) if len(done) else 0.0
    world, rank = ctx.world, dist.rank()
    micro = micro_batch(spec, world)
    share = spec.batch // world
    tokens_per_step = spec.batch * stage.seq_len
    every = eval_interval(spec, stage.steps)
    lora_save = spec.lora_save.value
    for step in range(start + 1, stage.steps + 1):
        t0 = time.perf_counter()
        stream = stage.first_step + step  # the global step: what this step's randomness is drawn for
        state.step = stream
        lr = learning_rate(spec, step, stage.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        rng = np.random.default_rng(derive_seed(stage.seed, "batch", stream))
        if stage.dropout:  # dropout draws from torch's global generator: seeded per step and rank, so a
            # run (and a run resumed from a checkpoint) draws the same dropout masks; with several
            # processes each rank draws its own, so it does not replay one process (docs/THEORY.md)
            torch.manual_seed(derive_seed(stage.seed, "dropout", stream, rank))
        batch = train_batch(ctx.corpus.train, stage.seq_len, spec.batch, rng)[rank * share:(rank + 1) * share]
        xb = torch.as_tensor(batch, device=ctx.device)
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for m in range(spec.accumulate):
            x = xb[m * micro:(m + 1) * micro]
            last = m == spec.accumulate - 1
            sync = contextlib.nullcontext() if last or world == 1 or spec.parallel is Parallel.FSDP \
                else trained.no_sync()
            with sync:
                with _autocast(spec, ctx.device):
                    logits = trained(input_ids=x[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                         x[:, 1:].reshape(-1)) / spec.accumulate
                (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += loss.item()
        if scaler is not None:
            scaler.unscale_(opt)
        if spec.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], spec.grad_clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        loss_value = dist.all_reduce_mean(loss_sum, ctx.device)
        dt = time.perf_counter() - t0
        elapsed += dt
        row = {"step": step, "tokens": step * tokens_per_step, "loss": loss_value, "val_loss": None,
               "val_bpb": None, "lr": lr, "seconds": round(elapsed, 4), "step_seconds": round(dt, 5),
               "tokens_per_s": round(tokens_per_step / dt, 1)}
        if step % every == 0 or step == stage.steps:
            ev = evaluate(trained, state, ctx.corpus.val, stage.seq_len, max_tokens=spec.eval_tokens,
                          token_bytes=ctx.corpus.val_bytes, shard=(rank, world))
            row["val_loss"] = ev.loss
            row["val_bpb"] = ev.bits_per_byte
            if step == stage.steps:  # the final weights on as many training tokens, spread over the
                # whole training split as the validation documents are over the corpus: the overfitting gap
                tr = evaluate(trained, state, spread_sample(ctx.corpus.train, stage.seq_len, spec.eval_tokens),
                              stage.seq_len, shard=(rank, world))
                if dist.is_main():
                    atomic_write_text(work.path / TRAIN_EVAL, json.dumps(
                        {"step": step, "loss": tr.loss, "sampling": TRAIN_SAMPLE}) + "\n")
        metrics.append(row)
        fault_point(f"step:{step}")
        work.progress(step, stage.steps, f"{stage.label} loss {loss_value:.3f}"
                      + (f" val_bpb {row['val_bpb']:.3f}" if row["val_bpb"] else ""))
        if step % spec.checkpoint_every == 0 and step < stage.steps:
            full = _state_dicts(spec, ctx, trained, opt)
            if dist.is_main():
                ckpts.save(step, lambda d: _save(ctx, model, d, {**info, "step": step}, opt, full, "adapter",
                                                 scaler), keep=2)
    full = _state_dicts(spec, ctx, trained, opt)
    final = dist.decide(lambda: str(write_dir(work.final, lambda d: _save(
        ctx, model, d, {**info, "step": stage.steps}, full=(full[0], None), lora_save=lora_save))))
    return Path(final)


def run_cell(spec: TrainSpec, key: dict[str, Any], ctx: Context, work: Any) -> tuple[list[dict], dict]:
    from poslsh_cli import distributed as dist
    from poslsh_cli.cellwork import read_log
    from poslsh_cli.rundir import read_json

    t0 = time.perf_counter()
    position, s, seed = Position(key["position"]), key["s"], key["seed"]
    L, dropout = key.get("seq_len", spec.seq_len[0]), float(key.get("attn_dropout", 0.0))
    init = Path(ctx.source.path) if ctx.source.kind.value == "init" else None
    if spec.pretrain is not None:
        at = f"-L{L}" if len(spec.seq_len) > 1 else ""
        base = Stage(spec.pretrain, spec.s[0] if spec.pretrain is Position.POSLSH else 0, seed, spec.pretrain_steps,
                     L, init, f"pretrain {spec.pretrain.value}")
        init = train_stage(spec, ctx, work.shared(f"pretrain-{spec.pretrain.value}-seed{seed}{at}"), base)
    label = (f"{position.value}" + (f" s={s}" if s else "") + (f" dropout={dropout:g}" if dropout else "")
             + f" seed={seed}" + (f" L={L}" if len(spec.seq_len) > 1 else ""))
    final = train_stage(spec, ctx, work, Stage(position, s, seed, spec.steps, L, init, label, dropout,
                                               lora=spec.lora_rank > 0,
                                               first_step=spec.pretrain_steps if spec.pretrain is not None else 0))
    if not dist.is_main():
        return [], {}
    m = read_log(work.path / "metrics.csv")
    train_eval, _ = read_json(work.path / TRAIN_EVAL)
    tail = m.tail(max(1, len(m) // 10))
    last = m[m.val_loss.notna()].iloc[-1]  # the evaluation of the final weights (the last step's)
    pre = spec.pretrain_steps * spec.batch * L if spec.pretrain is not None else 0
    row = {"position": position.value, "s": s, "seed": seed, "seq_len": L, "steps": spec.steps,
           "tokens": int(m.tokens.iloc[-1]), "params": _param_count(final if not spec.lora_rank else ctx.source.path),
           "train_loss": float(tail.loss.mean()), "val_loss": float(last.val_loss), "val_bpb": float(last.val_bpb),
           "val_ppl": math.exp(float(last.val_loss)), "seconds": float(m.seconds.iloc[-1]),
           "tokens_per_s": float(m.tokens.iloc[-1] / m.seconds.iloc[-1]),
           "pretrain": spec.pretrain.value if spec.pretrain else "", "init": str(spec.init or spec.arch or ""),
           "checkpoint": work.relative(final), "wall_seconds": time.perf_counter() - t0,
           "step_seconds": float(m.step_seconds.median()), "attn_dropout": dropout,
           "passes": ctx.corpus.passes(float(m.tokens.iloc[-1]) + pre),
           "trainable": _trainable(final), "world_size": ctx.world, "tokenizer": ctx.corpus.tokenizer,
           "bits_per_token": float(last.val_loss) / math.log(2.0),
           "train_eval_loss": float(train_eval["loss"]) if isinstance(train_eval, dict) else math.nan,
           "train_eval_sample": train_eval.get("sampling", "first") if isinstance(train_eval, dict) else "",
           "sigmas": _sigmas(final, position)}
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
    """The trained scheme's bandwidths (:func:`~poslsh_cli.positions.sigma_label`); empty for the
    schemes that have none (rope, none)."""
    import json

    from poslsh_cli.positions import sigma_label

    if position in (Position.ROPE, Position.NONE):
        return ""
    info = json.loads((Path(final) / "poslsh_train.json").read_text())
    return sigma_label((info.get("scheme") or {}).get("sigmas"))


def _trainable(final: Path) -> int:
    """Parameters the stage trained (all of them, or the LoRA adapters'), as recorded with it."""
    import json

    return int(json.loads((Path(final) / "poslsh_train.json").read_text()).get("trainable", -1))


def skip_reason(spec: TrainSpec) -> Optional[str]:
    """Why ``poslsh reproduce`` skips a preset here: no CUDA for a GPU preset, or no checkpoint
    for init= / arch= (a model preset looks in $POSLSH_MODELS)."""
    from poslsh_cli.convert import resolve_ref

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

    List values sweep: position=[none,alibi,poslsh] s=[10,20] seed=[0,1] trains every combination,
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
    presets=("train", "train_finetune", "train_long", "train_gpu", "train_long_gpu", "finetune_mistral_7b_gpu",
             "train_qwen3_0_6b_gpu"),
    opt_in=("train_long",),
    order=50,
    skip_reason=skip_reason,
    distributed=True,
)
