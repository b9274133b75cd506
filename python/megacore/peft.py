"""Parameter-efficient fine-tuning settings (LoRA), as NeMo users write them.

``LoRA(dim, alpha, dropout, target_modules)`` fills a recipe's ``peft`` section (declared in C++,
``train::PeftSection``): the base model is frozen and only low-rank adapters on the target modules are
trained (``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`` or ``linear_qkv linear_proj linear_fc1
linear_fc2``). The base weights come from ``checkpoint.pretrained_checkpoint``; checkpoints then hold only
the adapters and their optimizer state.
"""

from __future__ import annotations

import dataclasses

from .errors import ConfigError

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "linear_qkv",
                  "linear_proj", "linear_fc1", "linear_fc2")


@dataclasses.dataclass
class LoRA:
    """LoRA adapters: rank ``dim``, output scale ``alpha / dim``, ``dropout`` on the adapters' input."""
    dim: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list = dataclasses.field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])

    def apply(self, recipe) -> None:
        """Sets ``recipe.peft`` (validated with the rest of the recipe by ``recipe.validate()``)."""
        recipe.peft.scheme = "lora"
        recipe.peft.dim = int(self.dim)
        recipe.peft.alpha = float(self.alpha)
        recipe.peft.dropout = float(self.dropout)
        recipe.peft.target_modules = list(self.target_modules)


def resolve(peft) -> LoRA | None:
    """``None``/``"none"`` → None; ``"lora"`` → LoRA(); a LoRA → itself; anything else is a ConfigError."""
    if peft is None or peft == "none":
        return None
    if peft == "lora":
        return LoRA()
    if isinstance(peft, LoRA):
        return peft
    raise ConfigError(f"peft must be None, 'none', 'lora' or megacore.peft.LoRA(...), got {peft!r}")
