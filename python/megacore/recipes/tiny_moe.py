"""The tiny_moe recipe: the tiny recipe's data and a 4-layer Llama whose MLPs are mixtures of 4 SwiGLU experts
(top-2, switch aux loss and z-loss), small enough for CPU ranks. Data parallel over the ranks given (4 by default),
so ``--set parallel.ep=2`` (or 4) spreads the experts over expert-parallel ranks carved from DP; the global batch of 16
samples is the same at every size (micro-batch 2 on 8 ranks, 1 on 16)."""

from __future__ import annotations

from ._common import finetune_from, set_run_dir, small_layout
from .config import ModelConfig, ParallelConfig, Recipe
from . import tiny


def model() -> ModelConfig:
    m = tiny.model()
    m.name = "tiny_moe"
    m.num_moe_experts = 4
    m.moe_router_topk = 2
    m.moe_ffn_hidden_size = 128
    m.moe_aux_loss_coeff = 1e-2
    m.moe_z_loss_coeff = 1e-3
    return m


def pretrain_recipe(num_nodes: int = 1, num_gpus_per_node: int = 4, dir: str | None = None) -> Recipe:
    """The tiny recipe's data, schedule and trainer settings with this model, data parallel (no TP/PP)."""
    r = tiny.pretrain_recipe(num_nodes, num_gpus_per_node)
    r.name = "tiny_moe_pretrain"
    r.model = model()
    r.parallel = ParallelConfig()
    r.data.micro_batch_size = small_layout(r.world_size, 1, 1, r.data.global_batch_size, 4)["micro_batch_size"]
    return set_run_dir(r, dir or f"runs/{r.name}")


def finetune_recipe(sft_path: str = "", pretrained_checkpoint: str = "", num_nodes: int = 1, num_gpus_per_node: int = 4,
                    dir: str | None = None, peft=None) -> Recipe:
    """SFT of this model on ``sft_path`` (JSONL) from ``pretrained_checkpoint`` (weights only)."""
    return finetune_from(pretrain_recipe(num_nodes, num_gpus_per_node), sft_path, pretrained_checkpoint, lr=1e-3,
                         dir=dir, peft=peft)
