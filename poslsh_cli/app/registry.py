"""The experiment registry: every package of :mod:`poslsh_cli.experiments` whose ``command``
module exports ``EXPERIMENT`` is a command. The CLI, Hydra's schemas, ``plot``, ``report`` and
``reproduce`` all read this registry; adding a command is one package, one YAML in ``conf/`` and
its tests.
"""
from __future__ import annotations

import enum
import importlib
import importlib.util
import pkgutil
from functools import lru_cache
from pathlib import Path

from typing import Any

from poslsh_cli.lm import models
from poslsh_cli.core.config import CONF_DIR, build_spec, compose, register_schemas
from poslsh_cli.core.errors import ConfigError
from poslsh_cli.experiments.base import Experiment
from poslsh_cli.store.readers import load_run
import poslsh_cli.experiments as pkg

class Scale(str, enum.Enum):
    """The two sizes of every preset (``<stem>_quick.yaml``, ``<stem>_paper.yaml``)."""

    QUICK = "quick"
    PAPER = "paper"


SCALES = tuple(s.value for s in Scale)


@lru_cache(maxsize=1)
def experiments() -> dict[str, Experiment]:
    """Every registered experiment by command name, in report order."""
    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        name = f"{pkg.__name__}.{info.name}"
        # a command's package: its command module holds the EXPERIMENT (the shared modules hold none)
        if not info.ispkg or importlib.util.find_spec(f"{name}.command") is None:
            continue
        module = importlib.import_module(f"{name}.command")
        exp = getattr(module, "EXPERIMENT", None)
        if isinstance(exp, Experiment):
            found.append(exp)
    found.sort(key=lambda e: (e.order, e.name))
    names = [e.name for e in found]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise RuntimeError(f"two experiment modules claim the command {sorted(dup)[0]!r}")
    return {e.name: e for e in found}


def get(name: str) -> Experiment:
    try:
        return experiments()[name]
    except KeyError:
        raise ConfigError(f"no experiment command {name!r}") from None


def preset_names(exp: Experiment) -> list[str]:
    """The preset files of ``exp`` that exist, as ``experiment=`` values."""
    return [f"{stem}_{scale}" for stem in exp.presets for scale in SCALES
            if (CONF_DIR / "experiment" / f"{stem}_{scale}.yaml").exists()]


def owner_of_preset(name: str) -> Experiment:
    """The experiment a preset (``<stem>_<scale>``) belongs to."""
    stem = name.rsplit("_", 1)[0]
    owners = [e for e in experiments().values() if stem in e.presets]
    if len(owners) != 1:
        raise ConfigError(f"preset {name!r} belongs to {len(owners)} experiments")
    return owners[0]


def register_all_schemas() -> None:
    """Every command's schema (and the model group's) in Hydra's ConfigStore."""
    register_schemas({e.config_name: e.spec for e in experiments().values()}, {"model": models.ModelSpec})


def compose_config(exp: Experiment, overrides: list[str]) -> Any:
    """``conf/<command>.yaml`` composed with ``overrides`` (Hydra checks key names)."""
    import dataclasses

    register_all_schemas()
    _refuse_anothers_preset(exp, overrides)
    return compose(exp.config_name, overrides, known=[f.name for f in dataclasses.fields(exp.spec)],
                   presets=preset_names(exp))


def _refuse_anothers_preset(exp: Experiment, overrides: list[str]) -> None:
    """``experiment=NAME`` naming another command's preset: one line saying whose it is (Hydra's own
    message for it ends at a colon)."""
    for o in overrides:
        key, _, name = o.partition("=")
        if key.lstrip("+~") != "experiment" or name in preset_names(exp):
            continue
        if (CONF_DIR / "experiment" / f"{name}.yaml").exists():
            try:
                owner = owner_of_preset(name).name
            except ConfigError:
                continue
            raise ConfigError(f"experiment={name} is a preset of poslsh {owner}, not of poslsh {exp.name} (poslsh "
                              f"{owner} experiment={name}; this command's presets: {', '.join(preset_names(exp))})")


def compose_spec(exp: Experiment, overrides: list[str]) -> Any:
    """The validated, frozen spec of ``exp`` for ``overrides``: composition, then the one validation."""
    return build_spec(exp.spec, compose_config(exp, overrides))


def experiment_of(run: Path) -> tuple[Experiment, dict, dict]:
    """(experiment, config, meta) of a run directory. The command comes from meta.json, or, when
    that file is empty or unreadable, from the keys of config.yaml (each command's spec has its own)."""
    from dataclasses import fields

    cfg, meta = load_run(run)
    command = meta.get("command")
    if command in experiments():
        return experiments()[command], cfg, meta
    keys = set(cfg)
    matches = [e for e in experiments().values() if {f.name for f in fields(e.spec)} == keys]
    if len(matches) != 1:
        raise ConfigError(f"{run}: cannot tell which command made this run (meta.json "
                          f"{'names ' + repr(command) if command else 'is unreadable'})")
    return matches[0], cfg, meta
