"""Shared builders for the per-model recipe modules."""

from __future__ import annotations

from .config import (CheckpointConfig, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                     Recipe, Resources, TrainerConfig)


def make(name: str, model: ModelConfig, *, num_nodes: int, num_gpus_per_node: int, parallel: ParallelConfig,
         data: DataConfig, optim: OptimizerConfig, trainer: TrainerConfig, dir: str | None = None) -> Recipe:
    run_dir = dir or f"runs/{name}"
    return Recipe(name=name, model=model, parallel=parallel, data=data, optim=optim, trainer=trainer,
                  checkpoint=CheckpointConfig(save_dir=f"{run_dir}/checkpoints"),
                  logging=LoggingConfig(log_dir=f"{run_dir}/logs"),
                  resources=Resources(num_nodes=num_nodes, num_gpus_per_node=num_gpus_per_node))


def finetune_from(recipe: Recipe, sft_path: str, resume: str, lr: float) -> Recipe:
    """SFT variant of a pretrain recipe: JSONL data with answer-only loss and packing, lower constant-ish
    LR with short warmup, starting from `resume` (a megacore checkpoint, e.g. one made by
    `megacore convert hf-to-megacore`)."""
    recipe.name = recipe.name.replace("pretrain", "finetune")
    recipe.data.sft_path = sft_path
    recipe.data.paths = []
    recipe.optim.lr = lr
    recipe.optim.min_lr = lr / 10
    recipe.optim.lr_warmup_iters = min(50, recipe.trainer.max_steps // 10)
    recipe.optim.weight_decay = 0.0
    recipe.checkpoint.resume = resume
    return recipe
