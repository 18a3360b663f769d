"""One training stage of ``poslsh train``: a model trained for ``steps`` steps under one scheme,
in one cell's work directory, resumable from its newest complete checkpoint.

The loop reads top to bottom (:func:`train_stage`): where to start, the set-up (:class:`StageRun`:
the model with its scheme, wrapped for several processes, the optimizer, the loss scaler, the
metrics log and checkpoints), then per step :meth:`StageRun.train_step`,
:meth:`StageRun.maybe_evaluate`, :meth:`StageRun.log` and :meth:`StageRun.maybe_checkpoint`, and
:meth:`StageRun.finish` writing ``final/``. Distributed, LoRA and fp16 details stay in the set-up
and the save/load helpers. ``spec`` is the command's ``TrainSpec`` and ``ctx`` its ``TrainContext``
(:mod:`poslsh_cli.experiments.train.spec`); with several processes rank 0 decides and writes, every
rank trains its share of the global batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from poslsh_cli.core import distributed as dist
from poslsh_cli.experiments.train.cost import PACE_STEPS, say_cost
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.devices import Precision, autocast
from poslsh_cli.experiments.train.spec import Parallel, TrainContext, TrainSpec
from poslsh_cli.attention.scheme import SchemeKeys
from poslsh_cli.lm.positions import PositionState
from poslsh_cli.lm import convert, evaluate as evaluation, lora, windows
from poslsh_cli.numerics.sampling import derive_seed
from poslsh_cli.store.cellwork import CellWork, Checkpoints, MetricsLog, NullLog
from poslsh_cli.store.tracking import Tracker, open_for
from poslsh_cli.core.files import atomic_write_text, fault_point, write_dir
from poslsh_cli.lm.evaluate import evaluate
from poslsh_cli.lm.install import install, set_attention_dropout
from poslsh_cli.lm.trained import TrainInfo
from poslsh_cli.lm.windows import spread_sample

if TYPE_CHECKING:
    import torch

    #: a model as the loop holds it: a transformers causal LM (or its LoRA wrapper), DDP- or
    #: FSDP-wrapped while several processes train it
    Model = torch.nn.Module


#: the final weights' loss on ``eval_tokens`` spread over the training split (nats per token), per stage
TRAIN_EVAL = "train_eval.json"


#: the GradScaler state of an fp16 run, beside optimizer.pt in every checkpoint
SCALER = "scaler.pt"


#: how the training-split evaluation samples its windows (``train_eval_sample``): spans spread over
#: the whole split (:func:`poslsh_cli.lm.windows.spread_sample`); older runs scored its first tokens
TRAIN_SAMPLE = "spread"


METRICS = ["step", "tokens", "loss", "val_loss", "val_bpb", "lr", "seconds", "step_seconds", "tokens_per_s",
           *evaluation.columns("val_")]


def micro_batch(spec: TrainSpec, world: int) -> int:
    """Sequences per forward pass of one process; refuses a global batch that does not divide."""
    parts = world * spec.accumulate
    if spec.batch % parts:
        raise ConfigError(f"batch={spec.batch} does not divide into {world} process(es) x accumulate={spec.accumulate} "
                          f"micro-batches; use a multiple of {parts}")
    return spec.batch // parts


def learning_rate(spec: TrainSpec, step: int, steps: int) -> float:
    """Linear warm-up to ``lr`` (``warmup`` steps, or ``warmup_fraction`` of the stage's), then
    cosine decay to 10% of it at the last step."""
    warm = min(warmup_steps(spec, steps), max(steps - 1, 0))
    if step <= warm:
        return spec.lr * step / max(1, warm)
    frac = (step - warm) / max(1, steps - warm)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def warmup_steps(spec: TrainSpec, steps: int) -> int:
    """Warm-up steps of a stage of ``steps`` steps: ``warmup_fraction`` of them (rounded) when set,
    else ``warmup``."""
    return spec.warmup if spec.warmup_fraction is None else int(round(spec.warmup_fraction * steps))


def eval_interval(spec: TrainSpec, steps: int) -> int:
    """Steps between evaluations: ``eval_every``, but at least five evaluations in a stage (and
    always one at its last step)."""
    five = max(1, steps // 5)
    return min(spec.eval_every, five) if spec.eval_every else five


@dataclass
class Stage:
    """What a stage trains: ``label`` for progress lines, the scheme's keys (``keys``: its position, s
    masks per head per step, sigma, window, sampler and the mask seed, the stage's ``seed``), where its
    weights start (``init``: a checkpoint, or None for fresh weights) and whether LoRA adapters are
    trained."""

    keys: SchemeKeys
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

    @property
    def seed(self) -> int:  # the root of its masks, batches, initial weights and dropout
        return self.keys.seed


def _build(spec: TrainSpec, ctx: TrainContext, stage: Stage, resume: Optional[Path]) -> tuple[Model, PositionState]:
    """The stage's model with its scheme installed (not yet on the device or wrapped): from the
    resume checkpoint, from ``stage.init``, or fresh weights from the seed."""
    if resume is not None and not stage.lora:
        model = convert.load_weights(resume)
    elif stage.init is not None:
        model = convert.load_weights(stage.init)
    else:
        model = convert.new_model(ctx.source, derive_seed(stage.seed, "init"))
    state = ctx.source.state(stage.keys, model)
    install(model, state)
    set_attention_dropout(model, stage.dropout)
    if stage.lora:
        model = lora.with_lora(model, spec.lora_rank, spec.lora_alpha, spec.lora_targets, spec.lora_dropout)
        if resume is not None:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(model, load_file(str(resume / "adapter_model.safetensors")))
    if spec.gradient_checkpointing:
        base, kwargs = lora.base_of(model), {"use_reentrant": False}
        if hasattr(base, "activation_checkpointing_enable"):  # transformers' name since it deprecated the old one
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model, state


def _wrap(spec: TrainSpec, ctx: TrainContext, model: Model) -> Model:
    """The model as several processes train it (DDP or FSDP); itself in one process."""
    if ctx.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    if spec.parallel is Parallel.FSDP:
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        return fully_shard(model)
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def decoder_layers(model: Model) -> list[Model]:
    """The decoder layers (the units FSDP shards one at a time)."""
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and type(m[0]).__name__.endswith(("DecoderLayer", "Block")):
            return list(m)
    return []


def _state_dicts(spec: TrainSpec, ctx: TrainContext, model: Model,
                 opt: torch.optim.Optimizer) -> tuple[Optional[dict], Optional[dict]]:
    """Full weights and optimizer state of a sharded model, gathered on every rank (collective);
    (None, None) when the model is whole in every process."""
    if spec.parallel is not Parallel.FSDP or ctx.world == 1:
        return None, None
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, opt, options=opts)


def _save(ctx: TrainContext, model: Model, path: Path, info: Any, opt: Optional[torch.optim.Optimizer] = None,
          full: tuple = (None, None), lora_save: str = "merged", scaler: Optional[torch.amp.GradScaler] = None) -> None:
    import torch


    weights, optim = full
    convert.save(model, path, info, ctx.source.tokenizer, lora_save, state_dict=weights)
    if opt is not None:
        torch.save(optim if optim is not None else opt.state_dict(), path / "optimizer.pt")
    if scaler is not None:  # fp16: the loss scale and its growth tracker, so a resumed run scales alike
        torch.save(scaler.state_dict(), path / SCALER)


def load_scaler(scaler: torch.amp.GradScaler, checkpoint: Path) -> None:
    """Restore an fp16 run's GradScaler from its checkpoint (``scaler.pt``); a checkpoint without one
    (written by a run in another precision) is refused rather than resumed at the initial scale."""
    import torch

    path = Path(checkpoint) / SCALER
    if not path.is_file():
        raise ConfigError(f"{checkpoint} has no {SCALER} (the loss scale of an fp16 run); resume it with the "
                          "precision it was trained with")
    scaler.load_state_dict(torch.load(path, weights_only=True))


def _load_optimizer(spec: TrainSpec, ctx: TrainContext, model: Model, opt: torch.optim.Optimizer, path: Path) -> None:
    import torch

    saved = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    if spec.parallel is Parallel.FSDP and ctx.world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, opt, optim_state_dict=saved, options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(saved)


def _autocast(spec: TrainSpec, device: torch.device) -> contextlib.AbstractContextManager:
    return autocast(spec.precision, device)


def train_stage(spec: TrainSpec, ctx: TrainContext, work: CellWork, stage: Stage) -> Path:
    """Train one stage in the cell directory ``work``; returns its verified ``final/``."""
    how, at, start = dist.decide(lambda: _starting_point(work))
    if how == "final":
        return Path(at)
    run = StageRun.set_up(spec, ctx, work, stage, Path(at) if how == "resume" else None, start)
    paced: list[float] = []
    try:
        for step in range(start + 1, stage.steps + 1):
            row = run.train_step(step)
            if not ctx.cost_said and ctx.todo:
                paced.append(row["step_seconds"])
                if len(paced) == PACE_STEPS or step == stage.steps:
                    ctx.cost_said = True
                    if dist.is_main():
                        work.notice(say_cost(paced, stage.steps - start, spec, ctx.todo))
            run.maybe_evaluate(step, row)
            run.log(step, row)
            run.maybe_checkpoint(step)
        return run.finish()
    finally:
        run.tracker.close()


def _starting_point(work: CellWork) -> tuple[str, Optional[str], int]:
    """("final", its path, 0) for a finished stage, ("resume", the newest complete checkpoint, its
    step), or ("start", None, 0)."""
    final = work.finished()
    if final is not None:
        return "final", str(final), 0
    last = work.checkpoints().latest()
    return ("resume", str(last[1]), last[0]) if last is not None else ("start", None, 0)


@dataclass
class StageRun:
    """A stage being trained: everything its steps share."""

    spec: TrainSpec
    ctx: TrainContext
    work: CellWork
    stage: Stage
    model: Model  # the model as saved (unwrapped)
    trained: Model  # the model as trained: DDP- or FSDP-wrapped with several processes
    state: PositionState  # the scheme; its ``step`` selects the masks
    opt: torch.optim.Optimizer
    scaler: Optional[torch.amp.GradScaler]  # a GradScaler for fp16, else None
    params: list  # the trainable parameters
    info: Any  # what every checkpoint records (lm.trained.TrainInfo, poslsh_train.json)
    metrics: Union[MetricsLog, NullLog]  # NullLog on the ranks other than 0
    checkpoints: Checkpoints
    elapsed: float = 0.0
    rank: int = 0
    share: int = 0  # sequences of the global batch this rank trains
    micro: int = 0  # sequences per forward pass
    every: int = 1  # steps between evaluations
    timer: float = field(default=0.0, repr=False)
    tracker: Optional[Tracker] = None  # TensorBoard / W&B beside metrics.csv (store/tracking.py)

    @classmethod
    def set_up(cls, spec: TrainSpec, ctx: TrainContext, work: CellWork, stage: Stage, resume: Optional[Path],
               start: int) -> "StageRun":
        import torch

        metrics, ckpts = work.metrics(METRICS), work.checkpoints()
        model, state = _build(spec, ctx, stage, resume)
        if resume is not None:
            work.progress(start, stage.steps, f"{stage.label} resumed from the checkpoint of step {start}")
        metrics.truncate_after("step", start)  # steps after the starting point are computed again
        model.to(ctx.device)
        model.train()
        trained = _wrap(spec, ctx, model)
        named = [(n, p) for n, p in trained.named_parameters() if p.requires_grad]
        opt = torch.optim.AdamW([{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": spec.weight_decay},
                                 {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}],
                                lr=spec.lr, betas=(0.9, 0.95))
        scaler = torch.amp.GradScaler(ctx.device.type) if spec.precision is Precision.FP16 else None
        if resume is not None:
            _load_optimizer(spec, ctx, trained, opt, resume)
            if scaler is not None:
                load_scaler(scaler, resume)

        info = TrainInfo(seed=stage.seed, seq_len=stage.seq_len,
                         steps=stage.steps, data=spec.data, data_sha256=ctx.corpus.sha256,
                         val_fraction=spec.val_fraction, val_every=spec.val_every, data_field=spec.data_field,
                         encoding=spec.encoding, attn_dropout=stage.dropout,
                         init=str(stage.init) if stage.init else None, tokenizer=ctx.corpus.tokenizer,
                         lora_rank=spec.lora_rank if stage.lora else 0, scheme=state,
                         trainable=int(sum(p.numel() for _, p in named)), world_size=ctx.world)
        done = metrics.frame()

        tracker = open_for(spec, work, stage.label, info.to_json(scheme=True), start)
        return cls(spec, ctx, work, stage, model, trained, state, opt, scaler, [p for _, p in named], info, metrics,
                   ckpts, elapsed=float(done.seconds.iloc[-1]) if len(done) else 0.0, rank=dist.rank(),
                   share=spec.batch // ctx.world, micro=micro_batch(spec, ctx.world),
                   every=eval_interval(spec, stage.steps), tracker=tracker)

    def _batch(self, stream: int) -> torch.Tensor:
        """This rank's share of the global batch of global step ``stream`` (drawn as one process
        draws it), on the device."""
        import numpy as np
        import torch

        rng = np.random.default_rng(derive_seed(self.stage.seed, "batch", stream))
        batch = windows.train_batch(self.ctx.corpus.train, self.stage.seq_len, self.spec.batch, rng)
        return torch.as_tensor(batch[self.rank * self.share:(self.rank + 1) * self.share], device=self.ctx.device)

    def train_step(self, step: int) -> dict:
        """One optimizer step over the global batch (accumulated micro-batches, all-reduced); the
        metrics row of the step."""
        import torch

        spec, stage = self.spec, self.stage
        self.timer = time.perf_counter()
        stream = stage.first_step + step  # the global step: what this step's randomness is drawn for
        self.state.step = stream
        lr = learning_rate(spec, step, stage.steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        if stage.dropout:  # dropout draws from torch's global generator: seeded per step and rank, so a
            # run (and a run resumed from a checkpoint) draws the same dropout masks; with several
            # processes each rank draws its own, so it does not replay one process (docs/THEORY.md)
            torch.manual_seed(derive_seed(stage.seed, "dropout", stream, self.rank))
        xb = self._batch(stream)
        self.opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for m in range(spec.accumulate):
            x = xb[m * self.micro:(m + 1) * self.micro]
            loss_sum += self._micro_step(x, last=m == spec.accumulate - 1)
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if spec.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, spec.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        loss = dist.all_reduce_mean(loss_sum, self.ctx.device)
        dt = time.perf_counter() - self.timer
        self.elapsed += dt
        tokens = spec.batch * stage.seq_len
        return {"step": step, "tokens": step * tokens, "loss": loss, "val_loss": None, "val_bpb": None, "lr": lr,
                "seconds": round(self.elapsed, 4), "step_seconds": round(dt, 5), "tokens_per_s": round(tokens / dt, 1)}

    def _micro_step(self, x: torch.Tensor, last: bool) -> float:
        """Forward and backward of one micro-batch (its loss divided by the number of them); DDP
        all-reduces the gradients on the last one only."""
        import torch

        spec = self.spec
        sync = contextlib.nullcontext() if last or self.ctx.world == 1 or spec.parallel is Parallel.FSDP \
            else self.trained.no_sync()
        with sync:
            with _autocast(spec, self.ctx.device):
                logits = self.trained(input_ids=x[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     x[:, 1:].reshape(-1)) / spec.accumulate
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss.item()

    def maybe_evaluate(self, step: int, row: dict) -> None:
        """Every ``every`` steps and at the last one: validation loss and bits per byte into ``row``;
        at the last step also the final weights' loss on the training split (``train_eval.json``)."""
        spec, stage, corpus, shard = self.spec, self.stage, self.ctx.corpus, (self.rank, self.ctx.world)
        if step % self.every and step != stage.steps:
            return
        def said(what: str) -> Any:  # evaluations take a while: the progress line says how far
            return lambda done, total: self.work.progress(step, stage.steps, f"{stage.label} {what} {done}/{total} "
                                                                             "windows")

        ev = evaluate(self.trained, self.state, corpus.val, stage.seq_len, max_tokens=spec.eval_tokens,
                      token_bytes=corpus.val_bytes, shard=shard, progress=said("validation"))
        row["val_loss"], row["val_bpb"] = ev.loss, ev.bits_per_byte
        row.update({f"val_{k}": v for k, v in ev.accuracy().items()})
        if step == stage.steps:  # as many training tokens, spread over the whole training split as the
            # validation documents are over the corpus: the overfitting gap compares like with like
            tr = evaluate(self.trained, self.state, spread_sample(corpus.train, stage.seq_len, spec.eval_tokens),
                          stage.seq_len, shard=shard, progress=said("final weights on the training split"))
            if dist.is_main():
                self.work.path.mkdir(parents=True, exist_ok=True)  # the first step may be the last: nothing made it yet
                atomic_write_text(self.work.path / TRAIN_EVAL, json.dumps(
                    {"step": step, "loss": tr.loss, "sampling": TRAIN_SAMPLE}) + "\n")

    def log(self, step: int, row: dict) -> None:
        self.metrics.append(row)
        if self.tracker is not None:
            self.tracker.log(step, row)
        fault_point(f"step:{step}")
        self.work.progress(step, self.stage.steps, f"{self.stage.label} loss {row['loss']:.3f}"
                           + (f" val_bpb {row['val_bpb']:.3f}" if row["val_bpb"] else ""))

    def maybe_checkpoint(self, step: int) -> None:
        """Every ``checkpoint_every`` steps before the last: a resumable checkpoint (weights or LoRA
        adapters, optimizer, loss scale), the newest two kept."""
        if step % self.spec.checkpoint_every or step >= self.stage.steps:
            return
        full = _state_dicts(self.spec, self.ctx, self.trained, self.opt)
        if dist.is_main():
            info = dataclasses.replace(self.info, step=step)
            self.checkpoints.save(step, lambda d: _save(self.ctx, self.model, d, info, self.opt, full, "adapter",
                                                        self.scaler), keep=2)

    def finish(self) -> Path:
        """``final/``: the trained weights (merged or as adapters, ``lora_save``), written whole by rank 0."""
        full = _state_dicts(self.spec, self.ctx, self.trained, self.opt)
        final = dist.decide(lambda: str(write_dir(self.work.final, lambda d: _save(
            self.ctx, self.model, d, dataclasses.replace(self.info, step=self.stage.steps), full=(full[0], None),
            lora_save=self.spec.lora_save.value))))
        return Path(final)
