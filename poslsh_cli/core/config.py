"""Configuration: typed, frozen specs; Hydra composition; the one validation.

Flow: argv -> Hydra overrides composed over ``conf/<command>.yaml`` (Hydra checks key *names*
against a permissive schema derived from the spec) -> :func:`build_spec`, the one place values
are checked and converted -> a frozen dataclass with concrete types (tuples of ints, bools,
enums), which is all experiment code ever sees.

A spec is a frozen dataclass whose fields are declared with :func:`key` (help text and
constraints). Types understood by :func:`build_spec`: ``int``, ``float``, ``bool``, ``str``,
``enum.Enum`` subclasses (given by value), ``Optional[X]``, ``tuple[X, ...]`` (a scalar or a
list; never empty), ``Literal[...]`` values, unions of those (first match wins) and nested
specs, and types with a ``coerce(value, name)`` classmethod (a string with its own format, such as
a device). Cross-field rules go into the spec's ``check()``.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Optional, Union

from poslsh_cli.core.errors import ConfigError  # noqa: F401  (raised by build_spec and check)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


#: the help of an ``encoding`` key (the commands that read text files)
ENCODING_HELP = ("the encoding of the text files read (a Python codec: utf-8, latin-1, cp1252, ...); a file not in "
                 "it is refused, naming the first byte that is not")


def check_encoding(name: str) -> None:
    """Refuse, in one ConfigError, an ``encoding=`` that is no text encoding Python knows."""
    import codecs

    try:
        info = codecs.lookup(name)
    except LookupError:
        info = None
    if info is None or not getattr(info, "_is_text_encoding", True):
        raise ConfigError(f"encoding={name!r}: not a text encoding Python knows (utf-8, latin-1, cp1252, ...)")


def key(help: str, default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
        noun: str | None = None, empty: bool = False) -> Any:
    """A spec field: ``help`` for ``--help``; ``ge``/``gt`` bound every number it holds; ``noun``
    names one element in messages about tuple-valued choices ("unknown baseline 'x'"); ``empty``
    lets a tuple-valued key be an empty list."""
    meta = {"help": help, "ge": ge, "gt": gt, "noun": noun, "empty": empty}
    if isinstance(default, (list, dict)):
        frozen = tuple(default) if isinstance(default, list) else default
        return field(default=frozen, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Spec:
    """Keys every command has."""

    seed: int = key("root seed; every cell's seed derives from it and its parameters", 0, ge=0)
    out: Optional[str] = key("run directory (default runs/<command>/<timestamp>); an existing one is resumed", None)
    memory_check: bool = key("refuse a run whose estimated peak memory exceeds what this machine has available "
                             "(false: run it anyway)", True)

    def check(self) -> None:
        """Rules between keys (override); raise ConfigError."""


# ---------------------------------------------------------------------------------------------
# the one validation: raw values (from Hydra) -> a typed, frozen spec


def build_spec(spec_cls: type, raw: Mapping[str, Any], prefix: str = "") -> Any:
    """Check and convert ``raw`` (a composed config, ``hydra`` removed) into ``spec_cls``;
    ``prefix`` names a nested group in messages (``model.``)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(raw):
        raw = OmegaConf.to_container(raw, resolve=True)
    raw = {k: v for k, v in dict(raw).items() if k != "hydra"}
    hints = typing.get_type_hints(spec_cls)
    known = {f.name for f in fields(spec_cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(unknown_key(unknown[0], known) if not prefix else
                          unknown_key(prefix + unknown[0], (prefix + k for k in known)))
    values = {}
    for f in fields(spec_cls):
        if f.name not in raw:
            continue
        values[f.name] = _coerce(raw[f.name], hints[f.name], prefix + f.name, f.metadata)
    spec = spec_cls(**values)
    spec.check()
    return spec


def _coerce(value: Any, tp: Any, name: str, meta: Mapping[str, Any]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        members = [m for m in typing.get_args(tp) if m is not type(None)]
        if value is None and type(None) in typing.get_args(tp):
            return None
        errors = []
        for m in members:
            try:
                return _coerce(value, m, name, meta)
            except ConfigError as exc:
                errors.append((m, str(exc)))
        # the member of the value's own kind knows best what is wrong with it (layers=[-1])
        own = [msg for m, msg in errors if _same_kind(value, m)]
        if len(members) == 1:  # Optional[X]: X's own message
            raise ConfigError(errors[0][1])
        if len(own) == 1 and not isinstance(value, str):
            raise ConfigError(own[0])
        raise ConfigError(f"{name} must be {_choices([a for m in members for a in _atoms(m)])}, got {value!r}")
    if origin is tuple:
        (item,) = [a for a in typing.get_args(tp) if a is not Ellipsis]
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if not items and not meta.get("empty"):
            raise ConfigError(f"{name} must not be empty")
        return tuple(_coerce(v, item, name, {**meta, "_element": True}) for v in items)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        raise ConfigError(f"{name} must be {_choices(allowed)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name} must be a group of keys, got {value!r}")
        return build_spec(tp, value, prefix=f"{name}.")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for m in tp:
            if value == m.value or value is m:
                return m
        allowed = [m.value for m in tp]
        if meta.get("_element") and meta.get("noun"):
            raise ConfigError(f"unknown {meta['noun']} {value!r} (choose from {', '.join(map(str, allowed))})")
        raise ConfigError(f"{name} must be {_choices(allowed)}, got {value!r}")
    if isinstance(tp, type) and hasattr(tp, "coerce"):  # a validated string type (experiment.Device)
        return tp.coerce(value, name)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return _bounded(int(value), name, meta)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        x = float(value)
        if not math.isfinite(x):
            raise ConfigError(f"{name} must be finite, got {value!r}")
        return _bounded(x, name, meta)
    if tp is str:
        if isinstance(value, (list, dict)) or value is None:
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return str(value)
    if tp is Any:
        return value
    raise TypeError(f"spec field {name}: unsupported type {tp!r}")  # a programming error


def _bounded(x: float, name: str, meta: Mapping[str, Any]) -> Any:
    ge, gt = meta.get("ge"), meta.get("gt")
    if ge is not None and not x >= ge:
        raise ConfigError(f"{name} must be >= {ge:g}, got {x:g}")
    if gt is not None and not x > gt:
        raise ConfigError(f"{name} must be > {gt:g}, got {x:g}")
    return x


def _choices(allowed: tuple | list) -> str:
    a = [str(x).lower() if isinstance(x, bool) else str(x) for x in allowed]
    return a[0] if len(a) == 1 else ", ".join(a[:-1]) + " or " + a[-1]


def _describe(tp: Any) -> str:
    """How a value of type ``tp`` is written, for messages."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _choices(typing.get_args(tp))
    if origin is tuple:
        item = [a for a in typing.get_args(tp) if a is not Ellipsis][0]
        return {int: "a list of integers", float: "a list of numbers"}.get(item, "a list")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _choices([m.value for m in tp])
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _atoms(tp: Any) -> list[str]:
    """The spellings a member of a union accepts, for one flat "a, b or c" message."""
    if typing.get_origin(tp) is Literal:
        return [str(a) for a in typing.get_args(tp)]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return [str(m.value) for m in tp]
    if tp is bool:
        return ["true", "false"]
    return [_describe(tp)]


def _same_kind(value: Any, tp: Any) -> bool:
    if typing.get_origin(tp) is tuple:
        return isinstance(value, (list, tuple))
    if tp is bool:
        return isinstance(value, bool)
    if tp in (int, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


# ---------------------------------------------------------------------------------------------
# Hydra: a permissive schema (key names only) and composition


def hydra_schema(spec_cls: type) -> type:
    """A dataclass with the spec's keys, every value typed ``Any`` (nested specs stay nested):
    Hydra refuses unknown keys; every value check belongs to :func:`build_spec`."""
    hints = typing.get_type_hints(spec_cls)
    cols = []
    for f in fields(spec_cls):
        tp = hints[f.name]
        nested = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if nested:
            sub = hydra_schema(nested[0])
            cols.append((f.name, Any, field(default_factory=sub)))
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
            default = list(default) if isinstance(default, tuple) else default
            default = default.value if isinstance(default, enum.Enum) else default
            if isinstance(default, list):  # members written as a user types them (alibi, not ALIBI)
                default = [x.value if isinstance(x, enum.Enum) else x for x in default]
            default = str(default) if isinstance(default, str) else default  # a str subclass (Device)
            if isinstance(default, list):
                cols.append((f.name, Any, field(default_factory=lambda d=default: list(d))))
            else:
                cols.append((f.name, Any, field(default=default)))
    return dataclasses.make_dataclass(f"{spec_cls.__name__}Schema", cols)


def schema_name(config_name: str) -> str:
    return f"_schema_{config_name}"


def register_schemas(specs: Mapping[str, type], groups: Mapping[str, type] | None = None) -> None:
    """Store one schema per command's YAML (``config name -> spec class``) in Hydra's ConfigStore,
    and a schema for each config group (``group -> spec class``, e.g. ``model``)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, spec in specs.items():
        cs.store(name=schema_name(name), node=hydra_schema(spec))
    for group, spec in (groups or {}).items():
        cs.store(group=group, name=f"_schema_{group}", node=hydra_schema(spec))


def compose(config_name: str, overrides: list[str], known: Iterable[str] = (), presets: Iterable[str] = ()) -> Any:
    """Compose ``conf/<config_name>.yaml`` with overrides (schemas registered first); ``known``:
    the command's keys, listed when an override names another; ``presets``: its presets, listed
    when ``experiment=`` names another."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_module("poslsh_cli.conf", version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(hydra_message(exc, known, presets)) from None


def hydra_message(exc: BaseException, known: Iterable[str] = (), presets: Iterable[str] = ()) -> str:
    """One line from a Hydra/OmegaConf error: unknown keys (with the ``known`` ones) and groups said
    plainly."""
    cause = exc.__cause__ or exc
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    full_key = getattr(cause, "full_key", None)
    group = re.search(r"Could not override '([^']*)'\. No match in the defaults list", text)
    if "not in struct" in text or "Key '" in text and "not in" in text or group:
        return unknown_key(group.group(1) if group else full_key or text, known)
    missing = re.search(r"Could not find 'experiment/([^']*)'", text)
    if missing:
        names = sorted(presets)
        return (f"unknown preset experiment={missing.group(1)}" + (f" (this command's presets: {', '.join(names)})"
                                                                  if names else " (this command has no presets)"))
    if text.startswith("Could not find") or "In 'hydra/config'" in text or "Could not load" in text:
        detail = str(cause).strip().splitlines()
        options = [line.strip() for line in detail if line.startswith("\t")]
        return text.replace("In 'hydra/config': ", "") + (f" (available: {', '.join(options)})" if options else "")
    return f"bad value: {text}"


def unknown_key(name: str, known: Iterable[str]) -> str:
    """The one message for a key the command does not have: the closest known key, then all of them."""
    import difflib

    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return (f"unknown key {name!r}" + (f" (did you mean {close[0]}?)" if close else "")
            + (f"; known keys: {', '.join(known)}" if known else ""))


def override_text(value: Any) -> str:
    """A default written the way it is typed as an override: null, true, [a,b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_text(v) for v in value) + "]"
    return str(value)


def key_help(spec_cls: type, defaults: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(key, default as written in conf/, help) for every key, common keys last."""
    common = ("seed", "out", "memory_check")
    own = [f for f in fields(spec_cls) if f.name not in common]
    rest = [f for f in fields(spec_cls) if f.name in common]
    out = []
    for f in own + rest:
        value = defaults.get(f.name, f.default)
        if isinstance(value, Mapping):  # a config group (model): its name
            value = value.get("name", value)
        out.append((f.name, override_text(value), f.metadata.get("help", "")))
    return out
