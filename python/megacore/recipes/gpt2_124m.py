"""GPT-2 small (124M): LayerNorm, learned positions, GELU, biases, tied embeddings, 1024 positions."""

from __future__ import annotations

from ._common import finetune_from, make
from .config import DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, Recipe, TrainerConfig


def pretrain_recipe(num_nodes: int = 1, num_gpus_per_node: int = 1, dir: str | None = None) -> Recipe:
    return make("gpt2_124m_pretrain", ModelConfig.from_preset("gpt2_124m"), num_nodes=num_nodes,
                num_gpus_per_node=num_gpus_per_node, parallel=ParallelConfig(),
                data=DataConfig(paths=[], tokenizer="gpt2", seq_length=1024, micro_batch_size=16,
                                global_batch_size=512),
                optim=OptimizerConfig(lr=6e-4, min_lr=6e-5, weight_decay=0.1, lr_warmup_iters=700),
                trainer=TrainerConfig(max_steps=19073, val_check_interval=250, precision="bf16"), dir=dir)


def finetune_recipe(sft_path: str = "", pretrained_checkpoint: str = "", num_nodes: int = 1, num_gpus_per_node: int = 1,
                    dir: str | None = None, peft=None) -> Recipe:
    """SFT of this model on ``sft_path`` (JSONL) from ``pretrained_checkpoint`` (weights only), into its own run
    directory (runs/gpt2_124m_finetune unless ``dir``); both paths can also come from ``--set``."""
    return finetune_from(pretrain_recipe(num_nodes, num_gpus_per_node), sft_path, pretrained_checkpoint, lr=1e-5,
                         dir=dir, peft=peft)
