"""What an experiment command is: one :class:`Experiment` exported by one module of
:mod:`poslsh_cli.experiments` (the registry, :mod:`poslsh_cli.app.registry`, finds it), plus the
helpers experiments share: the memory check and the estimates of language-model runs, cell grids
and seeds, choice enums, and the checkpoints a preset evaluates. Devices and dtypes are
:mod:`poslsh_cli.experiments.devices`, what the machine offers :mod:`poslsh_cli.experiments.machine`.

An experiment is pure functions from a validated spec to result rows:

    prepare(spec) -> ctx                 optional: shared state (a loaded model, captured q/k/v);
                                         may refuse input with ConfigError before anything is written
    cells(spec, ctx) -> [key, ...]       the grid, one dict per cell, in a fixed order
    run_cell(spec, key, ctx, work) -> (rows, aux)
                                         one cell's rows (results.csv) and auxiliary tables;
                                         ``work`` is the cell's own directory (CellWork) for long
                                         cells that keep metrics logs and checkpoints
    summary(df) -> (header, rows)        the end-of-run console table
    plot(run_dir, df) -> [paths]         figures into run_dir/figures/
    report(run_dir, df) -> Section       claims, verdicts, tables for ``poslsh report``

The runner (:mod:`poslsh_cli.app.runner`) owns the run directory: results.csv, cells/, meta.json and
the auxiliary tables are written by it alone. Two writes happen inside the first four, each in a
place the runner hands out or a cache of its own: ``run_cell`` of a training cell writes its
metrics log and checkpoints into ``work`` (and a shared stage's into ``work.shared``), and
``prepare`` of a command that tokenises with a Hugging Face tokenizer fills the token cache
(:func:`poslsh_cli.lm.data.cache_dir`, written whole or not at all). No printing in any of them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any, Callable, Optional

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.devices import cuda_skip_reason, resolve_device
from poslsh_cli.experiments.machine import available_memory
from poslsh_cli.lm.checkpoint import expand_checkpoints, read_config, saved_scheme, weights_bytes
from poslsh_cli.attention import Backend, Method, Plan, choose
from poslsh_cli.attention.plan import union_band_bound
from poslsh_cli.attention.scheme import Position, SWAP_S, method_of
from poslsh_cli.numerics.sampling import derive_seed


@dataclass(frozen=True)
class Experiment:
    name: str  # the command, e.g. "matrix-error"; its defaults are conf/<name with _>.yaml
    spec: type  # frozen dataclass of typed keys (a config.Spec)
    help: str  # --help text: a first line, then paragraphs separated by blank lines
    columns: tuple[str, ...]  # results.csv column order (more columns may follow)
    cells: Callable[[Any, Any], list[dict[str, Any]]]
    run_cell: Callable[[Any, dict[str, Any], Any, Any], tuple[list[dict], dict]]
    summary: Optional[Callable[[Any], tuple[list[str], list[list[str]]]]] = None
    prepare: Optional[Callable[[Any], Any]] = None
    plot: Optional[Callable[[Path, Any], list[Path]]] = None
    report: Optional[Callable[[Path, Any], Any]] = None
    #: one section over every run of this command in a report (each run's directory and table), or
    #: None: what no single run's section can decide (a registered analysis that reads several runs)
    across_runs: Optional[Callable[[list[tuple[Path, Any]]], Any]] = None
    #: preset stems in conf/experiment/ (each as <stem>_quick.yaml and <stem>_paper.yaml), in the
    #: order `poslsh reproduce` runs them
    presets: tuple[str, ...] = ()
    #: presets `poslsh reproduce` runs only when named with ``--with`` (the long-context CPU runs:
    #: left out of the default so ``make reproduce-all`` keeps its time budget)
    opt_in: tuple[str, ...] = ()
    #: position in `reproduce` and in reports
    order: int = 100
    #: Hydra config groups the command composes (e.g. model)
    groups: tuple[str, ...] = ()
    #: why the experiment cannot run here for this spec (reproduce skips it and says so), or None
    skip_reason: Optional[Callable[[Any], Optional[str]]] = None
    #: a list-valued key that plain (non KEY=VALUE) arguments fill: ``poslsh perplexity RUN...``
    positional: Optional[str] = None
    #: extra overrides `poslsh reproduce` adds for a preset, given the scale's root directory and
    #: the preset's spec (e.g. the train runs a perplexity preset evaluates)
    reproduce_overrides: Optional[Callable[[Path, Any], list[str]]] = None
    #: estimated peak memory of the largest cell from the spec alone, in bytes, with what it is
    #: for (checked before anything runs; ``memory_check=false`` skips the check)
    memory: Optional[Callable[[Any], Optional["MemoryNeed"]]] = None
    #: runs under torchrun / a multi-task SLURM job (data-parallel; rank 0 writes, see
    #: :mod:`poslsh_cli.core.distributed`); the others refuse to
    distributed: bool = False
    #: files besides the tables that the report reads from a run (relative to it, e.g. each training
    #: cell's metrics.csv): ``poslsh report --publish`` copies them into the snapshot
    snapshot_files: Optional[Callable[[Path, Any], list[Path]]] = None
    #: the one migration of the rows this command wrote in older layouts (a results.csv read back, a
    #: run resumed by a newer poslsh): each column a later version added, with the value a row without
    #: it meant, where it is missing or empty. ``summary``, ``plot``, ``report`` and ``across_runs``
    #: receive migrated rows (wrapped once, here), so no reader repairs an older layout itself
    migrate: Optional[Callable[[Any], Any]] = None

    def __post_init__(self) -> None:
        if self.migrate is None:
            return
        for name in ("summary", "plot", "report", "across_runs"):
            f = getattr(self, name)
            if f is not None:
                object.__setattr__(self, name, _migrating(f, self.migrate, name))

    @property
    def config_name(self) -> str:
        return self.name.replace("-", "_")


def _migrating(f: Callable[..., Any], migrate: Callable[[Any], Any], name: str) -> Callable[..., Any]:
    """``f`` (an experiment's ``name`` function) on migrated rows (:attr:`Experiment.migrate`)."""
    import functools

    if name == "summary":
        return functools.wraps(f)(lambda df: f(migrate(df)))
    if name == "across_runs":
        return functools.wraps(f)(lambda runs: f([(run, migrate(df)) for run, df in runs]))
    return functools.wraps(f)(lambda run, df: f(run, migrate(df)))


@dataclass(frozen=True)
class MemoryNeed:
    """An estimate of a run's peak memory: ``bytes`` on ``device`` (cpu or cuda), for ``what``."""

    bytes: float
    what: str
    device: str = "cpu"


def format_bytes(x: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return f"{x / 2**10:.3g} KiB"


def check_memory(exp: Experiment, spec: Any) -> None:
    """Refuse a run whose estimated peak memory (:attr:`Experiment.memory`) exceeds what is
    available, with one line; ``memory_check=false`` runs it anyway."""
    if exp.memory is None or not getattr(spec, "memory_check", True):
        return
    need = exp.memory(spec)
    if need is None:  # nothing to estimate from yet (prepare says what is missing)
        return
    device = need.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    have = available_memory(device)
    if need.bytes > have:
        where = "this GPU has" if device.startswith("cuda") else "this machine has"
        raise ConfigError(f"needs about {format_bytes(need.bytes)} of memory ({need.what}); {where} "
                          f"{format_bytes(have)} available (memory_check=false runs it anyway)")


# ---------------------------------------------------------------------------------------------
# memory of language-model runs (the estimates of train, step-bench, decode-bench, passkey, eval)


@dataclass(frozen=True)
class LMShape:
    """The sizes of a decoder its memory depends on."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def of_config(cls, cfg: dict) -> "LMShape":
        """From a checkpoint's config.json (Llama / Qwen / Mistral names, GPT-2, BLOOM, MPT and
        Falcon aliases)."""
        def get(*names: str, default: int) -> int:
            return next((int(cfg[k]) for k in names if isinstance(cfg.get(k), (int, float)) and cfg[k]), default)

        hidden = get("hidden_size", "d_model", "n_embd", default=64)
        heads = get("num_attention_heads", "n_head", "n_heads", default=1)
        return cls(vocab=get("vocab_size", default=256), hidden=hidden,
                   layers=get("num_hidden_layers", "n_layer", "n_layers", default=1), heads=heads,
                   kv_heads=get("num_key_value_heads", default=heads),
                   head_dim=get("head_dim", default=max(1, hidden // heads)),
                   intermediate=get("intermediate_size", "ffn_hidden_size", default=4 * hidden))

    @property
    def params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.vocab * self.hidden + self.layers * (attn + 3 * self.hidden * self.intermediate)


def attention_plan(position: Any, device: Any, n: int, grad: bool) -> Any:
    """The attention plan a model under ``position`` (a :class:`poslsh_cli.attention.scheme.Position`, or
    its value) takes at length n, causal, in float32 (RoPE: SDPA without bias); its
    :meth:`~poslsh_cli.attention.plan.Plan.memory_bytes` is what a layer of it holds."""
    import torch

    position = Position(getattr(position, "value", position))
    if position is Position.ROPE:
        return Plan(Method.NO_BIAS, Backend.SDPA)
    return choose(method_of(position), device=torch.device(device), dtype=torch.float32, n=n, causal=True, grad=grad)


def attention_bytes(position: Any, device: Any, n: int, batch: int, heads: int, head_dim: int, s: int,
                    training: bool = False) -> float:
    """Bytes one attention layer holds under ``position`` at length n, in a forward pass without
    gradients or (``training``) in a training step, where the band of each layer stays held for its
    backward (:meth:`~poslsh_cli.attention.plan.Plan.memory_bytes`): where the plan weighs the blocks
    against the union by the masks drawn (CPU, past the dense bias), the larger of the two, the
    union's band at most UNION_MAX_BYTES."""
    plan = attention_plan(position, device, n, grad=training)
    own = plan.memory_bytes(batch, heads, n, head_dim, s, training=training)
    if plan.backend not in (Backend.BLOCKS, Backend.UNION) or str(getattr(device, "type", device)).startswith("cuda"):
        return own
    blocks = Plan(plan.method, Backend.BLOCKS).memory_bytes(batch, heads, n, head_dim, s, training=training)
    outputs = Plan(plan.method, Backend.SDPA).memory_bytes(batch, heads, n, head_dim, s, training=training)
    return max(own, blocks, outputs + union_band_bound(heads, n, s, capped=True))


def lm_bytes(shape: LMShape, batch: int, n: int, attention: float, training: bool, trainable: Optional[int] = None,
             weights: Optional[float] = None, shards: int = 1, recompute: bool = False, elem: float = 4.0) -> float:
    """Peak bytes of a training step (forward, backward, AdamW) or of a forward pass without
    gradients, ``batch`` sequences of length ``n``: the weights (``weights`` bytes, default float32),
    with, in training, the gradients and AdamW's two moments of the ``trainable`` parameters
    (default all; over ``shards`` processes when sharded); the activations (``elem`` bytes each):
    in training about 12 hidden and 4 intermediate values a token in every layer, kept for the
    backward pass (only each layer's input with ``recompute``, and one layer whole), without
    gradients 4 hidden and 2 intermediate values of one layer at a time; the logits over the
    vocabulary (three copies in training, two without); ``attention`` bytes a layer
    (:meth:`~poslsh_cli.attention.plan.Plan.memory_bytes`). Calibrated on step-bench's measured peaks: an estimate to refuse
    what cannot fit, not a prediction."""
    tokens = float(batch) * n
    w = 4.0 * shape.params if weights is None else weights
    if not training:
        layer = elem * tokens * (4 * shape.hidden + 2 * shape.intermediate) + attention
        return w + layer + 2 * 4.0 * tokens * shape.vocab
    state = (w + 12.0 * (shape.params if trainable is None else trainable)) / shards
    layer = elem * tokens * (12 * shape.hidden + 4 * shape.intermediate) + attention
    kept = shape.layers * elem * tokens * shape.hidden + layer if recompute else shape.layers * layer
    return state + kept + 3 * 4.0 * tokens * shape.vocab


def checkpoint_forward_bytes(path: Path, batch: int, n: int, device: Any, attention: str = "own", s: int = 0) -> float:
    """Peak bytes of a forward pass without gradients of the checkpoint at ``path`` (its weights as
    stored, its sizes from config.json) at ``batch`` sequences of length ``n``, under its own
    scheme or ``attention`` swapped in with ``s`` masks (:func:`lm_bytes`)."""
    cfg = read_config(path)
    scheme = saved_scheme(cfg)
    position = (scheme.position.value if scheme else "rope") if attention == "own" else attention
    saved = scheme.s if scheme else 0
    shape = LMShape.of_config(cfg)
    att = attention_bytes(position, device, n, batch, shape.heads, shape.head_dim, s or saved or SWAP_S)
    return lm_bytes(shape, batch, n, att, training=False, weights=weights_bytes(path))


def largest_checkpoint_need(spec: Any, each: Callable[[Path, str, Any], Any]) -> MemoryNeed | None:
    """The largest of the (bytes, what) pairs ``each(path, name, device)`` gives for every checkpoint
    of ``spec.checkpoints`` (directories expanded) on ``spec.device``; None while a checkpoint cannot
    be read (the command's prepare says why)."""
    need = None
    try:
        device = resolve_device(spec.device)
        for entry in spec.checkpoints:
            for path, name in expand_checkpoints(entry):
                for b, what in each(path, name, device):
                    if need is None or b > need.bytes:
                        need = MemoryNeed(b, what, spec.device)
    except (ConfigError, OSError, ValueError):
        return None
    return need


def grid_cells(spec: Any) -> list[dict[str, Any]]:
    """The (n, sigma, s, trial) grid of the matrix experiments, in a fixed order; with a ``sampler``
    key, every point once per sampler (the same seed: a sampler changes how the seed is used)."""
    samplers = [getattr(x, "value", x) for x in getattr(spec, "sampler", ())]
    grid = [{"n": n, "sigma": sigma, "s": s, "trial": t}
            for n, sigma, s, t in product(spec.n, spec.sigma, spec.s, range(spec.trials))]
    return [{**k, "sampler": sm} for sm in samplers for k in grid] if samplers else grid


def cell_seed(root_seed: int, command: str, key: dict[str, Any]) -> int:
    """A cell's seed from the root seed, the command and the cell's (n, sigma, s, trial) key: the
    ``seed`` column that ``poslsh sample ... seed=<seed>`` replays."""
    return derive_seed(root_seed, command, key["n"], float(key["sigma"]), key["s"], key["trial"])


def choices(name: str, members: Any, module: str, **extra: str) -> Any:
    """A ``str`` enum of a command's choices (``extra`` first, then ``members``, members of another
    enum), so a command's key lists a subset of a shared enum rather than a copy of its values."""
    return enum.Enum(name, {**extra, **{m.name: m.value for m in members}}, type=str, module=module)


def trained_runs_overrides(root: Path, checkpoints: tuple[str, ...]) -> list[str]:
    """``reproduce``'s override for a preset that evaluates trained models: the names it lists
    relative to the reproduce root (``checkpoints: [train, train_finetune]``) become the run
    directories there that hold trained checkpoints (a run, or the one job of a multirun when
    reproduce used a launcher); runs that trained nothing are left out
    (:func:`checkpoints_skip_reason` says so when none is left)."""
    def trained(p: Path) -> Optional[Path]:
        for cand in (p, p / "0"):
            if any(cand.glob("work/*/final/config.json")) or any(cand.glob("work/*/final/adapter_config.json")):
                return cand
        return None

    runs = [r for r in (trained(Path(root) / c) for c in checkpoints if not Path(c).is_absolute()) if r]
    runs += [Path(c) for c in checkpoints if Path(c).is_absolute()]
    return ["checkpoints=[" + ",".join(f"'{p}'" for p in runs) + "]"]


def checkpoints_skip_reason(checkpoints: tuple[str, ...], device: str) -> Optional[str]:
    """Why a preset that evaluates trained models cannot run: no CUDA for a CUDA device, or no
    trained checkpoints (the training presets did not run)."""
    why = cuda_skip_reason(device)
    if why:
        return why
    if not checkpoints:
        return "nothing to evaluate: no trained checkpoints (the training presets did not run)"
    for c in checkpoints:
        if not Path(c).exists():
            return f"nothing to evaluate: no train run at {c}"
    return None
