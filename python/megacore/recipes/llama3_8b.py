"""Llama 3 8B: h4096, 32 layers, 32 heads / 8 KV groups, FFN 14336, vocab 128256, untied, seq 8192. Its layout
(TP, PP, sequence parallelism, ZeRO-1, recompute) is the one `megacore plan --fit` picks for its GPUs and their
memory, ``gpu_memory_gib`` (default 80, the size of an H100 or A100 80GB; `megacore train` passes the memory of the
GPUs the job runs on): on 80 GiB GPUs TP 2 + SP + ZeRO-1 on 8 GPUs, and on 4 the same with full recompute of the first 2 layers
(trainer.recompute_num_layers); on 140 GiB GPUs (H200) TP 1
with ZeRO-1 on 4 or 8."""

from __future__ import annotations

from ._common import finetune_from, fit_to_gpus, make
from .config import DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, Recipe, TrainerConfig


SEQ_LENGTH = 8192


def pretrain_recipe(num_nodes: int = 1, num_gpus_per_node: int = 8, dir: str | None = None,
                    gpu_memory_gib: float | None = None) -> Recipe:
    """Pretraining on ``num_nodes`` × ``num_gpus_per_node`` GPUs of ``gpu_memory_gib`` GiB each (None: 80); raises
    ConfigError when no layout of those GPUs fits."""
    r = make("llama3_8b_pretrain", ModelConfig.from_preset("llama3_8b"), num_nodes=num_nodes,
             num_gpus_per_node=num_gpus_per_node, parallel=ParallelConfig(),
             data=DataConfig(paths=[], tokenizer="meta-llama/Meta-Llama-3-8B", seq_length=SEQ_LENGTH,
                             micro_batch_size=1, global_batch_size=128),
             optim=OptimizerConfig(lr=3e-4, min_lr=3e-5, weight_decay=0.1, lr_warmup_iters=2000),
             trainer=TrainerConfig(max_steps=100000, val_check_interval=1000, precision="bf16"), dir=dir)
    return fit_to_gpus(r, gpu_memory_gib)


def finetune_recipe(sft_path: str = "", pretrained_checkpoint: str = "", num_nodes: int = 1, num_gpus_per_node: int = 8,
                    dir: str | None = None, peft=None, gpu_memory_gib: float | None = None) -> Recipe:
    """SFT of this model on ``sft_path`` (JSONL) from ``pretrained_checkpoint`` (weights only), into its own run
    directory (runs/llama3_8b_finetune unless ``dir``); both paths can also come from ``--set``. The layout is the
    pretrain recipe's for these GPUs (full fine-tuning keeps the same gradients and optimizer state)."""
    return finetune_from(pretrain_recipe(num_nodes, num_gpus_per_node, gpu_memory_gib=gpu_memory_gib), sft_path,
                         pretrained_checkpoint, lr=1e-5, dir=dir, peft=peft)
