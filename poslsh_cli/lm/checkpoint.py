"""What a local checkpoint directory is, read without loading a model: refused with one clear
line when it is not loadable (missing, no config, no safetensors, a file that differs from its
manifest, an unreadable header, a LoRA adapter without its base), its JSON files, the size of its
weights, whether it is an adapter and where its base is.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.trained import json_file, train_info
from poslsh_cli.core.files import MANIFEST, atomic_write_text, verify_dir
from poslsh_cli.store.readers import read_json, results
from poslsh_cli.attention.scheme import Scheme


def check_checkpoint(path: Path) -> None:
    """Refuse what is not a loadable local checkpoint, with one clear reason: missing, no config,
    no safetensors, a file that differs from the manifest poslsh wrote with it, or a safetensors
    file whose header cannot be read (named)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist")
    if is_adapter(path):
        _check_adapter(path)
        return
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a Hugging Face checkpoint directory (no config.json)")
    if not (path / MANIFEST).exists():  # with a manifest, its hashes name a changed file first
        json_file(path / "config.json")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        extra = f" (found {other[0]}; convert it to safetensors)" if other else ""
        raise ConfigError(f"{path} has no *.safetensors weights{extra}")
    if (path / MANIFEST).exists():
        why = verify_dir(path)
        if why is not None:
            raise ConfigError(f"checkpoint {path} is corrupt: {why}")
    for w in weights:
        why = unreadable_safetensors(w)
        if why:
            raise ConfigError(f"checkpoint weights {w} cannot be read ({why})")


def is_adapter(path: Path) -> bool:
    """A LoRA adapter saved beside its base (adapter_config.json, no config.json of its own)."""
    return (Path(path) / "adapter_config.json").is_file() and not (Path(path) / "config.json").is_file()


def adapter_base(path: Path) -> Path:
    import json

    base = json.loads((Path(path) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    return Path(str(base or ""))


def _check_adapter(path: Path) -> None:
    if (path / MANIFEST).exists():
        why = verify_dir(path)
        if why is not None:
            raise ConfigError(f"checkpoint {path} is corrupt: {why}")
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{path}: a LoRA adapter without adapter_model.safetensors")
    why = unreadable_safetensors(weights)
    if why:
        raise ConfigError(f"checkpoint weights {weights} cannot be read ({why})")
    base = adapter_base(path)
    if not (base / "config.json").is_file():
        raise ConfigError(f"{path}: the LoRA adapter's base model {base} is not there (it is loaded with the adapter)")
    check_checkpoint(base)


PEFT_HINT = 'pip install peft (or pip install -e ".[finetune]")'


def peft_module() -> Any:
    """peft, or one line saying how to install it."""
    try:
        import peft
    except ImportError:
        raise ConfigError(f"lora_rank= needs peft: {PEFT_HINT}") from None
    return peft


#: ``model_type`` of a checkpoint poslsh writes with a position scheme other than the architecture's
#: own: transformers does not know it, so plain ``from_pretrained`` refuses it (saying to pass
#: ``trust_remote_code=True``, which runs the two-line modeling files saved beside it) unless
#: poslsh's classes are registered (``import poslsh_cli.lm.hf``); either way it loads through
#: :func:`poslsh_cli.lm.loading.load_model`, never as the base architecture with its own attention
POSLSH_MODEL_TYPE = "poslsh"
#: where such a config.json keeps the architecture's own model_type and architectures
BASE_TYPE_KEY, BASE_ARCHS_KEY = "poslsh_base_model_type", "poslsh_base_architectures"
#: the files beside such a config.json that transformers runs with trust_remote_code=True
REMOTE_CODE = {
    "configuration_poslsh.py": '"""A poslsh checkpoint\'s configuration: needs the poslsh package (pip install poslsh)."""\n'
                               "from poslsh_cli.lm.hf import PoslshConfig  # noqa: F401\n",
    "modeling_poslsh.py": '"""A poslsh checkpoint: loaded by poslsh_cli.load_model (needs pip install poslsh)."""\n'
                          "from poslsh_cli.lm.hf import PoslshForCausalLM  # noqa: F401\n",
}


#: The share of a training stage at whose end :func:`late_fall` measures how much validation still fell.
LATE_SHARE = 0.2


def late_fall(path: Path, share: float = LATE_SHARE) -> float:
    """How far the validation bits per byte of the stage that made ``path`` fell over its last ``share``
    of steps (positive: still falling), from the cell's ``metrics.csv`` beside the checkpoint: the
    evaluation nearest ``(1 - share)`` of its steps minus the last one. NaN without the log or
    without an evaluation before the last one."""
    import math

    import pandas as pd

    log = Path(path).resolve().parent / "metrics.csv"
    if not log.is_file():
        return math.nan
    try:
        log_rows = pd.read_csv(log, usecols=["step", "val_bpb"])
    except (ValueError, OSError, pd.errors.ParserError):
        return math.nan
    m = log_rows.dropna()
    if len(m) < 2:
        return math.nan
    first, last = int(log_rows.step.min()), int(log_rows.step.max())
    start = last - share * (last - first + 1)
    at = m.iloc[int((m.step - start).abs().to_numpy().argmin())]  # the evaluation nearest the start
    if int(at.step) >= int(m.step.iloc[-1]):
        return math.nan
    return float(at.val_bpb - m.val_bpb.iloc[-1])


def read_config(path: Path) -> dict:
    """A checkpoint's config.json as a dict, as its architecture's own (:func:`base_view`); for a
    LoRA adapter, its base's, with the scheme the adapter was trained with (``poslsh`` from its
    poslsh_train.json)."""
    path = Path(path)
    if is_adapter(path):
        cfg = base_view(json_file(adapter_base(path) / "config.json"))
        info = train_info(path)
        if info.scheme is not None:
            cfg["poslsh"] = info.scheme.to_json()
        return cfg
    return base_view(json_file(path / "config.json"))


def saved_scheme(cfg: dict) -> Any:
    """The :class:`~poslsh_cli.attention.scheme.Scheme` a checkpoint's config (:func:`read_config`)
    saved under ``poslsh``, or None for a checkpoint trained without one (a model's own attention)."""
    saved = cfg.get("poslsh")
    return Scheme.from_json(saved, "config.json") if saved else None


def base_view(cfg: dict) -> dict:
    """The config of a poslsh-marked checkpoint (``model_type: poslsh``) as its architecture's own
    config.json (model_type, architectures, no auto_map); any other config unchanged."""
    if cfg.get("model_type") != POSLSH_MODEL_TYPE:
        return cfg
    d = {k: v for k, v in cfg.items() if k not in ("auto_map", BASE_TYPE_KEY, BASE_ARCHS_KEY)}
    d["model_type"] = cfg.get(BASE_TYPE_KEY)
    if cfg.get(BASE_ARCHS_KEY):
        d["architectures"] = cfg[BASE_ARCHS_KEY]
    return d


def is_marked(path: Path) -> bool:
    """A checkpoint written by poslsh with a scheme of its own (``model_type: poslsh``)."""
    return (Path(path) / "config.json").is_file() and \
        json_file(Path(path) / "config.json").get("model_type") == POSLSH_MODEL_TYPE


def hf_config(path: Path) -> Any:
    """The transformers config a marked checkpoint's weights load with (its architecture's class);
    None for any other checkpoint (transformers reads its config.json itself)."""
    if not is_marked(path):
        return None
    from transformers import CONFIG_MAPPING

    cfg = read_config(path)
    if cfg.get("model_type") not in CONFIG_MAPPING:
        raise ConfigError(f"{path}: a poslsh checkpoint of model_type {cfg.get('model_type')!r}, which this "
                          "transformers does not know")
    return CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved with a checkpoint, read offline and without ever asking to run custom code:
    a poslsh-marked checkpoint's config names its own ``auto_map``, which ``AutoTokenizer`` would
    otherwise load (and, in a terminal, stop to ask whether to trust); its architecture's config is
    given instead, and remote code is refused, never prompted for."""
    from transformers import AutoTokenizer

    extra = {"config": hf_config(path)} if is_marked(path) else {}
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False, **extra)


def mark(path: Path) -> None:
    """Make the checkpoint just saved in ``path`` one plain loading cannot mistake for its base
    architecture: ``model_type: poslsh`` (the architecture's own kept beside it), ``auto_map`` to
    the two modeling files written here (:data:`REMOTE_CODE`)."""
    import json

    path = Path(path)
    cfg = json_file(path / "config.json")
    if cfg.get("model_type") == POSLSH_MODEL_TYPE:
        return
    cfg[BASE_TYPE_KEY], cfg["model_type"] = cfg.get("model_type"), POSLSH_MODEL_TYPE
    cfg[BASE_ARCHS_KEY] = cfg.get("architectures")
    cfg["architectures"] = ["PoslshForCausalLM"]
    cfg["auto_map"] = {"AutoConfig": "configuration_poslsh.PoslshConfig",
                       "AutoModelForCausalLM": "modeling_poslsh.PoslshForCausalLM"}
    for name, text in REMOTE_CODE.items():
        atomic_write_text(path / name, text)
    atomic_write_text(path / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def safetensors_header(path: Path) -> tuple[int, dict]:
    """The header of a safetensors file: its length in bytes, and tensor name -> dtype, shape,
    data_offsets (and ``__metadata__``). Raises OSError when unreadable, ValueError (with the
    reason) when malformed or cut."""
    import json
    import struct

    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError("shorter than its 8-byte header length")
        n = struct.unpack("<Q", head)[0]
        if n > Path(path).stat().st_size - 8:
            raise ValueError("invalid header length (the file is truncated)")
        try:
            return n, json.loads(fh.read(n))
        except ValueError:
            raise ValueError("malformed header") from None


def unreadable_safetensors(path: Path) -> str | None:
    """Why a safetensors file cannot be opened (header or size wrong), or None. Reads the header
    and the file size only."""
    try:
        size = path.stat().st_size
        n, header = safetensors_header(path)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    except ValueError as exc:
        return str(exc)
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        return f"truncated: {size} bytes, its header needs {8 + n + end}"
    return None


def load_failure(path: Path, exc: BaseException, config: Any = None) -> ConfigError:
    """One line for a checkpoint transformers refused to load: for weights whose shapes do not fit
    config.json (transformers' own message points at a report it logged, which is not shown), the
    first such tensor with both shapes and how many differ; else the error's first line."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    diff = _shape_mismatches(Path(path), config) if "mismatched" in first or "size mismatch" in first else []
    if diff:
        name, file, saved, built = diff[0]
        more = f" ({len(diff)} tensors differ)" if len(diff) > 1 else ""
        shape = lambda t: "x".join(map(str, t))  # noqa: E731
        return ConfigError(f"{path}: the weights do not fit config.json: {name} is {shape(saved)} in {file}, "
                           f"{shape(built)} by the configuration{more}")
    return ConfigError(f"{path}: cannot load the checkpoint ({first})")


def _shape_mismatches(path: Path, config: Any) -> list[tuple[str, str, tuple, tuple]]:
    """(tensor, file, shape saved, shape the configuration builds) for every tensor of the
    checkpoint's safetensors whose shape differs from the model ``config`` (default: config.json)
    builds on the meta device (no memory); empty when they cannot be compared."""
    import torch
    import transformers as tf

    try:
        config = config if config is not None else tf.AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config)
        built = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        out = []
        for f in sorted(path.glob("*.safetensors")):
            for name, rec in safetensors_header(f)[1].items():
                if name != "__metadata__" and name in built and tuple(rec["shape"]) != built[name]:
                    out.append((name, f.name, tuple(rec["shape"]), built[name]))
        order = {k: i for i, k in enumerate(built)}
        return sorted(out, key=lambda d: order[d[0]])  # in the model's order: the first layer's first
    except Exception:  # a model that cannot be built on the meta device: the plain message
        return []


def weights_bytes(path: Path, dtype_bytes: int = 4) -> float:
    """Memory of a checkpoint's weights once loaded in a ``dtype_bytes`` float type, from its
    safetensors files and the dtype they are stored in (for memory estimates; 0 if unknown)."""
    import json

    if is_adapter(path):
        return weights_bytes(adapter_base(path), dtype_bytes)
    stored = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    dt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    per = 2 if ("16" in dt) else 8 if "64" in dt else 4
    return float(stored) * dtype_bytes / per


def refuse_rotary_falcon(path: Path, model_type: str | None, alibi: bool) -> None:
    """A Falcon with ``alibi=false`` is a rotary model whose attention is computed inline: refused."""
    if model_type == "falcon" and not alibi:
        raise ConfigError(f"{path}: a Falcon with alibi=false uses rotary embeddings, not ALiBi, and computes "
                          "attention inline; only ALiBi Falcons (alibi=true, e.g. Falcon-RW) are supported")


def expand_checkpoints(entry: str) -> list[tuple[Path, str]]:
    """A checkpoint directory, or a train run directory -> its cells' final checkpoints, each
    (path, name to show)."""
    p = Path(entry).expanduser().resolve()
    if not p.exists():
        raise ConfigError(f"{entry} does not exist")
    if (p / "config.json").is_file() or (p / "adapter_config.json").is_file():
        return [(p, str(p))]
    if _is_train_run(p):
        df = results(p)
        if len(df) and ("checkpoint" not in df.columns or not any((p / str(c)).exists() for c in df.checkpoint)):
            # another command's run (a perplexity run names the checkpoints it read, elsewhere)
            made_by = _command_of(p)
            raise ConfigError(f"{entry} is {'a ' + made_by if made_by else 'a'} run, not a training run: its cells "
                              "hold no checkpoints (give a training run or a checkpoint directory)")
        if not len(df):
            raise ConfigError(f"{entry}: the train run has no finished cell yet")
        return [(p / c, f"{p.name}/{c}") for c in df.checkpoint]
    if p.is_dir():
        found = sorted({q.parent for pattern in ("final/config.json", "final/adapter_config.json")
                        for q in p.rglob(pattern)})
        if found:
            return [(q, str(q.relative_to(p.parent))) for q in found]
    raise ConfigError(f"{entry}: neither a checkpoint directory (config.json, or a LoRA adapter) nor a train run")


def _command_of(run: Path) -> str:
    """The command that made a run directory, from its meta.json ("" when unreadable or unsaid)."""
    meta, _ = read_json(run / "meta.json")
    command = meta.get("command") if isinstance(meta, dict) else None
    return command if isinstance(command, str) else ""


def _is_train_run(p: Path) -> bool:
    """A run directory (its config.yaml) with cells or a results table: read as a train run."""
    return (p / "config.yaml").is_file() and ((p / "cells").is_dir() or (p / "results.csv").is_file())


def checkpoints_of(entries: Iterable[str]) -> tuple[list[tuple[Path, str]], list[str]]:
    """Every checkpoint of ``entries`` (:func:`expand_checkpoints`), and a line for each entry that was
    a folder searched for checkpoints (neither a checkpoint nor a train run): how many it held, for
    the command to print before its work starts, so a wrong folder is seen at once."""
    found, notes = [], []
    for entry in entries:
        these = expand_checkpoints(entry)
        found += these
        p = Path(entry).expanduser().resolve()
        if not ((p / "config.json").is_file() or (p / "adapter_config.json").is_file() or _is_train_run(p)):
            names = [name for _, name in these]
            notes.append(f"{entry}: {len(names)} checkpoint{'s' * (len(names) != 1)} found in the folders below "
                         "it (" + ", ".join(names[:3]) + (", ..." if len(names) > 3 else "") + ")")
    return found, notes
