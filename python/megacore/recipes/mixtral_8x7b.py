"""Mixtral 8x7B: h4096, 32 layers, 32 heads / 8 KV groups, 8 experts of FFN 14336 in every layer (top-2),
vocab 32000, RMSNorm eps 1e-5, RoPE theta 1e6 (46.7B parameters, 12.9B active per token). Experts spread over
EP = 8, on 2 nodes of 8 GPUs by default; the rest of the layout (TP, PP, sequence parallelism, ZeRO-1, recompute) is
the one `megacore plan --fit` picks for the GPUs' memory, ``gpu_memory_gib`` (default 80; `megacore train` passes
the memory of the GPUs the job runs on), as for llama3_8b."""

from __future__ import annotations

from ._common import finetune_from, fit_to_gpus, make
from .config import DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, Recipe, TrainerConfig


def pretrain_recipe(num_nodes: int = 2, num_gpus_per_node: int = 8, dir: str | None = None,
                    gpu_memory_gib: float | None = None) -> Recipe:
    """Pretraining on ``num_nodes`` × ``num_gpus_per_node`` GPUs of ``gpu_memory_gib`` GiB each (None: 80); raises
    ConfigError when no layout of those GPUs fits."""
    r = make("mixtral_8x7b_pretrain", ModelConfig.from_preset("mixtral_8x7b"), num_nodes=num_nodes,
             num_gpus_per_node=num_gpus_per_node, parallel=ParallelConfig(expert_model_parallel_size=8),
             data=DataConfig(paths=[], tokenizer="mistralai/Mixtral-8x7B-v0.1", seq_length=4096,
                             micro_batch_size=1, global_batch_size=256),
             optim=OptimizerConfig(lr=1e-4, min_lr=1e-5, weight_decay=0.1, lr_warmup_iters=500),
             trainer=TrainerConfig(max_steps=100000, val_check_interval=1000, precision="bf16"), dir=dir)
    return fit_to_gpus(r, gpu_memory_gib)


def finetune_recipe(sft_path: str = "", pretrained_checkpoint: str = "", num_nodes: int = 2, num_gpus_per_node: int = 8,
                    dir: str | None = None, peft=None, gpu_memory_gib: float | None = None) -> Recipe:
    """SFT of this model on ``sft_path`` (JSONL) from ``pretrained_checkpoint`` (weights only)."""
    return finetune_from(pretrain_recipe(num_nodes, num_gpus_per_node, gpu_memory_gib=gpu_memory_gib), sft_path,
                         pretrained_checkpoint, lr=1e-5, dir=dir, peft=peft)
