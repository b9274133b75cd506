"""One training system of the end-to-end comparison on one GPU: builds the model of a named config, trains
random tokens for --warmup + --iters steps (AdamW, global-norm clipping 1.0) and prints one JSON line:

    python3 benchmarks/e2e/peers.py --system hf_compile --config llama1b [--out run.json]

Systems (each in its own process, so one's memory and compile caches do not touch the next's):
  hf_eager       transformers LlamaForCausalLM, SDPA attention, bf16 weights, torch fused AdamW (bf16 state)
  hf_compile     the same under torch.compile
  liger          the same with Liger kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy), eager
  megatron_core  Megatron-Core GPTModel with the local layer spec (no Transformer Engine on the machine: torch
                 RMSNorm, unfused DotProductAttention), Megatron DDP (f32 main grads) and Megatron's optimizer
                 (f32 masters; torch AdamW underneath when neither TE nor apex is installed)
  torchtitan     torchtitan's Llama3 model (varlen attention, fused QKV) under torch.compile, torch fused AdamW
  torchao_fp8    hf_compile with torchao's float8 training (tensorwise scaling) on the linear layers

run_e2e.py runs them all and megacore beside them and turns each step time into rates with one FLOPs convention
(e2e_common.result).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_common import CONFIGS, hf_llama_config  # noqa: E402


def hf_model(c, device):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    m = LlamaForCausalLM(hf_llama_config(c)).to(device=device, dtype=torch.bfloat16).train()

    def loss_fn(ids, labels):
        return m(input_ids=ids, labels=labels).loss
    return m, loss_fn


def build(system, c, device):
    """(module whose parameters train, loss_fn(ids, labels), optimizer, note)."""
    note = ""
    if system in ("hf_eager", "hf_compile", "torchao_fp8"):
        m, loss_fn = hf_model(c, device)
        if system == "torchao_fp8":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            convert_to_float8_training(m.model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                       module_filter_fn=lambda mod, fqn: fqn != "lm_head")
            note = "torchao float8 tensorwise on every decoder linear (lm_head bf16), torch.compile"
        if system != "hf_eager":
            m = torch.compile(m)
            loss_fn = (lambda mm: (lambda ids, labels: mm(input_ids=ids, labels=labels).loss))(m)
        return m, loss_fn, torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True), note
    if system == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
        m, loss_fn = hf_model(c, device)
        from importlib.metadata import version
        note = f"liger-kernel {version('liger-kernel')}: RoPE, RMSNorm, SwiGLU, fused linear CE; eager"
        return m, loss_fn, torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True), note
    if system == "megatron_core":
        return build_mcore(c, device)
    if system == "torchtitan":
        return build_titan(c, device)
    raise SystemExit(f"unknown system {system}")


def build_mcore(c, device):
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=c["layers"], hidden_size=c["h"], num_attention_heads=c["heads"],
                            num_query_groups=c["kv"], ffn_hidden_size=c["ffn"], gated_linear_unit=True,
                            activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=1e-5,
                            add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
                            attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=c["vocab"],
                     max_sequence_length=c["seq"], position_embedding_type="rope", rotary_base=c["rope_theta"],
                     share_embeddings_and_output_weights=False).to(device)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                     overlap_grad_reduce=False,
                                                                     use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-4, weight_decay=0.1, bf16=True,
                                                 use_distributed_optimizer=True, clip_grad=1.0), [ddp])
    pos = torch.arange(c["seq"], device=device).unsqueeze(0).expand(c["micro_batch"], -1)

    def loss_fn(ids, labels):
        return ddp(ids, pos, None, labels=labels).float().mean()

    class Opt:  # Megatron's step: zero the DDP buffers, finish the grad sync, step (clips inside)
        def zero_grad(self, set_to_none=False):
            ddp.zero_grad_buffer()
            opt.zero_grad()

        def step(self):
            ddp.finish_grad_sync()
            opt.step()
    inner = type(getattr(opt, "chained_optimizers", [opt])[0]).__name__
    adam = type(getattr(getattr(opt, "chained_optimizers", [opt])[0], "optimizer", None)).__name__
    note = (f"megatron-core GPTModel, local spec (torch RMSNorm, unfused DotProductAttention; no Transformer Engine "
            f"on the machine), DDP f32 main grads, {inner} over {adam}")
    return ddp, loss_fn, Opt(), note


def build_titan(c, device):
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    init_lin = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02)}
    cfg = Llama3Model.Config(
        dim=c["h"], vocab_size=c["vocab"],
        tok_embeddings=Embedding.Config(num_embeddings=c["vocab"], embedding_dim=c["h"],
                                        param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=c["h"], param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=c["h"], out_features=c["vocab"], param_init=init_lin),
        layers=_build_llama3_layers(n_layers=c["layers"], dim=c["h"], n_heads=c["heads"], n_kv_heads=c["kv"],
                                    hidden_dim=c["ffn"], fuse_qkv=True, attn_backend="varlen",
                                    rope=ComplexRoPE.Config(dim=c["h"] // c["heads"], max_seq_len=c["seq"],
                                                            theta=c["rope_theta"])))
    torch.manual_seed(0)
    with torch.device(device):
        m = cfg.build()
    m.init_states(buffer_device=device)
    m = m.to(dtype=torch.bfloat16).train()
    positions = torch.arange(c["seq"], device=device).unsqueeze(0).expand(c["micro_batch"], -1)
    masks = m.get_attention_masks(positions)
    cm = torch.compile(m)

    def loss_fn(ids, labels):
        logits = cm(ids, positions, masks)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    import torchtitan
    note = f"torchtitan {torchtitan.__version__} Llama3Model (varlen attention, fused QKV), torch.compile, fused AdamW"
    return m, loss_fn, torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True), note


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", required=True)
    ap.add_argument("--config", default="llama1b", choices=sorted(CONFIGS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    c = CONFIGS[a.config]
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    t_build = time.perf_counter()
    model, loss_fn, opt, note = build(a.system, c, device)
    g = torch.Generator(device="cpu").manual_seed(1000)
    ids = torch.randint(0, c["vocab"], (c["micro_batch"], c["seq"]), generator=g).to(device)
    # next-token labels; HF shifts its labels itself, the others take them as given
    labels = ids if a.system in ("hf_eager", "hf_compile", "liger", "torchao_fp8") else torch.roll(ids, -1, 1)

    def step():
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(ids, labels)
        loss.backward()
        if a.system != "megatron_core":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(a.iters):
        loss = step()
    torch.cuda.synchronize()
    sec = (time.perf_counter() - t1) / a.iters
    # The measurement only; run_e2e.py turns it into rates (e2e_common.result: megacore's FLOPs convention).
    r = dict(system=a.system, step_s=sec, peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30,
             tokens_per_s=c["micro_batch"] * c["seq"] / sec, loss=float(loss), note=note, warmup_s=round(warm_s, 1),
             build_s=round(t0 - t_build, 1), torch=torch.__version__)
    print("E2E_RESULT " + json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
