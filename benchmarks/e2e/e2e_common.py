"""Shared pieces of the end-to-end benchmark: the model configs, the FLOPs convention, the result record."""

# Llama shapes. llama1b is the reference config of the performance figures (docs/performance.md).
CONFIGS = {
    "llama1b": dict(h=2048, layers=16, heads=32, kv=8, ffn=8192, vocab=32000, seq=2048, micro_batch=4,
                    rope_theta=500000.0),
}


def hf_config_dict(c):
    """The config.json of the Hugging Face LlamaForCausalLM of config c (untied, no RoPE scaling)."""
    return dict(model_type="llama", hidden_size=c["h"], intermediate_size=c["ffn"], num_hidden_layers=c["layers"],
                num_attention_heads=c["heads"], num_key_value_heads=c["kv"], vocab_size=c["vocab"],
                max_position_embeddings=c["seq"], rms_norm_eps=1e-5, rope_theta=c["rope_theta"],
                tie_word_embeddings=False, hidden_act="silu")


def hf_llama_config(c):
    """transformers.LlamaConfig of config c, SDPA attention."""
    from transformers import LlamaConfig
    d = hf_config_dict(c)
    del d["model_type"]  # LlamaConfig's own
    return LlamaConfig(**d, attn_implementation="sdpa")


def flops_per_token(c):
    """(6·N_matmul, 12·L·h·s) per token from megacore's model::flops_per_token (non-causal attention count) of the
    same model as megacore imports it, so every system's rate is counted the same way."""
    from megacore import convert, model
    cfg = convert.transformer_config(convert.config_from_hf(hf_config_dict(c), "bf16"))
    f = model.flops_per_token(cfg, c["seq"], False)
    return float(f["dense"]), float(f["attention"])


def result(system, c, step_s, peak_gib, peak_tflops, gpus=1):
    """The run record of run_e2e's JSON from a measured step time and peak memory."""
    dense, attn = flops_per_token(c)
    tps = c["micro_batch"] * c["seq"] / step_s
    return {"system": system, "tokens_per_s_per_gpu": round(tps, 1),
            "tflops_6n_per_gpu": round(dense * tps / 1e12, 1),
            "mfu": round((dense + attn) * tps / 1e12 / peak_tflops, 4),
            "peak_mem_gib": round(peak_gib, 2), "step_ms": round(step_s * 1e3, 2), "gpus": gpus}
