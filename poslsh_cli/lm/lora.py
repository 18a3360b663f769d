"""LoRA (peft) on a converted model: low-rank adapters on named projections (by default the
attention's), the rest frozen; :func:`poslsh_cli.lm.convert.save` writes the result merged into
full weights or as the adapter beside its base.
"""
from __future__ import annotations

from typing import Any, Optional

from poslsh_cli.core.errors import ConfigError
from poslsh_cli.lm.checkpoint import peft_module


def default_targets(model: Any) -> list[str]:
    """The attention projections of the model (q/k/v/o, or an ALiBi model's fused q/k/v and output)."""
    from poslsh_cli.lm.pretrained import ALIBI_ARCHS

    mtype = getattr(model.config, "model_type", "")
    if mtype in ALIBI_ARCHS:
        a = ALIBI_ARCHS[mtype]
        return [a.qkv, a.out]
    return ["q_proj", "k_proj", "v_proj", "o_proj"]


def with_lora(model: Any, rank: int, alpha: float, targets: Optional[list[str]], dropout: float = 0.0) -> Any:
    """Low-rank adapters of rank ``rank`` on the ``targets`` modules (default: the attention
    projections), with dropout ``dropout`` on their input; the rest of the model is frozen."""
    peft = peft_module()
    targets = list(targets) if targets else default_targets(model)
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ConfigError(f"lora_targets: the model has no module named {', '.join(missing)} "
                          f"(it has e.g. {', '.join(sorted(default_targets(model)))})")
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, lora_dropout=dropout,
                          bias="none", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, cfg)


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config")


def base_of(model: Any) -> Any:
    """The transformers model inside a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if is_lora(model) else model
