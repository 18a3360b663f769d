"""What ``poslsh train`` is asked for and what its cells share: the spec (:class:`TrainSpec`, every
key of ``conf/train.yaml``) with its enums, and the context ``prepare`` builds once per run
(:class:`TrainContext`: the corpus, the model source, the device). The command
(:mod:`poslsh_cli.experiments.train.command`) and its training loop (:mod:`poslsh_cli.experiments.train.stage`)
both read them."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from poslsh_cli.core.config import ENCODING_HELP, Spec, check, check_encoding, key
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.devices import Device, Precision
from poslsh_cli.attention.scheme import Position, randomized, scheme_key
from poslsh_cli.lm.loading import arch_key
from poslsh_cli.numerics.sampling import Sampler, Slopes
from poslsh_cli.store.tracking import Logger

if TYPE_CHECKING:
    import torch

    from poslsh_cli.lm.convert import Source
    from poslsh_cli.lm.data import Corpus


class Parallel(str, enum.Enum):
    """How several processes share the model: replicated (DDP) or sharded (FSDP, ``fully_shard``)."""

    DDP = "ddp"
    FSDP = "fsdp"


class LoraSave(str, enum.Enum):
    MERGED = "merged"
    ADAPTER = "adapter"


@dataclass(frozen=True)
class TrainSpec(Spec):
    seed: tuple[int, ...] = key("seeds (list sweeps): each trains its own model; seeds appended to a run's list "
                                "add their models to it (same out=)", [0], ge=0)
    position: tuple[Position, ...] = scheme_key("position", [Position.ALIBI, Position.POSLSH], "list sweeps")
    s: tuple[int, ...] = scheme_key("s", [10], "drawn afresh each step (list sweeps; poslsh only)")
    all_seeds: Optional[tuple[str, ...]] = key("schemes trained with every seed of the list: a position (alibi: "
                                               "every s, its attention-dropout control too), poslsh:S for one s, "
                                               "alibi+dropout for the control alone; the others train the first "
                                               "first_seeds seeds only (null: every scheme every seed)", None,
                                               noun="scheme")
    first_seeds: int = key("the seeds every scheme trains, from the start of the list (with all_seeds); the seeds "
                           "past them train only the schemes of all_seeds, as the sized comparisons ask",
                           1, ge=1)
    sampler: Sampler = scheme_key("sampler", Sampler.IID)
    window_sigmas: float = scheme_key("window_sigmas", 4.0)
    attn_dropout: tuple[float, ...] = key("attention dropout (list sweeps): a value above 0 trains the schemes in "
                                          "dropout_positions again with it (the regulariser control)", [0.0], ge=0)
    dropout_positions: tuple[Position, ...] = key("schemes trained with each attn_dropout above 0 (those whose "
                                                  "training path applies dropout: none, alibi, rope)",
                                                  [Position.ALIBI], noun="position")
    data: str = key("builtin (the Python 3.11 documentation, 11.0 MB, shipped), pydoc-topics, a text file, a folder "
                    "of them, a JSON-lines file, a folder from datasets.save_to_disk, or hf:NAME[:CONFIG]", "builtin")
    data_field: str = key("the text field of JSON-lines and dataset records", "text")
    encoding: str = key(ENCODING_HELP, "utf-8")
    val_every: int = key("every k-th document is held out for validation (fewer than k documents: the last "
                         "val_fraction of the text)", 10, ge=2)
    val_fraction: float = key("the held-out part of a corpus with fewer than val_every documents", 0.1, gt=0)
    seq_len: tuple[int, ...] = key("training lengths L in tokens (bytes for the byte model; list sweeps: each trains "
                                   "its own model)", [256], ge=2)
    batch: int = key("sequences per step (the global batch, over every process and micro-batch)", 16, ge=1)
    accumulate: int = key("micro-batches per step per process (gradient accumulation)", 1, ge=1)
    steps: tuple[int, ...] = key("optimizer steps (list sweeps: each length trains its own models, each with its own "
                                 "schedule)", [1000], ge=1)
    lr: float = key("peak learning rate (AdamW; linear warm-up, cosine decay to 10%)", 2e-3, gt=0)
    warmup: int = key("warm-up steps (unless warmup_fraction)", 100, ge=0)
    warmup_fraction: Optional[float] = key("warm-up as a fraction of each stage's steps (the paper's 10%: 0.1); "
                                           "null: warmup steps", None, ge=0)
    weight_decay: float = key("AdamW weight decay", 0.1, ge=0)
    grad_clip: float = key("gradient norm clip (0: none)", 1.0, ge=0)
    precision: Precision = key("fp32, bf16 or fp16 (autocast; fp16 with loss scaling, CUDA only)", Precision.FP32)
    gradient_checkpointing: bool = key("recompute each layer's activations in the backward pass", False)
    parallel: Parallel = key("with several processes: ddp (replicated) or fsdp (sharded, fully_shard)", Parallel.DDP)
    hidden: int = arch_key("hidden", 128)
    layers: int = arch_key("layers", 4)
    heads: int = arch_key("heads", 8)
    kv_heads: int = arch_key("kv_heads", 8)
    head_dim: int = arch_key("head_dim", 16)
    intermediate: int = arch_key("intermediate", 384)
    eval_every: int = key("evaluate on the validation text every this many steps (at least five times per stage, "
                          "and at its last step; 0: five times)", 100, ge=0)
    eval_tokens: int = key("validation tokens per evaluation (non-overlapping windows of L)", 32768, ge=2)
    checkpoint_every: int = key("save a resumable checkpoint every this many steps", 200, ge=1)
    init: Optional[str] = key("a checkpoint to start from: a causal LM directory with its tokenizer (Llama, Mistral, "
                              "Qwen2/3, BLOOM, MPT, Falcon-RW), a model preset, or a byte-level checkpoint", None)
    arch: Optional[str] = key("train from scratch at a checkpoint's sizes and with its tokenizer (its config.json; "
                              "a directory or model preset); the byte-model size keys are then unused", None)
    sigma: Optional[float] = scheme_key("sigma", None, "one for every head and layer, every scheme of the run "
                                        "(the paper's code: 256, i.e. L/32 at L=8192); null: one per head from the "
                                        "ALiBi slopes (alibi=)")
    alibi: Slopes = scheme_key("alibi", Slopes.AUTO, "every scheme of the run; the ALiBi checkpoints init= "
                                                         "converts: BLOOM, MPT, Falcon-RW")
    lora_rank: int = key("LoRA adapters of this rank on lora_targets, the rest frozen (0: full fine-tuning; needs "
                         "init= and peft)", 0, ge=0)
    lora_alpha: float = key("LoRA scale numerator (0: twice the rank)", 0.0, ge=0)
    lora_dropout: float = key("dropout on the LoRA adapters' input (the paper's fine-tune: 0.05)", 0.0, ge=0)
    lora_targets: Optional[tuple[str, ...]] = key("module names that get adapters (null: the attention "
                                                  "projections)", None)
    lora_save: LoraSave = key("final LoRA model: merged (full weights) or adapter (beside its base)", LoraSave.MERGED)
    pretrain: Optional[Position] = key("train this scheme first (pretrain_steps), then each cell from it", None)
    pretrain_steps: int = key("steps of the shared pretraining stage", 0, ge=0)
    device: Device = key("auto (CUDA when present), cpu, cuda, cuda:N (each process takes cuda:LOCAL_RANK)",
                         Device("auto"))
    logger: Logger = key("also log each step to none, tensorboard (<cell>/tensorboard/) or wandb (<cell>/wandb/; "
                         "WANDB_MODE=offline to log without a network); metrics.csv is written either way",
                         Logger.NONE)
    logger_project: str = key("the W&B project of logger=wandb", "poslsh")

    def check(self) -> None:
        check_encoding(self.encoding)
        for entry in self.all_seeds or ():
            seed_scope(entry, self)
        check(self.val_fraction < 1, f"val_fraction must be < 1, got {self.val_fraction}")
        check(all(d < 1 for d in self.attn_dropout), "attn_dropout must be < 1")
        check(self.warmup_fraction is None or self.warmup_fraction < 1, "warmup_fraction must be < 1")
        if any(d > 0 for d in self.attn_dropout):
            bad = [p.value for p in self.dropout_positions if p not in DROPOUT_SCHEMES]
            check(not bad, f"attention dropout is applied only by none, alibi and rope, not {', '.join(bad)}")
        check(self.heads % self.kv_heads == 0, f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.pretrain is not None:
            check(self.pretrain_steps >= 1, "pretrain= needs pretrain_steps >= 1")
        check(self.lora_rank == 0 or self.init is not None, "lora_rank= fine-tunes pretrained weights: give init=")
        check(self.sigma is None or self.alibi is not Slopes.MODEL, "sigma= sets the bandwidths and alibi=model keeps "
                                                                     "the checkpoint's own: give one")
        check(self.lora_rank == 0 or self.parallel is Parallel.DDP, "LoRA runs with parallel=ddp (the adapters are "
                                                                   "small; the frozen base is replicated)")


#: Schemes whose training path applies attention dropout (PyTorch SDPA's dropout_p).
DROPOUT_SCHEMES = (Position.NONE, Position.ALIBI, Position.ROPE)


def seed_scope(entry: str, spec: TrainSpec) -> tuple[Position, Optional[int], bool]:
    """One entry of ``all_seeds`` read against the run's keys: (position, its s or None for every s,
    whether it names the attention-dropout control alone) -- ``alibi`` (with its control), ``poslsh:100``,
    ``alibi+dropout``."""
    text = str(entry).strip()
    dropout = text.endswith("+dropout")
    name, _, s_text = text.removesuffix("+dropout").partition(":")
    try:
        position = Position(name)
    except ValueError:
        raise ConfigError(f"all_seeds: unknown scheme '{entry}' (a position, poslsh:S or alibi+dropout)") from None
    check(position in spec.position, f"all_seeds: {position.value} is not among the run's positions")
    s = None
    if s_text:
        check(randomized(position), f"all_seeds: '{entry}': {position.value} draws no masks, so it has no s")
        check(s_text.isdigit() and int(s_text) in spec.s,
              f"all_seeds: '{entry}' names an s the run does not train (s={list(spec.s)})")
        s = int(s_text)
    check(not dropout or (position in spec.dropout_positions and any(d > 0 for d in spec.attn_dropout)),
          f"all_seeds: '{entry}' names an attention-dropout control the run does not train")
    return position, s, dropout


def trains_every_seed(spec: TrainSpec) -> Callable[[Position, int, float], bool]:
    """Whether a model (position, s, attention dropout) trains every seed of the list (all_seeds null,
    or an entry names it), or only the first ``first_seeds``; the entries read once."""
    if spec.all_seeds is None:
        return lambda position, s, dropout: True
    scopes = [seed_scope(entry, spec) for entry in spec.all_seeds]
    return lambda position, s, dropout: any(p is position and (es is None or es == s) and (dropout > 0 or not d)
                                            for p, es, d in scopes)


@dataclass
class TrainContext:
    """What every cell of a run shares, built once by ``prepare``: the corpus (its splits as token
    arrays), the model the stages start from, this process's device and the number of processes."""

    corpus: Corpus
    source: Source
    device: torch.device
    meta: dict = field(default_factory=dict)
    world: int = 1
    #: the cells this session will train (the runner sets it once it knows which are done), and whether
    #: the cost of the run was said (after the first steps of the first of them: :func:`stage.say_cost`)
    todo: int = 0
    cost_said: bool = False


@dataclass(frozen=True)
class TrainCell:
    """One cell of a run, read once from its key (:func:`poslsh_cli.experiments.train.command.cells`): the
    scheme, its masks per head per step ``s`` (0 for schemes that draw none), the seed, the training
    length, the attention dropout and the optimizer steps (the key holds the last three only when a
    run varies them)."""

    position: Position
    s: int
    seed: int
    seq_len: int
    attn_dropout: float = 0.0
    steps: int = 0

    @classmethod
    def of(cls, key: dict, spec: TrainSpec) -> "TrainCell":
        return cls(Position(key["position"]), key["s"], key["seed"], key.get("seq_len", spec.seq_len[0]),
                   float(key.get("attn_dropout", 0.0)), int(key.get("steps", spec.steps[0])))
