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


#: The GPU memory, in GiB, that a recipe whose layout depends on it is fitted for when the caller gives none (an
#: 80 GB H100 or A100): the Python API's default, deterministic on any machine. `megacore train` passes the memory of
#: the GPUs the job will use instead (cli.recipe_gpu_memory).
DEFAULT_GPU_MEMORY_GIB = 80.0


def fit_to_gpus(recipe: Recipe, gpu_memory_gib: float | None) -> Recipe:
    """Sets the recipe's TP/PP, sequence parallelism, ZeRO-1 and recompute (with recompute_num_layers) to the first layout, least model
    parallelism first, whose `megacore plan` estimate fits GPUs of ``gpu_memory_gib`` (None: DEFAULT_GPU_MEMORY_GIB)
    under the same headroom the memory check before launch applies (cli.fit_recipe), so that check passes the
    layout on GPUs of that size. ConfigError, naming the smallest estimate, when no layout of its GPUs fits."""
    from ..cli import fit_recipe

    f = fit_recipe(recipe, DEFAULT_GPU_MEMORY_GIB if gpu_memory_gib is None else float(gpu_memory_gib))
    p = recipe.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = f["tp"], f["pp"]
    p.sequence_parallel, p.use_distributed_optimizer = f["sequence_parallel"], f["zero"]
    recipe.trainer.recompute, recipe.trainer.recompute_num_layers = f["recompute"], f["recompute_num_layers"]
    return recipe


def small_layout(world_size: int, tp: int, pp: int, global_batch_size: int, micro_batch_size: int) -> dict:
    """A small recipe's layout for ``world_size`` ranks: its TP and its PP where the ranks divide by them, TP first
    (on 2 ranks TP 2 × PP 1), the rest data parallel. The global batch stays the recipe's, so every size trains on the
    same samples per step; the micro-batch becomes the largest divisor of the samples per DP replica not above the
    recipe's. Returns ``{"tp", "pp", "micro_batch_size"}``; where DP does not divide the global batch the micro-batch
    is the recipe's and `Recipe.validate` refuses the size, naming the multiple to use."""
    t = tp if world_size % tp == 0 else 1
    p = pp if world_size % (t * pp) == 0 else 1
    dp = world_size // (t * p)
    mbs = micro_batch_size
    if global_batch_size % dp == 0:
        per_replica = global_batch_size // dp
        while per_replica % mbs:
            mbs -= 1
    return {"tp": t, "pp": p, "micro_batch_size": mbs}


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
