"""Shared builders for the per-model recipe modules."""

from __future__ import annotations

from .config import (CheckpointConfig, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                     Recipe, Resources, TrainerConfig)


def make(name: str, model: ModelConfig, *, num_nodes: int, num_gpus_per_node: int, parallel: ParallelConfig,
         data: DataConfig, optim: OptimizerConfig, trainer: TrainerConfig, dir: str | None = None) -> Recipe:
    r = Recipe(name=name, model=model, parallel=parallel, data=data, optim=optim, trainer=trainer,
               checkpoint=CheckpointConfig(), logging=LoggingConfig(),
               resources=Resources(num_nodes=num_nodes, num_gpus_per_node=num_gpus_per_node))
    return set_run_dir(r, dir or f"runs/{name}")


def set_run_dir(recipe: Recipe, run_dir: str) -> Recipe:
    """Checkpoints under run_dir/checkpoints, logs under run_dir/logs."""
    recipe.checkpoint.save_dir = f"{run_dir}/checkpoints"
    recipe.logging.log_dir = f"{run_dir}/logs"
    return recipe


def finetune_from(recipe: Recipe, sft_path: str, pretrained_checkpoint: str, lr: float, dir: str | None = None,
                  peft=None) -> Recipe:
    """SFT variant of a pretrain recipe: JSONL data with answer-only loss and packing, a lower LR with a warmup
    of 5 % of the run (it follows max_steps), weights from `pretrained_checkpoint` (a megacore checkpoint, e.g.
    a pretraining run's or one made by `megacore convert hf-to-megacore`; weights only), written into its own
    run directory so the base checkpoints are never touched, and resumed from its own checkpoints."""
    recipe.name = recipe.name.replace("pretrain", "finetune")
    set_run_dir(recipe, dir or f"runs/{recipe.name}")
    recipe.data.sft_path = sft_path
    recipe.data.paths = []
    recipe.data.split = "90,10,0"  # SFT examples: 10 % held out for validation
    recipe.optim.lr = lr
    recipe.optim.min_lr = lr / 10
    recipe.optim.lr_warmup_iters = 0
    recipe.optim.lr_warmup_fraction = 0.05
    recipe.optim.weight_decay = 0.0
    recipe.checkpoint.resume = "auto"
    recipe.checkpoint.pretrained_checkpoint = pretrained_checkpoint
    recipe.trainer.generate_tokens = 0
    from .. import peft as _peft  # the recipe's peft section: LoRA adapters on a frozen base
    lora = _peft.resolve(peft)
    if lora is not None:
        lora.apply(recipe)
    return recipe
