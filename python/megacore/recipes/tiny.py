"""The tiny recipe: the embedded default corpus and a 4-layer Llama small enough for CPU ranks. It is the
README's main job (TP = 2, PP = 2 on 4 ranks) and the smoke test of every parallel layout. Its layout is sized to the
ranks given: TP 2 × PP 2 on 4 (× DP 2 on 8, × DP 4 on 16), TP 2 on 2, TP 1 × PP 1 on 1; the global batch of 16
samples is the same at every size."""

from __future__ import annotations

from ._common import finetune_from, make, small_layout
from .config import DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, Recipe, TrainerConfig


def model() -> ModelConfig:
    return ModelConfig(name="tiny", num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=256, vocab_size=259, max_position_embeddings=256)


def pretrain_recipe(num_nodes: int = 1, num_gpus_per_node: int = 4, dir: str | None = None) -> Recipe:
    fit = small_layout(num_nodes * num_gpus_per_node, tp=2, pp=2, global_batch_size=16, micro_batch_size=4)
    return make("tiny_pretrain", model(), num_nodes=num_nodes, num_gpus_per_node=num_gpus_per_node,
                parallel=ParallelConfig(tensor_model_parallel_size=fit["tp"], pipeline_model_parallel_size=fit["pp"]),
                data=DataConfig(paths=["embedded"], seq_length=128, micro_batch_size=fit["micro_batch_size"],
                                global_batch_size=16),
                optim=OptimizerConfig(lr=3e-3, min_lr=3e-4, weight_decay=0.01, lr_warmup_iters=5),
                trainer=TrainerConfig(max_steps=150, val_check_interval=50, limit_val_batches=2, precision="auto",
                                      generate_tokens=40, generate_prompt="sam says tree"),
                dir=dir)


def finetune_recipe(sft_path: str = "", pretrained_checkpoint: str = "", num_nodes: int = 1, num_gpus_per_node: int = 4,
                    dir: str | None = None, peft=None) -> Recipe:
    """SFT of this model on ``sft_path`` (JSONL) from ``pretrained_checkpoint`` (weights only), into its own run
    directory (runs/tiny_finetune unless ``dir``); both paths can also come from ``--set``."""
    return finetune_from(pretrain_recipe(num_nodes, num_gpus_per_node), sft_path, pretrained_checkpoint, lr=1e-3,
                         dir=dir, peft=peft)
