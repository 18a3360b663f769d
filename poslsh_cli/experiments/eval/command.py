"""``poslsh eval CKPT... tasks=[...]``: lm-evaluation-harness tasks on checkpoints, each under its
own position scheme or others swapped in (:class:`~poslsh_cli.lm.harness.PoslshLM`, lm-eval's
``HFLM`` around the model poslsh loads).

Cells are (checkpoint, attention, draw): one lm-eval run over every task of ``tasks``. A
Positional-LSH scheme is evaluated under ``trials`` mask draws (each its own seed, replayed by
``seed``); the other schemes are deterministic and run once. ``include_path`` adds a directory of
task YAML files (a local task needs no download). Rows: one per (task, metric) with lm-eval's own
standard error and the number of documents scored.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from poslsh_cli.attention.scheme import Position, SWAP_S, model_label, scheme_key, sigma_label
from poslsh_cli.core.config import Spec, check, key

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.base import (Experiment, MemoryNeed, checkpoint_forward_bytes, checkpoints_skip_reason,
                                         largest_checkpoint_need, trained_runs_overrides)
from poslsh_cli.experiments.devices import Device, resolve_device
from poslsh_cli.lm import heldout_task
from poslsh_cli.lm.checkpoint import check_checkpoint, checkpoints_of, read_config, saved_scheme
from poslsh_cli.numerics.sampling import Sampler, derive_seed
from poslsh_cli.verdicts.claims import Section, Status, Verdict
from poslsh_cli.verdicts.declared import Claim
from poslsh_cli.verdicts.stats import MARGIN_FRACTION, MIN_SEEDS, equivalence, paired, relative_margin, t_interval
from poslsh_cli.lm.trained import train_info, training_run

COLUMNS = ("checkpoint", "attention", "position", "s", "sampler", "draw", "seed", "task", "metric", "filter", "value",
           "stderr", "documents", "num_fewshot", "run_seed", "sigmas", "attn_dropout", "finetuned", "trained_run",
           "trained_len", "trained_steps")
ATTENTIONS = ("own", "alibi", "poslsh", "windowed", "fixed_block", "none", "rope")
INSTALL = "lm-eval is not installed: pip install 'poslsh[eval]' (or make install)"


@dataclass(frozen=True)
class TasksSpec(Spec):
    checkpoints: tuple[str, ...] = key("train run directories or checkpoint directories (or give them as plain "
                                       "arguments: poslsh eval CKPT...)", [], empty=True)
    tasks: tuple[str, ...] = key("lm-eval task (or group) names; poslsh_heldout: continuations of the held-out "
                                 "documents the checkpoints were trained beside (no download)", [], empty=True,
                                 noun="task")
    include_path: Optional[str] = key("a directory of lm-eval task YAML files (local tasks)", None)
    attention: tuple[str, ...] = key("own (the checkpoint's scheme) or schemes swapped in: alibi, poslsh, windowed, "
                                     "fixed_block, none (rope: RoPE checkpoints only)", ["own"], noun="attention")
    s: int = scheme_key("s", 0, f"0: the checkpoint's own, else {SWAP_S}", ge=0)
    sampler: Optional[Sampler] = scheme_key("sampler", None, "null: the checkpoint's own")
    trials: int = key("mask draws per Positional-LSH cell (other schemes are deterministic: one)", 1, ge=1)
    num_fewshot: Optional[int] = key("few-shot examples (null: each task's default)", None, ge=0)
    limit: Optional[int] = key("documents per task (null: all)", None, ge=1)
    batch_size: int = key("sequences per forward pass", 8, ge=1)
    max_length: Optional[int] = key("longest input in tokens (null: the model's max_position_embeddings)", None, ge=2)
    device: Device = key("auto (CUDA when present), cpu, cuda, cuda:N", Device("auto"))

    def check(self) -> None:
        for a in self.attention:
            check(a in ATTENTIONS, f"unknown attention {a!r} (one of {', '.join(ATTENTIONS)})")
        if self.include_path is not None:
            check(Path(self.include_path).is_dir(), f"include_path={self.include_path}: not a directory")


@dataclass
class TasksContext:
    checkpoints: dict[str, tuple[Path, str]]  # name -> (path, its own position)
    device: Any
    manager: Any  # lm-eval's TaskManager
    trained: dict[str, dict] = field(default_factory=dict)  # name -> run_seed, sigmas, finetuned (poslsh's own runs)
    notes: list = field(default_factory=list)  # lines printed before the cells (folders searched)


def _lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise ConfigError(INSTALL) from None
    return lm_eval


def prepare(spec: TasksSpec) -> TasksContext:
    _lm_eval()
    from lm_eval.tasks import TaskManager

    check(len(spec.tasks) > 0, "give the tasks to run: 'tasks=[name,...]' (lm-eval names, or local ones with "
                               "include_path=DIR)")
    check(len(spec.checkpoints) > 0, "give at least one train run or checkpoint (poslsh eval CKPT...)")
    cks, trained = {}, {}
    found, notes = checkpoints_of(spec.checkpoints)
    for path, name in found:
        check_checkpoint(path)
        scheme = saved_scheme(read_config(path))
        cks[name] = (path, scheme.position.value if scheme else "rope")
        trained[name] = _trained_columns(path, cks[name][1])
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    include = [spec.include_path] if spec.include_path else []
    if heldout_task.TASK in spec.tasks:
        include.append(str(_heldout_folder([p for p, _ in cks.values()])))
    manager, unknown = None, list(spec.tasks)
    if include:  # local tasks alone first: indexing lm-eval's own thousands of tasks takes a while
        manager = TaskManager(include_path=include, include_defaults=False)
        unknown = [t for t in spec.tasks if t not in set(manager.all_tasks)]
    if unknown:
        manager = TaskManager(include_path=include) if include else TaskManager()
        unknown = [t for t in spec.tasks if t not in set(manager.all_tasks)]
    if unknown:
        where = f" (nor in {spec.include_path})" if spec.include_path else " (a local task: include_path=DIR)"
        raise ConfigError(f"unknown task {unknown[0]!r}: not an lm-eval task{where}")
    for task in spec.tasks:
        _check_data(task, manager)
    return TasksContext(cks, resolve_device(spec.device), manager, trained, notes)


def _trained_columns(path: Path, position: str) -> dict:
    """What the rows say of how a checkpoint was trained: its training seed (-1: not poslsh's), its
    bandwidths (as perplexity labels them), whether it was fine-tuned, the train run it belongs to, its
    training length and steps (models are compared inside one run, length and number of steps)."""
    info = train_info(path)
    sigmas = ("" if position in (Position.ROPE.value, Position.NONE.value)
              else sigma_label(info.sigmas))
    return {"run_seed": info.seed, "sigmas": sigmas, "attn_dropout": float(info.attn_dropout),
            "finetuned": "yes" if info.init else "no", "trained_run": training_run(path),
            "trained_len": info.seq_len, "trained_steps": info.steps}


def _heldout_folder(paths: list[Path]) -> Path:
    """The ``poslsh_heldout`` task of the corpus every checkpoint was trained on (as each one's
    ``poslsh_train.json`` records it; a checkpoint poslsh did not train: the builtin corpus)."""
    corpora = set()
    for path in paths:
        info = train_info(path)
        corpora.add((info.data or "builtin", info.val_every, info.data_field, info.encoding))
    if len(corpora) != 1:
        raise ConfigError(f"{heldout_task.TASK} scores every checkpoint on one corpus's held-out documents, and "
                          f"these were trained on {len(corpora)}: {', '.join(sorted(c[0] for c in corpora))} "
                          "(evaluate them separately)")
    data, val_every, field, encoding = corpora.pop()
    return heldout_task.build(data, val_every, field, encoding)


def _check_data(task: str, manager: Any) -> None:
    """The task's documents load (lm-eval reads most tasks' datasets from the Hugging Face hub, or
    its cache), or one line saying why, before the run directory exists."""
    from poslsh_cli.lm.documents import HUB_HINT, HUB_UNREACHABLE, hub_failure, quiet_hub

    try:
        with quiet_hub():
            manager.load([task])  # builds the task, which reads its documents
    except Exception as exc:
        why = hub_failure(exc)
        raise ConfigError(f"task {task!r}: cannot load its documents ({why})"
                          + (f"; lm-eval reads them from the hub: {HUB_HINT}" if why == HUB_UNREACHABLE else "")) from None


#: The input length lm-eval's HFLM assumes for a model that states none; with ``max_length=null``
#: the documents decide the length, unknown before they are read: estimated at this.
DEFAULT_LENGTH = 2048


def memory(spec: TasksSpec) -> MemoryNeed | None:
    """Peak bytes of a batch of ``batch_size`` inputs of ``max_length`` tokens (null: at most the
    model's positions and :data:`DEFAULT_LENGTH`) through the largest checkpoint, under each
    scheme asked for (:func:`~poslsh_cli.experiments.base.checkpoint_forward_bytes`); None while a
    checkpoint cannot be read (prepare says why)."""
    def each(path: Path, name: str, device: Any) -> Any:
        n = spec.max_length or min(DEFAULT_LENGTH, int(read_config(path).get("max_position_embeddings")
                                                       or DEFAULT_LENGTH))
        for a in spec.attention:
            yield (checkpoint_forward_bytes(path, spec.batch_size, n, device, a, spec.s),
                   f"{name} ({a}), {spec.batch_size} inputs of {n} tokens")

    return largest_checkpoint_need(spec, each)


def _scheme_of(own: str, attention: str) -> str:
    return own if attention == "own" else attention


def cells(spec: TasksSpec, ctx: TasksContext | None = None) -> list[dict[str, Any]]:
    if ctx is None:
        return []
    return [{"checkpoint": name, "attention": a, "draw": d} for name, (_, own) in ctx.checkpoints.items()
            for a in spec.attention
            for d in range(spec.trials if _scheme_of(own, a) == "poslsh" else 1)]


def run_cell(spec: TasksSpec, key: dict[str, Any], ctx: TasksContext, work: Any = None) -> tuple[list[dict], dict]:
    import lm_eval

    from poslsh_cli.lm.documents import quiet_hub
    from poslsh_cli.lm.harness import PoslshLM

    name, attention, draw = key["checkpoint"], key["attention"], int(key["draw"])
    path, own = ctx.checkpoints[name]
    poslsh = _scheme_of(own, attention) == "poslsh"
    seed = derive_seed(spec.seed, "eval", name, attention, draw) if poslsh else None
    quiet = logging.getLogger("lm_eval")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # HFLM notes that a loaded model ignores its loading arguments
    try:
        lm = PoslshLM(pretrained=str(path), attention=attention, s=spec.s, seed=seed, device=str(ctx.device),
                      batch_size=spec.batch_size, max_length=spec.max_length,
                      sampler=None if spec.sampler is None else spec.sampler.value)
    finally:
        quiet.setLevel(level)
    state = lm.poslsh_state
    # the documents are cached by prepare (a hub that went away since says nothing); lm-eval's own
    # progress bars (one per task and per request type) would flood the run's lines
    with quiet_hub(), quiet_progress():
        out = lm_eval.simple_evaluate(model=lm, tasks=list(spec.tasks), num_fewshot=spec.num_fewshot, limit=spec.limit,
                                      task_manager=ctx.manager, log_samples=False, bootstrap_iters=1000,
                                      random_seed=spec.seed, numpy_random_seed=spec.seed, torch_random_seed=spec.seed,
                                      fewshot_random_seed=spec.seed, verbosity="WARNING")
    rows = []
    for task, metrics in out["results"].items():
        shots = out.get("n-shot", {}).get(task)
        docs = out.get("n-samples", {}).get(task, {}).get("effective")
        for full, value in metrics.items():
            if "," not in full or "_stderr," in full or not isinstance(value, (int, float)):
                continue
            metric, _, filt = full.partition(",")
            se = metrics.get(f"{metric}_stderr,{filt}")
            rows.append({"checkpoint": name, "attention": attention, "position": state.position.value,
                         "s": int(state.s), "sampler": state.sampler, "draw": draw,
                         "seed": -1 if seed is None else seed,
                         "task": task, "metric": metric, "filter": filt, "value": float(value),
                         "stderr": float(se) if isinstance(se, (int, float)) else float("nan"),
                         "documents": -1 if docs is None else int(docs),
                         "num_fewshot": -1 if shots is None else int(shots),
                         **ctx.trained.get(name, dict(TRAINED_DEFAULTS))})
    if not rows:
        raise ConfigError(f"lm-eval returned no metrics for tasks {list(spec.tasks)}")
    return rows, {}


#: the training columns of a checkpoint poslsh did not train (and of runs written before a column existed)
TRAINED_DEFAULTS = {"run_seed": -1, "sigmas": "", "attn_dropout": 0.0, "finetuned": "no", "trained_run": "",
                    "trained_len": 0, "trained_steps": 0}
#: what tells trained models apart besides the scheme and the training seed: comparisons stay inside one
#: train run (its optimiser settings), training length and number of steps
MODEL_GROUP = ["trained_run", "finetuned", "trained_len", "trained_steps", "sigmas"]


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """lm-eval's tqdm bars off for the block (its task and model modules' ``tqdm``)."""
    import functools
    import importlib

    from tqdm import tqdm

    mods = [importlib.import_module(m) for m in ("lm_eval.api.task", "lm_eval.models.huggingface")]
    saved = [getattr(m, "tqdm", None) for m in mods]
    for m in mods:
        m.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        for m, t in zip(mods, saved):
            if t is not None:
                m.tqdm = t


def migrate(df: Any) -> Any:
    """The one migration of ``poslsh eval``'s rows (:attr:`~poslsh_cli.experiments.base.Experiment.migrate`):
    the training columns (runs written before they existed: :data:`TRAINED_DEFAULTS`, one unknown seed each)."""
    out = df.copy()
    for c, v in TRAINED_DEFAULTS.items():
        if c not in out.columns:
            out[c] = v
        elif c != "run_seed":  # a text column read back all empty is float NaN: text again before filling
            out[c] = (out[c].astype(object) if isinstance(v, str) else out[c]).fillna(v)
    return out


def _scheme(df: Any) -> Any:
    return [model_label(r.position, r.s, r.attn_dropout, r.sigmas) for r in df.itertuples()]


def summary(df: Any) -> tuple[list[str], list[list[str]]]:
    d = df
    d = d.assign(scheme=_scheme(d))
    head = ["checkpoint", "scheme", "task", "metric", "value", "stderr", "draws", "documents"]
    rows = []
    for (ck, scheme, task, metric), g in d.groupby(["checkpoint", "scheme", "task", "metric"], sort=False):
        v = g.value
        value = f"{v.mean():.4f}" if len(g) == 1 else f"{v.mean():.4f} ({v.min():.4f}..{v.max():.4f})"
        se = g.stderr.mean()
        rows.append([ck, scheme, task, metric, value, f"{se:.4f}" if se == se else "n/a", str(len(g)),
                     str(int(g.documents.iloc[0]))])
    return head, rows


def per_seed(d: Any) -> Any:
    """Each trained model's value (mean over its mask draws) per (model group, scheme, training seed)."""
    return d.groupby([*MODEL_GROUP, "scheme", "task", "metric", "run_seed"], sort=False).value.mean()


def interval_table(df: Any) -> Any:
    """Per trained scheme, task and metric under its own attention: the mean over training seeds
    (each the mean over its mask draws) with its 95% t-interval, and what it rests on."""
    import pandas as pd

    d = df[df.attention == "own"]
    d = d.assign(scheme=_scheme(d))
    rows = []
    for (run, tuned, L, steps, sigmas, scheme, task, metric), g in d.groupby([*MODEL_GROUP, "scheme", "task", "metric"],
                                                                        sort=False):
        iv = t_interval(g.groupby("run_seed").value.mean().values)
        rows.append({"run": run, "fine-tuned": tuned, "L": L, "steps": steps, "scheme": scheme, "task": task,
                     "metric": metric,
                     "mean": f"{iv.estimate:.4f}",
                     "95% interval": f"[{iv.low:.4f}, {iv.high:.4f}]" if iv.finite else "-",
                     "seeds": iv.n, "mask draws": int(g.groupby("run_seed").draw.nunique().max()),
                     "documents": int(g.documents.max())})
    return pd.DataFrame(rows)


ACCURACY_RULE = ("non-inferiority, paired by training seed inside one train run, training length and number of steps: "
                 "the difference of error rates (100 minus the accuracy in %, Positional LSH minus exact ALiBi); "
                 "margin = {fraction:.0%} of exact ALiBi's error rate (the one margin of every language-model metric); "
                 "the 90% t-interval ends below +margin: SUPPORTED, starts at or above it: NOT SUPPORTED, otherwise "
                 "INCONCLUSIVE").format(fraction=MARGIN_FRACTION)
REACHES_ALIBI = Claim("eval/reaches_alibi", "eval", "{member} reaches exact ALiBi's accuracy on {task}", ACCURACY_RULE,
                      metric="error rate (100 - accuracy %)", sides=({"position": "alibi"}, {"position": "poslsh", "s": "*"}),
                      family=True)


def claim_reaches_alibi(df: Any) -> list[Verdict]:
    """Positional LSH (each trained s, per model group) reaches exact ALiBi's accuracy on each task:
    the non-inferiority rule on the error rate in percentage points, paired by training seed, with the
    relative margin (:data:`~poslsh_cli.verdicts.stats.MARGIN_FRACTION` of exact ALiBi's error rate)."""
    d = df[(df.attention == "own") & (df.metric == "acc")]
    d = d[(d.finetuned == "no") & (d.attn_dropout == 0)]
    many = d.trained_run.nunique() > 1
    lengths = d.groupby("trained_run").trained_steps.nunique()
    out = []
    for (run, _, L, steps, sigmas, task), g in d.groupby([*MODEL_GROUP, "task"], sort=False):
        ref = 100 - g[g.position == "alibi"].groupby("run_seed").value.mean() * 100  # error rate, %
        for s_, h in g[g.position == "poslsh"].groupby("s"):
            pos = 100 - h.groupby("run_seed").value.mean() * 100
            iv = paired(dict(pos), dict(ref), level=0.90)  # Positional LSH minus ALiBi: smaller is better
            label = model_label("poslsh", s_, 0.0, sigmas)
            where = ", ".join(t for t in (run if many else "", f"L={L}" if L else "", f"{steps} steps" if steps else "") if t)
            tag = ", ".join(t for t in (run if many and run else "",
                                        f"{steps} steps" if lengths.get(run, 1) > 1 else "") if t)
            names = dict(key=f"eval/reaches_alibi[{label}, {task}{', ' + tag if tag else ''}]", group=task, task=task,
                         member=label, tag=f"[{tag}]" if tag else "")
            if not len(ref) or iv.n < MIN_SEEDS:
                out.append(REACHES_ALIBI.verdict(Status.INCONCLUSIVE,
                                                 f"{iv.n} training seed(s) with both schemes, fewer than {MIN_SEEDS}",
                                                 **names))
                continue
            margin = relative_margin(float(ref.mean()))
            status, why = equivalence(iv, margin)
            why = why.replace(str(margin), f"{margin:.2f}")
            draws = int(h.groupby("run_seed").draw.nunique().max())
            out.append(REACHES_ALIBI.verdict(
                status, f"{where}: error rate of Positional LSH minus exact ALiBi's {iv.text(2)} points (exact ALiBi "
                f"{float(ref.mean()):.2f}%, margin {margin:.2f}: {why}); {iv.n} training seeds, {draws} mask draws "
                f"each, {int(h.documents.max())} questions",
                {"unit": "% error", "margin": margin, "boundary": margin, "diff": iv.record()}, **names))
    return out


def report(run: Path, df: Any) -> Section:
    sec = Section("eval", run, "lm-evaluation-harness tasks")
    own = df[df.attention == "own"]
    if len(own) and (own.run_seed >= 0).any():
        sec.verdicts += claim_reaches_alibi(df)
        sec.tables.append(interval_table(df))
        sec.paragraphs.append("Each trained scheme under its own attention: the mean over training seeds, each seed "
                              "the mean over its Positional-LSH mask draws, with a 95% t-interval over seeds "
                              "(the interval covers training seeds and mask draws). poslsh_heldout: multiple-choice "
                              "continuations of held-out documents, chance 0.25.")
    sec.add_table(*summary(df))
    draws = int(df.groupby(["checkpoint", "attention"]).draw.nunique().max())
    sec.paragraphs.append(f"lm-eval's metrics and standard errors (over documents) on {df.task.nunique()} task(s), "
                          f"per checkpoint; Positional-LSH rows are the mean over {draws} mask draw(s) (range in "
                          "brackets), the other schemes are deterministic.")
    return sec


def reproduce_overrides(root: Path, spec: TasksSpec) -> list[str]:
    return trained_runs_overrides(root, spec.checkpoints)


def skip_reason(spec: TasksSpec) -> Optional[str]:
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        return INSTALL
    return checkpoints_skip_reason(spec.checkpoints, spec.device)


EXPERIMENT = Experiment(
    name="eval",
    spec=TasksSpec,
    help="""lm-evaluation-harness tasks on checkpoints under their own scheme or others swapped in
    (lm-eval's HFLM around the model poslsh loads; model name poslsh for lm-eval itself).

    Local tasks: include_path=DIR of task YAML files. Positional-LSH cells run trials mask draws.""",
    columns=COLUMNS,
    cells=cells,
    run_cell=run_cell,
    summary=summary,
    prepare=prepare,
    report=report,
    migrate=migrate,
    positional="checkpoints",
    presets=("eval",),
    skip_reason=skip_reason,
    reproduce_overrides=reproduce_overrides,
    order=76,
    memory=memory,
)
