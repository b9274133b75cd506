"""Shared pieces of the end-to-end benchmark: the model configs, the FLOPs convention, the result record."""

# Llama shapes. llama1b is the reference config of the performance figures (docs/performance.md).
CONFIGS = {
    "llama1b": dict(h=2048, layers=16, heads=32, kv=8, ffn=8192, vocab=32000, seq=2048, micro_batch=4,
                    rope_theta=500000.0),
}


def flops_per_token(c):
    """6·N_matmul + 12·L·h·s (attention, non-causal count): megacore's model::flops_per_token, so every system's
    rate is counted the same way. N_matmul: QKV, out-projection, SwiGLU FFN of every layer and the output layer."""
    h, d = c["h"], c["h"] // c["heads"]
    per_layer = h * (h + 2 * c["kv"] * d) + h * h + 3 * h * c["ffn"]
    n_matmul = c["layers"] * per_layer + c["vocab"] * h
    return 6.0 * n_matmul, 12.0 * c["layers"] * h * c["seq"]


def result(system, c, step_s, peak_gib, peak_tflops, gpus=1):
    dense, attn = flops_per_token(c)
    tps = c["micro_batch"] * c["seq"] / step_s
    return {"system": system, "tokens_per_s_per_gpu": round(tps, 1),
            "tflops_6n_per_gpu": round(dense * tps / 1e12, 1),
            "mfu": round((dense + attn) * tps / 1e12 / peak_tflops, 4),
            "peak_mem_gib": round(peak_gib, 2), "step_ms": round(step_s * 1e3, 2), "gpus": gpus}
