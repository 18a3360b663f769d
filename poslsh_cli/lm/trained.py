"""What ``poslsh train`` records beside each checkpoint it writes (``poslsh_train.json``), typed:
the one record a training cell hands to the commands that evaluate its models; the train run a
checkpoint belongs to; and how a checkpoint's JSON files are read (one error line for a bad one).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.positions import PositionState

TRAIN_INFO = "poslsh_train.json"
#: The layout of poslsh_train.json (``schema``; a file without it is layout 1, any field possibly
#: missing). Layouts 1 and 2 also held the scheme (``scheme``, and its ``position`` and ``s`` again);
#: from layout 3 a checkpoint saves its scheme once, in its config.json (``poslsh``), and the record
#: holds it only for a LoRA adapter saved alone (no config.json of its own). :meth:`TrainInfo.of` reads
#: every layout.
TRAIN_INFO_SCHEMA = 3


@dataclass(frozen=True)
class TrainInfo:
    """What ``poslsh train`` records beside a checkpoint (``poslsh_train.json``), the one record a
    training cell hands to the commands that evaluate it (perplexity, eval, passkey, generate): the
    scheme (``scheme``, a :class:`~poslsh_cli.attention.scheme.Scheme`: read from where the checkpoint
    saved it, :func:`train_info`), the stage's seed, length and steps, the data and its split, attention dropout, the checkpoint it started from
    (``init``: fine-tuned), LoRA, the trainable parameters and the processes. ``recorded`` is False for
    a checkpoint poslsh did not train (every field its default)."""

    seed: int = -1
    seq_len: int = 0
    steps: int = 0
    data: Optional[str] = None
    data_sha256: Optional[str] = None
    val_fraction: float = 0.1
    val_every: int = 10
    data_field: str = "text"
    encoding: str = "utf-8"
    attn_dropout: float = 0.0
    init: Optional[str] = None
    tokenizer: Optional[str] = None
    lora_rank: int = 0
    scheme: Any = field(default=None, compare=False)  # compared by its JSON (its bandwidths are an array)
    trainable: int = -1
    world_size: int = 1
    step: Optional[int] = None
    adapter_of: Optional[str] = None
    #: the layout the record was read from (written: always :data:`TRAIN_INFO_SCHEMA`)
    schema: int = TRAIN_INFO_SCHEMA
    recorded: bool = field(default=True, compare=False)

    @classmethod
    def of(cls, saved: dict, where: object = "poslsh_train.json", scheme: Any = None) -> "TrainInfo":
        """The record a poslsh_train.json of any layout holds, with ``scheme``, the checkpoint's own
        (its config.json's, :func:`train_info`), else the one the record holds (an adapter; layouts 1
        and 2, as a dict or, oldest, only its ``position`` and ``s``): a field it lacks (layout 1) takes
        its default, the value every reader assumed of such a file, as does a null; every value is held
        to its field's type (a count written as 256.0 reads as 256); a layout newer than this version
        knows, or a value of the wrong kind, is one error line naming ``where``. An empty record is
        one poslsh did not write (``recorded`` False)."""
        schema = saved.get("schema", 1)
        if not isinstance(schema, int) or schema > TRAIN_INFO_SCHEMA:
            raise ConfigError(f"{where} has layout {schema!r}, newer than this poslsh reads ({TRAIN_INFO_SCHEMA}): "
                              "upgrade poslsh")
        kept = {"schema": schema, "scheme": scheme if scheme is not None else _saved_scheme(saved, where)}
        for f in fields(cls):
            value = saved.get(f.name)
            if f.name in ("recorded", "schema", "scheme") or value is None:
                continue
            kind = _KINDS.get(f.name, str)
            try:
                kept[f.name] = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: {f.name}={value!r} is not of type {kind.__name__}") from None
            if kind is int and isinstance(value, float) and not value.is_integer():
                raise ConfigError(f"{where}: {f.name}={value!r} is not a whole number")
        return cls(**kept, recorded=bool(saved))

    def to_json(self, scheme: Optional[bool] = None) -> dict:
        """What poslsh_train.json holds, in this version's layout (every field but ``recorded``; ``step``
        and ``adapter_of`` where set); the scheme only where the checkpoint has no config.json to save
        it in (an adapter saved alone, ``adapter_of``) or when ``scheme`` asks for it (a tracker's record)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("recorded", "scheme")}
        d["schema"] = TRAIN_INFO_SCHEMA
        if (self.adapter_of is not None if scheme is None else scheme) and self.scheme is not None:
            d["scheme"] = self.scheme.to_json()
        return {k: v for k, v in d.items() if not (k in ("step", "adapter_of") and v is None)}

    @property
    def position(self) -> str:
        """The scheme's name (``""`` when not recorded)."""
        return self.scheme.position.value if self.scheme is not None else ""

    @property
    def s(self) -> int:
        """Masks per head the scheme draws (0: none, or not recorded)."""
        return self.scheme.s if self.scheme is not None else 0

    @property
    def sigmas(self) -> Optional[list]:
        """The bandwidths the scheme was trained with (None when not recorded)."""
        return [float(x) for x in self.scheme.sigmas] if self.scheme is not None and len(self.scheme.sigmas) else None


#: The type of each saved field of :class:`TrainInfo` (the rest: text), from its annotations
_KINDS = {f.name: {"int": int, "float": float, "Optional[int]": int}[f.type] for f in fields(TrainInfo)
          if f.type in ("int", "float", "Optional[int]")}


def _saved_scheme(saved: dict, where: object) -> Any:
    """The scheme a record holds: layout 2 and an adapter's ``scheme``, layout 1's ``position`` and ``s``
    alone (no bandwidths), else None."""
    d = saved.get("scheme")
    if d is not None and not isinstance(d, dict):
        raise ConfigError(f"{where}: scheme={d!r} is not of type dict")
    if d is None and saved.get("position"):
        d = {"position": saved["position"], "s": saved.get("s") or 0, "sigmas": []}
    return PositionState.from_json(d, where) if d else None


def train_info(path: Path) -> TrainInfo:
    """What ``poslsh train`` recorded beside a checkpoint (:class:`TrainInfo`); ``recorded=False``
    for a checkpoint it did not train."""
    path = Path(path)
    f = path / TRAIN_INFO
    if not f.is_file():
        return TrainInfo(recorded=False)
    cfg = path / "config.json"
    saved = json_file(cfg).get("poslsh") if cfg.is_file() else None  # the scheme's one copy
    return TrainInfo.of(json_file(f), f, scheme=PositionState.from_json(saved, cfg) if saved else None)


def training_run(path: Path) -> str:
    """The ``poslsh train`` run a checkpoint belongs to, as its run directory's name (``train_official``;
    ``train_official/0`` for the one job of a multirun), or ``""`` for a checkpoint outside a run. Models
    of one run share every optimiser setting, so comparisons between trained schemes stay inside one run."""
    p = Path(path).resolve()
    for up in p.parents:
        if (up / "config.yaml").is_file() and (up / "work").is_dir():
            return f"{up.parent.name}/{up.name}" if up.name.isdigit() else up.name
    return ""


def json_file(path: Path) -> Any:
    """A checkpoint's JSON file (a JSON object), or one error line naming it: missing, not UTF-8, not
    JSON, not an object."""
    import json

    try:
        value = json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror or type(exc).__name__})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text (a checkpoint's JSON file)") from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value
