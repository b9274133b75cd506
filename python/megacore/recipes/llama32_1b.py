"""Llama 3.2 1B: h2048, 16 layers, 32 heads / 8 KV groups, FFN 8192, vocab 128256, tied embeddings,
llama3 RoPE scaling. Fits one 80 GB GPU with bf16 and micro-batch 4 × 2048."""

from __future__ import annotations

from ._common import finetune_from, make
from .config import DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, Recipe, TrainerConfig


def pretrain_recipe(num_nodes: int = 1, num_gpus_per_node: int = 8, dir: str | None = None) -> Recipe:
    return make("llama32_1b_pretrain", ModelConfig.from_preset("llama32_1b"), num_nodes=num_nodes,
                num_gpus_per_node=num_gpus_per_node, parallel=ParallelConfig(),
                data=DataConfig(paths=[], tokenizer="meta-llama/Llama-3.2-1B", seq_length=2048, micro_batch_size=4,
                                global_batch_size=4 * num_nodes * num_gpus_per_node * 8),
                optim=OptimizerConfig(lr=3e-4, min_lr=3e-5, weight_decay=0.1, lr_warmup_iters=2000),
                trainer=TrainerConfig(max_steps=100000, val_check_interval=1000, precision="bf16",
                                      recompute="selective"), dir=dir)


def long_context_recipe(num_nodes: int = 1, num_gpus_per_node: int = 4, context_parallel_size: int = 4,
                        seq_length: int = 32768, dir: str | None = None) -> Recipe:
    """Long-context pretraining: sequences of ``seq_length`` tokens (32768) split over ``context_parallel_size``
    GPUs (4: ring attention, each GPU holds 2 of the 8 chunks of a sequence), micro-batch 1, selective recompute.
    The ranks beyond one CP group are data parallel; the global batch is 8 sequences per CP group."""
    gpus = num_nodes * num_gpus_per_node
    r = pretrain_recipe(num_nodes, num_gpus_per_node, dir=dir or "runs/llama32_1b_long_pretrain")
    r.name = "llama32_1b_long_pretrain"
    r.parallel.context_parallel_size = context_parallel_size
    r.data.seq_length = seq_length
    r.data.micro_batch_size = 1
    r.data.global_batch_size = 8 * max(1, gpus // context_parallel_size)
    return r


def finetune_recipe(sft_path: str = "", pretrained_checkpoint: str = "", num_nodes: int = 1, num_gpus_per_node: int = 8,
                    dir: str | None = None, peft=None) -> Recipe:
    """SFT of this model on ``sft_path`` (JSONL) from ``pretrained_checkpoint`` (weights only), into its own run
    directory (runs/llama32_1b_finetune unless ``dir``); both paths can also come from ``--set``."""
    return finetune_from(pretrain_recipe(num_nodes, num_gpus_per_node), sft_path, pretrained_checkpoint, lr=1e-5,
                         dir=dir, peft=peft)
