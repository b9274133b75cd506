"""Llama 3 8B: h4096, 32 layers, 32 heads / 8 KV groups, FFN 14336, vocab 128256, untied. Needs model
parallelism on 80 GB GPUs: the default layout is the one `megacore plan --fit` picks for the recipe's GPUs at
seq 8192 (TP 2 with sequence parallelism and ZeRO-1 on 8 GPUs, TP 4 on 4)."""

from __future__ import annotations

from ._common import finetune_from, make
from .config import DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, Recipe, TrainerConfig


GPU_MEMORY_GIB = 80.0
SEQ_LENGTH = 8192


def pretrain_recipe(num_nodes: int = 1, num_gpus_per_node: int = 8, dir: str | None = None) -> Recipe:
    from ..cli import fit_layout

    fit = fit_layout("llama3_8b", num_nodes * num_gpus_per_node, GPU_MEMORY_GIB, SEQ_LENGTH)
    return make("llama3_8b_pretrain", ModelConfig.from_preset("llama3_8b"), num_nodes=num_nodes,
                num_gpus_per_node=num_gpus_per_node,
                parallel=ParallelConfig(tensor_model_parallel_size=fit["tp"], pipeline_model_parallel_size=fit["pp"],
                                        sequence_parallel=fit["sequence_parallel"],
                                        use_distributed_optimizer=fit["zero"]),
                data=DataConfig(paths=[], tokenizer="meta-llama/Meta-Llama-3-8B", seq_length=SEQ_LENGTH,
                                micro_batch_size=1, global_batch_size=128),
                optim=OptimizerConfig(lr=3e-4, min_lr=3e-5, weight_decay=0.1, lr_warmup_iters=2000),
                trainer=TrainerConfig(max_steps=100000, val_check_interval=1000, precision="bf16",
                                      recompute=fit["recompute"]), dir=dir)


def finetune_recipe(sft_path: str = "", pretrained_checkpoint: str = "", num_nodes: int = 1, num_gpus_per_node: int = 8,
                    dir: str | None = None, peft=None) -> Recipe:
    """SFT of this model on ``sft_path`` (JSONL) from ``pretrained_checkpoint`` (weights only), into its own run
    directory (runs/llama3_8b_finetune unless ``dir``); both paths can also come from ``--set``."""
    return finetune_from(pretrain_recipe(num_nodes, num_gpus_per_node), sft_path, pretrained_checkpoint, lr=1e-5,
                         dir=dir, peft=peft)
