"""Recipes in the style of NeMo 2.0: functions returning an editable, validated ``Recipe``.

    import megacore as mc
    recipe = mc.recipes.llama32_1b.pretrain_recipe(num_nodes=1, num_gpus_per_node=4)
    recipe.parallel.tensor_model_parallel_size = 2
    recipe.validate()
    mc.run(recipe, executor=mc.LocalExecutor(nproc_per_node=4))

``get("tiny")`` returns a recipe by name (``tiny``, ``tiny_moe``, ``gpt2_124m``, ``llama32_1b``, ``llama3_8b``,
``mixtral_8x7b``, each with a
``_finetune`` variant needing ``sft_path`` and ``resume``), and the long-context variant ``llama32_1b_long``
(sequence 32768 over context parallelism 4).
"""

from __future__ import annotations

import inspect

from . import gpt2_124m, llama3_8b, llama32_1b, mixtral_8x7b, tiny, tiny_moe
from .config import (ALIASES, CheckpointConfig, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig,
                     ParallelConfig, Recipe, Resources, TrainerConfig)
from ..errors import ConfigError

RECIPES = {"tiny": tiny, "tiny_moe": tiny_moe, "gpt2_124m": gpt2_124m, "llama32_1b": llama32_1b, "llama3_8b": llama3_8b,
           "mixtral_8x7b": mixtral_8x7b}
VARIANTS = {"llama32_1b_long": llama32_1b.long_context_recipe}  # named variants of a pretrain recipe


def _function(name: str):
    if name in VARIANTS:
        return VARIANTS[name]
    base, _, kind = name.partition("_finetune")
    if base not in RECIPES or (kind and kind != ""):
        raise ConfigError(f"unknown recipe '{name}'; use one of "
                          f"{', '.join(list(RECIPES) + [n + '_finetune' for n in RECIPES] + list(VARIANTS))}")
    mod = RECIPES[base]
    return mod.finetune_recipe if name.endswith("_finetune") else mod.pretrain_recipe


def get(name: str, **kwargs) -> Recipe:
    """The pretrain recipe of that name (``name_finetune`` for the SFT variant); kwargs go to the function."""
    return _function(name)(**kwargs)


def takes_gpu_memory(name: str) -> bool:
    """Whether the recipe's layout is fitted to the GPUs' memory (its function takes ``gpu_memory_gib``)."""
    return "gpu_memory_gib" in inspect.signature(_function(name)).parameters


__all__ = ["ALIASES", "CheckpointConfig", "DataConfig", "LoggingConfig", "ModelConfig", "OptimizerConfig",
           "ParallelConfig", "Recipe", "Resources", "TrainerConfig", "RECIPES", "VARIANTS", "get", "takes_gpu_memory", "tiny",
           "gpt2_124m", "llama32_1b", "llama3_8b", "mixtral_8x7b", "tiny_moe"]
