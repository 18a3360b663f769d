"""A poslsh checkpoint as transformers sees it: ``model_type: poslsh`` (see
:data:`poslsh_cli.lm.checkpoint.POSLSH_MODEL_TYPE`), its config class and a model class whose
``from_pretrained`` is :func:`poslsh_cli.lm.loading.load_model`, so every way of loading it gives
the same function:

    poslsh_cli.load_model(path)                                   the documented loader
    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
                                                                  the checkpoint's modeling files
                                                                  (two lines importing this module)
    import poslsh_cli.lm.hf; AutoModelForCausalLM.from_pretrained(path)
                                                                  registered on import
    AutoModelForCausalLM.from_pretrained(path)                    refused by transformers (custom
                                                                  code: trust_remote_code=True)

The model returned is the checkpoint's own architecture (e.g. ``Qwen3ForCausalLM``) with its
position scheme installed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from poslsh_cli.lm.checkpoint import POSLSH_MODEL_TYPE
from poslsh_cli.lm.loading import load_model


class PoslshConfig(PretrainedConfig):
    """The config.json of a poslsh checkpoint: the architecture's own fields, its model_type kept
    under ``poslsh_base_model_type``, the scheme under ``poslsh``."""

    model_type = POSLSH_MODEL_TYPE


class PoslshForCausalLM(PreTrainedModel):
    """Loads a poslsh checkpoint through :func:`poslsh_cli.lm.loading.load_model`; the instance
    returned is the architecture's own causal LM with the scheme installed."""

    config_class = PoslshConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        model, _ = load_model(Path(pretrained_model_name_or_path))
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        if isinstance(dtype, torch.dtype):
            model = model.to(dtype)
        device = kwargs.get("device_map")
        if isinstance(device, (str, torch.device)) and str(device) not in ("auto", "cpu"):
            model = model.to(device)
        return model


def register() -> None:
    """Let plain ``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained`` load poslsh checkpoints
    in this process (run on import of this module)."""
    AutoConfig.register(POSLSH_MODEL_TYPE, PoslshConfig, exist_ok=True)
    AutoModelForCausalLM.register(PoslshConfig, PoslshForCausalLM, exist_ok=True)


register()
