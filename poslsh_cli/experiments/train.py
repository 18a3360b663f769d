"""``poslsh train``: train a byte-level decoder (Qwen3 architecture, from a transformers config)
under a position scheme: the paper's from-scratch and fine-tuning experiments, at laptop scale
on the CPU and at the paper's scale on a GPU.

Cells: every (seed, position, s) combination (s only for poslsh), each a sub-run in
``work/<cell>/`` with its own append-only ``metrics.csv``, step checkpoints
(``checkpoints/step-NNNNNNNN``, loadable by ``AutoModelForCausalLM.from_pretrained``) and the
final model in ``final/``. Everything random derives from the cell's seed: the initial weights,
the batch of step t (from (seed, t)) and the masks of step t, layer l, head h; so a run killed
at any point and started again with the same ``out=`` continues from its last checkpoint and
ends with the same weights and losses as an uninterrupted run (CPU).

``pretrain=P pretrain_steps=N`` first trains one model with scheme P (shared by every cell of a
seed, itself resumable), then trains each cell's scheme from it: the paper's fine-tuning
experiment. ``init=CHECKPOINT`` starts from an existing byte-level checkpoint instead.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from poslsh_cli.experiments.train_report import plot, report, summary
from poslsh_cli.config import ConfigError, Spec, check, key
from poslsh_cli.experiment import Experiment, Device, cuda_skip_reason, resolve_device
from poslsh_cli.methods import INFO
from poslsh_cli.positions import Arch, Position, PositionState, method_of
from poslsh_cli.sampling import derive_seed

COLUMNS = ("position", "s", "seed", "seq_len", "steps", "tokens", "params", "train_loss", "val_loss", "val_bpb",
           "val_ppl", "seconds", "tokens_per_s", "pretrain", "init", "checkpoint", "wall_seconds", "step_seconds")
METRICS = ["step", "tokens", "loss", "val_loss", "val_bpb", "lr", "seconds", "step_seconds", "tokens_per_s"]
LN2 = math.log(2.0)


@dataclass(frozen=True)
class TrainSpec(Spec):
    seed: tuple[int, ...] = key("seeds (list sweeps): each trains its own model", [0], ge=0)
    position: tuple[Position, ...] = key("position schemes (list sweeps): none, alibi, poslsh, fixed_block, "
                                         "windowed, rope", [Position.ALIBI, Position.POSLSH], noun="position")
    s: tuple[int, ...] = key("Positional-LSH masks per head per step (list sweeps; poslsh only)", [10], ge=1)
    all_seeds: Optional[tuple[Position, ...]] = key("schemes trained with every seed; the others with the first "
                                                    "seed only (null: all)", None, noun="position")
    window_sigmas: float = key("windowed: keys with |i-j| <= ceil(c sigma_h)", 4.0, gt=0)
    data: str = key("builtin (Python's documentation prose, 0.76 MB), a text file or a folder of them", "builtin")
    val_fraction: float = key("the last part of the corpus, held out for validation", 0.1, gt=0)
    seq_len: tuple[int, ...] = key("training lengths L in bytes (list sweeps: each trains its own model)", [256], ge=2)
    batch: int = key("sequences per step", 16, ge=1)
    steps: int = key("optimizer steps (per stage)", 1000, ge=1)
    lr: float = key("peak learning rate (AdamW; linear warm-up, cosine decay to 10%)", 2e-3, gt=0)
    warmup: int = key("warm-up steps", 100, ge=0)
    weight_decay: float = key("AdamW weight decay", 0.1, ge=0)
    grad_clip: float = key("gradient norm clip (0: none)", 1.0, ge=0)
    hidden: int = key("model width", 128, ge=1)
    layers: int = key("decoder layers", 4, ge=1)
    heads: int = key("attention heads (one ALiBi slope each)", 8, ge=1)
    kv_heads: int = key("key/value heads (grouped-query attention)", 8, ge=1)
    head_dim: int = key("head dimension", 16, ge=1)
    intermediate: int = key("MLP width", 384, ge=1)
    eval_every: int = key("evaluate on the validation bytes every this many steps (at least five times per stage, "
                          "and at its last step; 0: five times)", 100, ge=0)
    eval_tokens: int = key("validation bytes per evaluation (non-overlapping windows of L)", 32768, ge=2)
    checkpoint_every: int = key("save a resumable checkpoint every this many steps", 200, ge=1)
    init: Optional[str] = key("a byte-level checkpoint to start from (fine-tuning)", None)
    pretrain: Optional[Position] = key("train this scheme first (pretrain_steps), then each cell from it", None)
    pretrain_steps: int = key("steps of the shared pretraining stage", 0, ge=0)
    device: Device = key("auto (CUDA when present), cpu, cuda, cuda:N", Device("auto"))

    def check(self) -> None:
        check(self.val_fraction < 1, f"val_fraction must be < 1, got {self.val_fraction}")
        check(self.heads % self.kv_heads == 0, f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.pretrain is not None:
            check(self.pretrain_steps >= 1, "pretrain= needs pretrain_steps >= 1")


@dataclass
class Context:
    corpus: Any
    arch: Arch
    device: Any
    init: Optional[Path]
    meta: dict = field(default_factory=dict)


def prepare(spec: TrainSpec) -> Context:

    from poslsh_cli.capture import check_checkpoint
    from poslsh_cli.data import VOCAB, load_corpus
    from poslsh_cli.lm import fast_cpu_math

    device = resolve_device(spec.device)
    fast_cpu_math()
    corpus = load_corpus(spec.data, spec.val_fraction, min_bytes=max(spec.seq_len) + 1)
    init = None
    arch = Arch(spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.intermediate, spec.head_dim,
                max_positions=max(32 * max(spec.seq_len), 8192))
    if spec.init is not None:
        init = Path(spec.init).expanduser().resolve()
        check_checkpoint(init)
        cfg = json.loads((init / "config.json").read_text())
        if cfg.get("vocab_size") != VOCAB:
            raise ConfigError(f"init={spec.init}: vocabulary {cfg.get('vocab_size')} is not byte-level ({VOCAB})")
        if cfg.get("model_type") != "qwen3":
            raise ConfigError(f"init={spec.init}: model_type {cfg.get('model_type')!r}; poslsh train uses qwen3")
        arch = Arch(cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                    cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["head_dim"],
                    cfg.get("max_position_embeddings", arch.max_positions))
    return Context(corpus, arch, device, init,
                   meta={"corpus": {"source": corpus.source, "sha256": corpus.sha256, "train_bytes": len(corpus.train),
                                    "val_bytes": len(corpus.val), "val_fraction": spec.val_fraction}})


def cells(spec: TrainSpec, ctx: Any = None) -> list[dict[str, Any]]:
    """Every (L, seed, position, s) combination (s only for randomised schemes); the length enters
    the key only when several are trained."""
    out = []
    for L in spec.seq_len:
        at = {"seq_len": L} if len(spec.seq_len) > 1 else {}
        for i, seed in enumerate(spec.seed):
            for p in spec.position:
                if i > 0 and spec.all_seeds is not None and p not in spec.all_seeds:
                    continue
                for s in (spec.s if p is not Position.ROPE and INFO[method_of(p)].randomized else (0,)):
                    out.append({"position": p.value, "s": s, "seed": seed, **at})
    return out


def state_for(spec: TrainSpec, position: Position, s: int, seed: int, heads: int) -> PositionState:
    return PositionState.standard(position, heads, num_samples=s, window_sigmas=spec.window_sigmas, seed=seed)


def learning_rate(spec: TrainSpec, step: int, steps: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to 10% of it at the last step."""
    warm = min(spec.warmup, max(steps - 1, 0))
    if step <= warm:
        return spec.lr * step / max(1, warm)
    frac = (step - warm) / max(1, steps - warm)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _save(model: Any, path: Path, extra: dict[str, Any], optimizer: Any = None) -> None:
    import torch

    model.save_pretrained(path, safe_serialization=True)
    (path / "poslsh_train.json").write_text(json.dumps(extra, indent=1) + "\n")
    if optimizer is not None:
        torch.save(optimizer.state_dict(), path / "optimizer.pt")


def _load(path: Path, state: PositionState, device: Any) -> Any:
    import transformers as tf

    from poslsh_cli.positions import install

    tf.logging.set_verbosity_error()
    model = tf.Qwen3ForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                attn_implementation="sdpa")
    return install(model, state).to(device)


def eval_interval(spec: TrainSpec, steps: int) -> int:
    """Steps between evaluations: ``eval_every``, but at least five evaluations in a stage (and
    always one at its last step)."""
    five = max(1, steps // 5)
    return min(spec.eval_every, five) if spec.eval_every else five


def train_stage(spec: TrainSpec, ctx: Context, work: Any, state: PositionState, seed: int, steps: int,
                init: Optional[Path], label: str, seq_len: int) -> Path:
    """Train ``steps`` steps under ``state`` in the cell directory ``work`` (resumable from its newest
    complete checkpoint, or from scratch with an emptied log); returns its verified ``final/``."""
    import numpy as np
    import torch

    from poslsh_cli.data import train_batch
    from poslsh_cli.files import fault_point, write_dir
    from poslsh_cli.lm import evaluate
    from poslsh_cli.positions import build_model

    final = work.finished()
    if final is not None:
        return final
    metrics = work.metrics(METRICS)
    ckpts = work.checkpoints()
    info = {"position": state.position.value, "s": state.num_samples, "seed": seed, "seq_len": seq_len,
            "steps": steps, "data": spec.data, "data_sha256": ctx.corpus.sha256, "val_fraction": spec.val_fraction,
            "init": str(init) if init else None}
    start, last = 0, ckpts.latest()
    if last is not None:
        start, src = last
        model = _load(src, state, ctx.device)
        work.progress(start, steps, f"{label} resumed from the checkpoint of step {start}")
    elif init is not None:
        model = _load(init, state, ctx.device)
    else:
        model = build_model(ctx.arch, state, derive_seed(seed, "init")).to(ctx.device)
    metrics.truncate_after("step", start)  # steps after the starting point are computed again
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
    if last is not None:
        opt.load_state_dict(torch.load(last[1] / "optimizer.pt", weights_only=True))
    done = metrics.frame()
    elapsed = float(done.seconds.iloc[-1]) if len(done) else 0.0
    tokens_per_step = spec.batch * seq_len
    every = eval_interval(spec, steps)
    for step in range(start + 1, steps + 1):
        t0 = time.perf_counter()
        state.step = step
        lr = learning_rate(spec, step, steps)
        for g in opt.param_groups:
            g["lr"] = lr
        rng = np.random.default_rng(derive_seed(seed, "batch", step))
        xb = torch.as_tensor(train_batch(ctx.corpus.train, seq_len, spec.batch, rng), device=ctx.device)
        logits = model(input_ids=xb[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), xb[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if spec.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        dt = time.perf_counter() - t0
        elapsed += dt
        loss = loss.item()
        row = {"step": step, "tokens": step * tokens_per_step, "loss": loss, "val_loss": None,
               "val_bpb": None, "lr": lr, "seconds": round(elapsed, 4), "step_seconds": round(dt, 5),
               "tokens_per_s": round(tokens_per_step / dt, 1)}
        if step % every == 0 or step == steps:
            ev = evaluate(model, state, ctx.corpus.val, seq_len, max_tokens=spec.eval_tokens)
            row["val_loss"] = ev.loss
            row["val_bpb"] = ev.loss / LN2
        metrics.append(row)
        fault_point(f"step:{step}")
        work.progress(step, steps, f"{label} loss {loss:.3f}" + (f" val_bpb {row['val_bpb']:.3f}" if row["val_bpb"] else ""))
        if step % spec.checkpoint_every == 0 and step < steps:
            ckpts.save(step, lambda d: _save(model, d, {**info, "step": step}, opt), keep=2)
    return write_dir(work.final, lambda d: _save(model, d, {**info, "step": steps}))


def run_cell(spec: TrainSpec, key: dict[str, Any], ctx: Context, work: Any) -> tuple[list[dict], dict]:
    from poslsh_cli.cellwork import read_log
    from poslsh_cli.lm import evaluate
    from poslsh_cli.positions import load_model

    t0 = time.perf_counter()
    position, s, seed = Position(key["position"]), key["s"], key["seed"]
    L = key.get("seq_len", spec.seq_len[0])
    state = state_for(spec, position, s, seed, ctx.arch.heads)
    init = ctx.init
    if spec.pretrain is not None:
        base = state_for(spec, spec.pretrain, spec.s[0] if spec.pretrain is Position.POSLSH else 0, seed, ctx.arch.heads)
        at = f"-L{L}" if len(spec.seq_len) > 1 else ""
        init = train_stage(spec, ctx, work.shared(f"pretrain-{spec.pretrain.value}-seed{seed}{at}"), base, seed,
                           spec.pretrain_steps, ctx.init, f"pretrain {spec.pretrain.value}", L)
    label = f"{position.value}" + (f" s={s}" if s else "") + f" seed={seed}" + (f" L={L}" if len(spec.seq_len) > 1 else "")
    final = train_stage(spec, ctx, work, state, seed, spec.steps, init, label, L)
    model, loaded = load_model(final, str(ctx.device))
    ev = evaluate(model, loaded, ctx.corpus.val, L, max_tokens=spec.eval_tokens)
    m = read_log(work.path / "metrics.csv")
    tail = m.tail(max(1, len(m) // 10))
    row = {"position": position.value, "s": s, "seed": seed, "seq_len": L, "steps": spec.steps,
           "tokens": int(m.tokens.iloc[-1]), "params": int(sum(p.numel() for p in model.parameters())),
           "train_loss": float(tail.loss.mean()), "val_loss": ev.loss, "val_bpb": ev.loss / LN2,
           "val_ppl": math.exp(ev.loss), "seconds": float(m.seconds.iloc[-1]),
           "tokens_per_s": float(m.tokens.iloc[-1] / m.seconds.iloc[-1]),
           "pretrain": spec.pretrain.value if spec.pretrain else "", "init": str(ctx.init or ""),
           "checkpoint": work.relative(final), "wall_seconds": time.perf_counter() - t0,
           "step_seconds": float(m.step_seconds.median())}
    return [row], {}


EXPERIMENT = Experiment(
    name="train",
    spec=TrainSpec,
    help="""Train a byte-level Qwen3-architecture decoder under a position scheme (none, alibi, poslsh,
    fixed_block, windowed, rope).

    List values sweep: position=[none,alibi,poslsh] s=[10,20] seed=[0,1] trains every combination,
    each in its own sub-run with metrics.csv, resumable checkpoints (AutoModelForCausalLM loads
    them) and final/. pretrain=rope pretrain_steps=N fine-tunes every cell from one shared
    pretrained model; init=CHECKPOINT from an existing one.""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    plot=plot,
    report=report,
    presets=("train", "train_finetune", "train_long", "train_gpu", "train_long_gpu"),
    order=50,
    skip_reason=lambda spec: cuda_skip_reason(spec.device),
)
