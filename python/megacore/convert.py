"""Hugging Face ↔ megacore checkpoint conversion (Llama family, Mixtral and GPT-2), bit-exact in both directions.

``hf_to_megacore(hf_dir, out_root)`` reads a Hugging Face model directory (config.json plus
model.safetensors, or sharded model-0000k-of-0000n.safetensors with model.safetensors.index.json) and
writes a megacore checkpoint ``out_root/step_0`` holding the whole (TP = 1) tensors, which loads into any
parallel layout (megacore checkpoints reshard on load). The TransformerConfig travels as the JSON blob
"config" (``config_from_checkpoint`` / ``transformer_config`` turn it back into a TransformerConfig).

``megacore_to_hf(ckpt, out_dir)`` does the reverse from any megacore checkpoint (a step directory or a root
with ``latest``; any layout it was saved from: shards are assembled), including those ``megacore train``
writes (the model is read from their "recipe" blob). It writes what transformers >= 5 writes: config.json
(``rope_parameters``, ``dtype``, special token ids, ...), generation_config.json, safetensors (sharded with an
index above ``max_shard_size`` bytes) and the run's tokenizer files; vocabulary padding rows are dropped.

Name and layout mapping (docs/checkpoint.md has the table):

* Llama: q/k/v_proj → the fused ``linear_qkv`` (rows grouped per KV group: the group's query heads, then its
  key head, then its value head — include/megacore/layers/attention.hpp); gate/up_proj → ``linear_fc1`` =
  [gate; up]; o/down_proj, norms, embedding and lm_head map one to one. megacore's RoPE rotates halves
  (i, i + d/2) exactly as HF Llama does, so q/k rows need no permutation (only checkpoints in Meta's
  original interleaved layout would). A tied model has no lm_head.weight.
* Mixtral: attention, norms and embeddings as for Llama; each layer's router ``block_sparse_moe.gate`` [E, H] →
  ``mlp.router``; the experts' ``w1`` (gate) / ``w3`` (up) [F, H] → ``mlp.experts.linear_fc1`` [E, 2F, H] (each
  expert's [gate; up]), ``w2`` [H, F] → ``mlp.experts.linear_fc2`` [E, H, F]. HF's routing (softmax over all
  experts, top-k, renormalised) is megacore's moe_router_pre_softmax = false. Qwen2-MoE is refused naming what
  megacore lacks (a gated shared expert and q/k-only biases).
* Qwen3 (dense) and Qwen3-MoE: Llama's mapping plus the per-head query / key norms ``self_attn.q_norm`` /
  ``k_norm`` [head_dim] → ``self_attention.q_layernorm`` / ``k_layernorm`` (megacore's qk_layernorm). Qwen3-MoE's
  router ``mlp.gate`` → ``mlp.router`` and per-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` → the stacked
  ``mlp.experts.linear_fc1`` / ``linear_fc2``; ``norm_topk_prob`` true (top-k renormalised) is
  moe_router_pre_softmax = false, false is moe_router_pre_softmax = true. Every layer must be a MoE layer
  (decoder_sparse_step 1, no mlp_only_layers), as in the released models.
* GPT-2: Conv1D weights are stored [in, out] and are transposed; c_attn is [q | k | v] along its output,
  fused per head like Llama with groups = heads (bias too).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from .checkpoint import (BF16Array, SafetensorsReader, dtype_name, load_full_checkpoint, save_full_checkpoint,
                         write_safetensors)
from .errors import ConfigError
from .errors import IOError as MegacoreIOError

# ----------------------------------------------------------------------------- fused QKV layout

def _keep(a: np.ndarray, like: np.ndarray) -> np.ndarray:
    return BF16Array(a) if isinstance(like, BF16Array) else a


def fuse_qkv(wq, wk, wv, heads: int, groups: int):
    """HF Wq [heads·d, ...], Wk/Wv [groups·d, ...] → megacore's fused rows (per group: its queries, k, v)."""
    hpg = heads // groups
    d = wk.shape[0] // groups
    tail = wq.shape[1:]
    q = np.asarray(wq).reshape((groups, hpg * d) + tail)
    k = np.asarray(wk).reshape((groups, d) + tail)
    v = np.asarray(wv).reshape((groups, d) + tail)
    return _keep(np.concatenate([q, k, v], axis=1).reshape(((heads + 2 * groups) * d,) + tail), wq)


def split_qkv(w, heads: int, groups: int):
    """Inverse of fuse_qkv: (Wq, Wk, Wv)."""
    hpg = heads // groups
    d = w.shape[0] // (heads + 2 * groups)
    tail = w.shape[1:]
    g = np.asarray(w).reshape((groups, (hpg + 2) * d) + tail)
    wq = np.ascontiguousarray(g[:, :hpg * d].reshape((heads * d,) + tail))
    wk = np.ascontiguousarray(g[:, hpg * d:(hpg + 1) * d].reshape((groups * d,) + tail))
    wv = np.ascontiguousarray(g[:, (hpg + 1) * d:].reshape((groups * d,) + tail))
    return _keep(wq, w), _keep(wk, w), _keep(wv, w)


def _t(a):
    return _keep(np.ascontiguousarray(np.asarray(a).T), a)


def _cat(parts):
    return _keep(np.concatenate([np.asarray(p) for p in parts], axis=0), parts[0])


def _stack(parts):
    return _keep(np.stack([np.asarray(p) for p in parts], axis=0), parts[0])


# ----------------------------------------------------------------------------- configs

def _rope_from_hf(hf: Mapping[str, Any]) -> Tuple[float, dict]:
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or {}
    if params.get("rope_type", "default") not in ("default", None):
        scaling = params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in ("default", None):
        return theta, {"type": "None"}
    if kind != "llama3":
        raise ConfigError(f"rope scaling type '{kind}' is not supported by megacore; only llama3 (or none) is")
    return theta, {"type": "Llama3", "factor": float(scaling["factor"]),
                   "low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
                   "high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
                   "original_max_position_embeddings": int(scaling.get("original_max_position_embeddings", 8192))}


_QWEN_MOE_MISSING = {
    "qwen2_moe": "Qwen2MoeForCausalLM cannot be converted: it has biases on q/k/v only (megacore's add_bias_linear "
                 "puts biases on every linear layer or none) and a shared expert scaled by a sigmoid gate "
                 "(shared_expert_gate), which megacore's shared expert (model.moe_shared_expert_size) does not have",
}

# megacore's MoE settings that a Hugging Face Qwen3MoeForCausalLM has (moe_router_pre_softmax is its
# norm_topk_prob, either way).
_QWEN3_MOE = {"moe_layer_freq": 1, "moe_shared_expert_size": 0, "moe_router_score_function": "softmax",
              "moe_router_topk_scaling_factor": 1.0, "moe_router_enable_expert_bias": False}


def _moe_config_from_qwen3(hf: Mapping[str, Any]) -> Dict[str, Any]:
    """The MoE fields of a Qwen3-MoE config.json. Routing: softmax over all experts, the top k, renormalised when
    norm_topk_prob (the softmax over the top-k logits, megacore's moe_router_pre_softmax = false, as for Mixtral),
    else kept as they are (moe_router_pre_softmax = true; also when the key is absent, transformers' default). The
    aux loss is Mixtral's (coefficient × k)."""
    # config.json names the expert count num_experts (the hub's files) or num_local_experts (what transformers
    # 5.17's save_pretrained writes for Qwen3-MoE; its config maps one name onto the other).
    n = hf.get("num_experts", hf.get("num_local_experts"))
    if n is None:
        raise ConfigError("this Qwen3-MoE config.json has neither num_experts nor num_local_experts")
    e, k = int(n), int(hf["num_experts_per_tok"])
    if not 1 <= k <= e:
        raise ConfigError(f"num_experts_per_tok = {k} must be in [1, num_experts = {e}]")
    step, dense = int(hf.get("decoder_sparse_step", 1) or 1), list(hf.get("mlp_only_layers") or [])
    if step != 1 or dense:
        raise ConfigError(f"this Qwen3-MoE has dense layers (decoder_sparse_step = {step}, mlp_only_layers = {dense}); "
                          "megacore converts Qwen3-MoE models whose every layer is a MoE layer (decoder_sparse_step 1, "
                          "mlp_only_layers [])")
    return {"num_moe_experts": e, "moe_router_topk": k, "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
            "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.001)) * k, **_QWEN3_MOE,
            "moe_router_pre_softmax": not bool(hf.get("norm_topk_prob", False))}  # transformers' default: False

# megacore's MoE settings that a Hugging Face MixtralForCausalLM has (anything else has no Mixtral equivalent).
_MIXTRAL_MOE = {"moe_layer_freq": 1, "moe_shared_expert_size": 0, "moe_router_score_function": "softmax",
                "moe_router_pre_softmax": False, "moe_router_topk_scaling_factor": 1.0,
                "moe_router_enable_expert_bias": False}


def _moe_config_from_mixtral(hf: Mapping[str, Any]) -> Dict[str, Any]:
    """The MoE fields of a Mixtral config.json.

    Routing: HF Mixtral takes the softmax over all experts, keeps the top k and divides them by their sum.
    For the chosen set S, exp(z_i)/Σ_all / (Σ_{j∈S} exp(z_j)/Σ_all) = exp(z_i)/Σ_{j∈S} exp(z_j): the softmax over
    the top-k logits alone, which is megacore's moe_router_pre_softmax = false (top-k on the logits, then
    softmax); the top-k sets agree because softmax is monotonic.

    Aux loss: HF's load_balancing_loss_func is coef · E · Σ_i f_i · P_i with f_i = (tokens routed to expert i) / T
    (so Σ_i f_i = k) and P_i the mean router probability of expert i; megacore's (Megatron-Core's switch loss)
    divides the same sum by k, so moe_aux_loss_coeff = router_aux_loss_coef · k gives the same loss. (HF adds it
    only when output_router_logits is set; megacore adds it whenever the coefficient is > 0.)"""
    e, k = int(hf["num_local_experts"]), int(hf["num_experts_per_tok"])
    if not 1 <= k <= e:
        raise ConfigError(f"num_experts_per_tok = {k} must be in [1, num_local_experts = {e}]")
    return {"num_moe_experts": e, "moe_router_topk": k, "moe_ffn_hidden_size": int(hf["intermediate_size"]),
            "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.001)) * k, **_MIXTRAL_MOE}


def _is_moe(c: Mapping[str, Any]) -> bool:
    return int(c.get("num_moe_experts", 0) or 0) > 0


def _check_mixtral_compatible(c: Mapping[str, Any]) -> None:
    """Refuses MoE settings that MixtralForCausalLM cannot express."""
    bad = []
    for k, want in _MIXTRAL_MOE.items():
        have = c.get(k, want)
        same = str(have).lower() == want if isinstance(want, str) else have == want
        if not same:
            bad.append(f"{k} = {have} (Mixtral: {want})")
    if bad:
        raise ConfigError("this MoE model has no Hugging Face Mixtral equivalent: " + "; ".join(bad) +
                          ". Only softmax routing with top-k then softmax, every layer MoE, no shared expert and no "
                          "expert bias export as MixtralForCausalLM")


def config_from_hf(hf: Mapping[str, Any], params_dtype: str = "f32") -> Dict[str, Any]:
    """A megacore TransformerConfig (as a dict of its fields) from an HF config.json dict."""
    mt = hf.get("model_type")
    if mt in _QWEN_MOE_MISSING:
        raise ConfigError(_QWEN_MOE_MISSING[mt])
    if mt in ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe") or (mt is None and "num_hidden_layers" in hf):
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act '{hf['hidden_act']}' is not SwiGLU's silu; megacore Llama uses silu")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ConfigError("attention_bias / mlp_bias Llama variants are not supported (megacore puts biases on "
                              "every linear layer or none)")
        max_pos = int(hf.get("max_position_embeddings", 2048))
        # Qwen3 configs carry a sliding_window that applies only with use_sliding_window (default false there;
        # Mistral's has no such switch).
        qwen3 = mt in ("qwen3", "qwen3_moe")
        window = hf.get("sliding_window") if hf.get("use_sliding_window", not qwen3) else None
        if window is not None and int(window) < max_pos:
            raise ConfigError(f"sliding_window = {window} is shorter than max_position_embeddings = {max_pos}: "
                              "megacore has no sliding-window attention, so this model's attention would differ on "
                              "longer sequences; set sliding_window to null (or >= max_position_embeddings) in "
                              "config.json, or lower max_position_embeddings to at most the window")
        heads = int(hf["num_attention_heads"])
        theta, scaling = _rope_from_hf(hf)
        c = {"num_layers": int(hf["num_hidden_layers"]), "hidden_size": int(hf["hidden_size"]),
             "num_attention_heads": heads,
             "num_query_groups": int(hf.get("num_key_value_heads") or heads),
             "ffn_hidden_size": int(hf["intermediate_size"]),
             # Qwen3's config defaults head_dim to 128, Llama's to hidden / heads.
             "kv_channels": int(hf.get("head_dim") or (128 if qwen3 else int(hf["hidden_size"]) // heads)),
             "vocab_size": int(hf["vocab_size"]),
             "max_position_embeddings": max_pos,
             "normalization": "RMSNorm", "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
             "activation": "SwiGLU", "add_bias_linear": False,
             "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
             "position_embedding": "RoPE", "rope_theta": theta, "rope_scaling": scaling,
             "init_method_std": float(hf.get("initializer_range", 0.02)), "params_dtype": params_dtype}
        if qwen3:
            c["qk_layernorm"] = True
        if mt == "mixtral":
            c.update(_moe_config_from_mixtral(hf))
        if mt == "qwen3_moe":
            c.update(_moe_config_from_qwen3(hf))
        return c
    if mt == "gpt2" or (mt is None and "n_embd" in hf):
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"GPT-2 activation_function '{act}' is not the tanh GELU megacore implements")
        h = int(hf["n_embd"])
        return {"num_layers": int(hf["n_layer"]), "hidden_size": h, "num_attention_heads": int(hf["n_head"]),
                "num_query_groups": int(hf["n_head"]), "ffn_hidden_size": int(hf.get("n_inner") or 4 * h),
                "kv_channels": h // int(hf["n_head"]), "vocab_size": int(hf["vocab_size"]),
                "max_position_embeddings": int(hf.get("n_positions", 1024)),
                "normalization": "LayerNorm", "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
                "activation": "GELU", "add_bias_linear": True,
                "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
                "position_embedding": "Learned", "rope_theta": 10000.0, "rope_scaling": {"type": "None"},
                "init_method_std": float(hf.get("initializer_range", 0.02)), "params_dtype": params_dtype}
    raise ConfigError(f"model_type '{mt}' is not supported; megacore converts Llama-family (llama, mistral), "
                      "Mixtral, Qwen3 (qwen3, qwen3_moe) and GPT-2 checkpoints")


def _flavour(c: Mapping[str, Any]) -> str:
    llama = (c["normalization"], c["activation"], c["position_embedding"], c["add_bias_linear"]) == \
        ("RMSNorm", "SwiGLU", "RoPE", False)
    gpt2 = (c["normalization"], c["activation"], c["position_embedding"], c["add_bias_linear"]) == \
        ("LayerNorm", "GELU", "Learned", True)
    if llama and c.get("qk_layernorm"):
        return "qwen3_moe" if _is_moe(c) else "qwen3"
    if llama:
        return "mixtral" if _is_moe(c) else "llama"
    if gpt2:
        return "gpt2"
    raise ConfigError("this megacore model is neither Llama-shaped (RMSNorm, SwiGLU, RoPE, no bias) nor GPT-2-shaped "
                      f"(LayerNorm, GELU, learned positions, biases): {dict(c)}; no Hugging Face class matches it")


_TORCH_DTYPE = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


HF_FORMAT_VERSION = "5.0.0"  # the transformers release whose config.json layout (rope_parameters, dtype) we write


def config_to_hf(c: Mapping[str, Any], special: Optional[Mapping[str, Optional[int]]] = None) -> Dict[str, Any]:
    """The config.json that transformers >= 5 writes for this model (``rope_parameters``, ``dtype``, the special
    token ids, ``architectures``, ``head_dim``, ...). ``special``: {"bos_token_id", "eos_token_id",
    "pad_token_id"} (None where the tokenizer has no such token)."""
    dt = _TORCH_DTYPE.get(str(c.get("params_dtype", "f32")).lower(), "float32")
    ids = {k: (special or {}).get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    flavour = _flavour(c)
    if flavour in ("llama", "mixtral", "qwen3", "qwen3_moe"):
        rs = c.get("rope_scaling") or {"type": "None"}
        rope = {"rope_theta": float(c["rope_theta"]), "rope_type": "default"}
        if str(rs.get("type", "None")).lower() == "llama3":
            rope = {"rope_theta": float(c["rope_theta"]), "rope_type": "llama3", "factor": float(rs["factor"]),
                    "low_freq_factor": float(rs["low_freq_factor"]), "high_freq_factor": float(rs["high_freq_factor"]),
                    "original_max_position_embeddings": int(rs["original_max_position_embeddings"])}
        heads = c["num_attention_heads"]
        if flavour == "mixtral":
            return _mixtral_config_to_hf(c, rope, ids, dt)
        if flavour in ("qwen3", "qwen3_moe"):
            return _qwen3_config_to_hf(c, rope, ids, dt)
        return {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, **ids,
                "dtype": dt, "head_dim": c.get("kv_channels") or c["hidden_size"] // heads, "hidden_act": "silu",
                "hidden_size": c["hidden_size"], "initializer_range": c.get("init_method_std", 0.02),
                "intermediate_size": c["ffn_hidden_size"], "max_position_embeddings": c["max_position_embeddings"],
                "mlp_bias": False, "model_type": "llama", "num_attention_heads": heads,
                "num_hidden_layers": c["num_layers"], "num_key_value_heads": c.get("num_query_groups") or heads,
                "pretraining_tp": 1, "rms_norm_eps": c["norm_eps"], "rope_parameters": rope,
                "tie_word_embeddings": bool(c["tie_word_embeddings"]), "transformers_version": HF_FORMAT_VERSION,
                "use_cache": True, "vocab_size": c["vocab_size"]}
    h = c["hidden_size"]
    return {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.0, **ids,
            "dtype": dt, "embd_pdrop": 0.0, "initializer_range": c.get("init_method_std", 0.02),
            "layer_norm_epsilon": c["norm_eps"], "model_type": "gpt2", "n_ctx": c["max_position_embeddings"],
            "n_embd": h, "n_head": c["num_attention_heads"], "n_inner": c["ffn_hidden_size"] or 4 * h,
            "n_layer": c["num_layers"], "n_positions": c["max_position_embeddings"], "reorder_and_upcast_attn": False,
            "resid_pdrop": 0.0, "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
            "tie_word_embeddings": bool(c["tie_word_embeddings"]), "transformers_version": HF_FORMAT_VERSION,
            "use_cache": True, "vocab_size": c["vocab_size"]}


def _mixtral_config_to_hf(c: Mapping[str, Any], rope: Mapping[str, Any], ids: Mapping[str, Any], dt: str):
    """config.json of MixtralForCausalLM (as transformers >= 5 writes it) for a Llama-shaped MoE model."""
    _check_mixtral_compatible(c)
    if rope.get("rope_type") != "default":
        raise ConfigError(f"rope_scaling {c.get('rope_scaling')} has no MixtralForCausalLM equivalent (Mixtral uses "
                          "plain RoPE); export a model without RoPE scaling")
    heads, k = c["num_attention_heads"], int(c.get("moe_router_topk", 2))
    ffn = int(c.get("moe_ffn_hidden_size") or 0) or int(c["ffn_hidden_size"])
    return {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, **ids, "dtype": dt,
            "head_dim": c.get("kv_channels") or c["hidden_size"] // heads, "hidden_act": "silu",
            "hidden_size": c["hidden_size"], "initializer_range": c.get("init_method_std", 0.02),
            "intermediate_size": ffn, "max_position_embeddings": c["max_position_embeddings"],
            "model_type": "mixtral", "num_attention_heads": heads, "num_experts_per_tok": k,
            "num_hidden_layers": c["num_layers"], "num_key_value_heads": c.get("num_query_groups") or heads,
            "num_local_experts": int(c["num_moe_experts"]), "output_router_logits": False,
            "rms_norm_eps": c["norm_eps"], "rope_parameters": dict(rope),
            "router_aux_loss_coef": float(c.get("moe_aux_loss_coeff", 0.0)) / k, "router_jitter_noise": 0.0,
            "sliding_window": None, "tie_word_embeddings": bool(c["tie_word_embeddings"]),
            "transformers_version": HF_FORMAT_VERSION, "use_cache": True, "vocab_size": c["vocab_size"]}


def _check_qwen3_moe_compatible(c: Mapping[str, Any]) -> None:
    """Refuses MoE settings that Qwen3MoeForCausalLM cannot express."""
    bad = [f"{k} = {c.get(k, v)} (Qwen3-MoE: {v})" for k, v in _QWEN3_MOE.items()
           if not (str(c.get(k, v)).lower() == v if isinstance(v, str) else c.get(k, v) == v)]
    if bad:
        raise ConfigError("this MoE model with qk_layernorm has no Hugging Face Qwen3-MoE equivalent: " + "; ".join(bad) +
                          ". Only softmax routing, every layer MoE, no shared expert and no expert bias export as "
                          "Qwen3MoeForCausalLM")


def _qwen3_config_to_hf(c: Mapping[str, Any], rope: Mapping[str, Any], ids: Mapping[str, Any], dt: str):
    """config.json of Qwen3ForCausalLM / Qwen3MoeForCausalLM (as transformers >= 5 writes it) for a Llama-shaped
    model with qk_layernorm."""
    heads = c["num_attention_heads"]
    out = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, **ids,
           "dtype": dt, "head_dim": c.get("kv_channels") or c["hidden_size"] // heads, "hidden_act": "silu",
           "hidden_size": c["hidden_size"], "initializer_range": c.get("init_method_std", 0.02),
           "intermediate_size": c["ffn_hidden_size"], "max_position_embeddings": c["max_position_embeddings"],
           "max_window_layers": c["num_layers"], "model_type": "qwen3", "num_attention_heads": heads,
           "num_hidden_layers": c["num_layers"], "num_key_value_heads": c.get("num_query_groups") or heads,
           "rms_norm_eps": c["norm_eps"], "rope_parameters": dict(rope), "sliding_window": None,
           "tie_word_embeddings": bool(c["tie_word_embeddings"]), "transformers_version": HF_FORMAT_VERSION,
           "use_cache": True, "use_sliding_window": False, "vocab_size": c["vocab_size"]}
    if not _is_moe(c):
        return out
    _check_qwen3_moe_compatible(c)
    k = int(c.get("moe_router_topk", 2))
    out.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "decoder_sparse_step": 1,
                "mlp_only_layers": [], "moe_intermediate_size": int(c.get("moe_ffn_hidden_size") or 0) or
                int(c["ffn_hidden_size"]), "norm_topk_prob": not bool(c.get("moe_router_pre_softmax", False)),
                "num_experts": int(c["num_moe_experts"]), "num_experts_per_tok": k, "output_router_logits": False,
                "router_aux_loss_coef": float(c.get("moe_aux_loss_coeff", 0.0)) / k})
    return out


def generation_config_to_hf(special: Optional[Mapping[str, Optional[int]]] = None) -> Dict[str, Any]:
    """generation_config.json as transformers writes it for a model config (only the ids that exist)."""
    out: Dict[str, Any] = {"_from_model_config": True}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if (special or {}).get(k) is not None:
            out[k] = int(special[k])
    out["transformers_version"] = HF_FORMAT_VERSION
    return out


def config_dict(cfg) -> Dict[str, Any]:
    """The JSON form of a megacore.model.TransformerConfig (what the "config" blob holds)."""
    rs = cfg.rope_scaling
    d = {k: getattr(cfg, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
        "vocab_size", "max_position_embeddings", "make_vocab_size_divisible_by", "norm_eps", "add_bias_linear",
        "tie_word_embeddings", "rope_theta", "init_method_std", "params_dtype", "seed", "qk_layernorm")}
    d["num_query_groups"] = cfg.query_groups
    d["ffn_hidden_size"] = cfg.ffn_size
    d["kv_channels"] = cfg.head_dim
    d["normalization"] = cfg.normalization.name
    d["activation"] = cfg.activation.name
    d["position_embedding"] = cfg.position_embedding.name
    d["rope_scaling"] = {"type": rs.type.name, "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                         "high_freq_factor": rs.high_freq_factor,
                         "original_max_position_embeddings": rs.original_max_position_embeddings}
    if cfg.num_moe_experts > 0:
        d.update({k: getattr(cfg, k) for k in MOE_FIELDS})
        d["moe_router_score_function"] = cfg.moe_router_score_function.name
    return d


# The TransformerConfig MoE fields that conversion carries (dense models leave them out).
MOE_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_aux_loss_coeff",
              "moe_z_loss_coeff", "moe_shared_expert_size", "moe_router_score_function", "moe_router_pre_softmax",
              "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias")


def transformer_config(d: Mapping[str, Any]):
    """megacore.model.TransformerConfig from its JSON form."""
    from . import model

    d = dict(d)
    rs = d.pop("rope_scaling", None) or {"type": "None"}
    cfg = model.TransformerConfig(**d)
    r = model.RopeScaling()
    r.type = model.RopeScalingType(rs["type"])
    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if k in rs:
            setattr(r, k, rs[k])
    cfg.rope_scaling = r
    return cfg


def _blob(v):
    """A JSON blob of metadata.json: the C++ writer stores objects; text is parsed too."""
    if isinstance(v, str):
        try:
            return json.loads(v)
        except ValueError as e:
            raise MegacoreIOError(f"a JSON blob of the checkpoint is not valid JSON ({e})") from e
    return v


def config_from_recipe(recipe: Mapping[str, Any]) -> Dict[str, Any]:
    """The TransformerConfig dict (``config_dict`` form) of the recipe JSON the trainer stores in each checkpoint
    (``metadata.json`` → ``json`` → ``recipe``). Fields are read by name, with the recipe defaults where absent
    (0 means derived: query groups = heads, FFN = 4 × hidden, head dim = hidden / heads); extra fields are
    ignored."""
    m = recipe.get("model")
    if not isinstance(m, Mapping):
        raise ConfigError("the checkpoint's recipe has no 'model' section; it was not written by megacore train")
    for k in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if k not in m:
            raise ConfigError(f"the checkpoint's recipe lacks model.{k}")
    g = m.get
    heads, h = int(g("num_attention_heads")), int(g("hidden_size"))
    rs_type = str(g("rope_scaling", "none") or "none").lower()
    if rs_type not in ("none", "llama3"):
        raise ConfigError(f"model.rope_scaling '{rs_type}' is not none or llama3")
    precision = str((recipe.get("trainer") or {}).get("precision", "f32")).lower()
    return {"num_layers": int(g("num_layers")), "hidden_size": h, "num_attention_heads": heads,
            "num_query_groups": int(g("num_query_groups", 0) or heads),
            "ffn_hidden_size": int(g("ffn_hidden_size", 0) or 4 * h),
            "kv_channels": int(g("kv_channels", 0) or h // heads), "vocab_size": int(g("vocab_size")),
            "max_position_embeddings": int(g("max_position_embeddings", 2048)),
            "make_vocab_size_divisible_by": int(g("make_vocab_size_divisible_by", 128)),
            "normalization": str(g("normalization", "RMSNorm")), "norm_eps": float(g("norm_eps", 1e-5)),
            "activation": str(g("activation", "SwiGLU")), "add_bias_linear": bool(g("add_bias_linear", False)),
            "tie_word_embeddings": bool(g("tie_word_embeddings", False)),
            "position_embedding": str(g("position_embedding", "RoPE")), "rope_theta": float(g("rope_theta", 10000.0)),
            "rope_scaling": {"type": "Llama3" if rs_type == "llama3" else "None",
                             "factor": float(g("rope_scaling_factor", 8.0)),
                             "low_freq_factor": float(g("rope_low_freq_factor", 1.0)),
                             "high_freq_factor": float(g("rope_high_freq_factor", 4.0)),
                             "original_max_position_embeddings": int(g("rope_original_max_position_embeddings", 8192))},
            "init_method_std": float(g("init_method_std", 0.02)), "params_dtype": precision,
            "seed": int(g("seed", 1234)), "qk_layernorm": bool(g("qk_layernorm", False)),
            **_moe_config_from_recipe(m)}


def _moe_config_from_recipe(m: Mapping[str, Any]) -> Dict[str, Any]:
    """The MoE fields of a recipe's model section (none for a dense model); recipe defaults where absent."""
    if int(m.get("num_moe_experts", 0) or 0) <= 0:
        return {}
    defaults = {"moe_router_topk": 2, "moe_ffn_hidden_size": 0, "moe_layer_freq": 1, "moe_aux_loss_coeff": 0.0,
                "moe_z_loss_coeff": 0.0, "moe_shared_expert_size": 0, "moe_router_score_function": "softmax",
                "moe_router_pre_softmax": False, "moe_router_topk_scaling_factor": 1.0,
                "moe_router_enable_expert_bias": False}
    out = {"num_moe_experts": int(m["num_moe_experts"])}
    for k, v in defaults.items():
        got = m.get(k, v)
        out[k] = str(got).lower() if isinstance(v, str) else type(v)(got)
    return out


def _checkpoint_meta(ckpt: str) -> Tuple[str, Dict[str, Any]]:
    from .checkpoint import resolve_checkpoint

    d = resolve_checkpoint(ckpt)
    if d is None:
        raise MegacoreIOError(f"'{ckpt}' holds no complete megacore checkpoint (no metadata.json, no valid `latest`, "
                              "no complete step_<N>)")
    with open(os.path.join(d, "metadata.json")) as f:
        return d, json.load(f)


def _checkpoint_blobs(ckpt: str) -> Tuple[str, Dict[str, Any]]:
    d, meta = _checkpoint_meta(ckpt)
    return d, dict(meta.get("json") or {})


def config_from_checkpoint(ckpt: str) -> Dict[str, Any]:
    """The TransformerConfig dict of a checkpoint: its "config" blob (conversion tools, ``megacore.checkpoint``
    saves) or, for checkpoints written by ``megacore train``, the model section of its "recipe" blob."""
    d, meta = _checkpoint_meta(ckpt)
    blobs = dict(meta.get("json") or {})
    if "config" in blobs:
        return _blob(blobs["config"])
    if "recipe" in blobs:
        c = config_from_recipe(_blob(blobs["recipe"]))
        if c["params_dtype"] == "auto":  # trainer.precision auto: the dtype the run's weights were saved in
            emb = (meta.get("tensors") or {}).get("embedding.weight") or {}
            c["params_dtype"] = str(emb.get("dtype", "f32")).lower()
        return c
    raise MegacoreIOError(f"{d}: the checkpoint has neither a 'config' nor a 'recipe' JSON blob, so its model is "
                          "unknown; save it with json={'config': megacore.convert.config_dict(cfg)} to export it")


# ----------------------------------------------------------------------------- tokenizer

# The built-in byte tokenizer (megacore.tokenizers.ByteTokenizer): UTF-8 bytes are ids 0..255.
BYTE_SPECIAL = {"bos_token_id": 258, "eos_token_id": 256, "pad_token_id": 257}

_SPECIAL_NAMES = {
    "eos_token_id": ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]"),
    "bos_token_id": ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]"),
    "pad_token_id": ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>"),
}


def tokenizer_json_special_ids(path: str) -> Dict[str, Optional[int]]:
    """bos/eos/pad ids of a Hugging Face tokenizer.json, found by the usual token names (the same rule as
    ``megacore.tokenizers.HFTokenizer``), read from the JSON itself (the ``tokenizers`` package is not needed)."""
    try:
        with open(path, encoding="utf-8") as f:
            tj = json.load(f)
    except (OSError, ValueError) as e:
        raise MegacoreIOError(f"cannot read tokenizer '{path}' ({e}); it must be a Hugging Face tokenizer.json") from e
    vocab: Dict[str, int] = {}
    model_vocab = (tj.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab.update({k: int(v) for k, v in model_vocab.items() if isinstance(v, int)})
    for t in tj.get("added_tokens") or []:
        if isinstance(t, dict) and "content" in t and "id" in t:
            vocab[t["content"]] = int(t["id"])
    out: Dict[str, Optional[int]] = {}
    for key, names in _SPECIAL_NAMES.items():
        out[key] = next((vocab[n] for n in names if n in vocab), None)
    return out


def _tokenizer_token(path: str, i: Optional[int]) -> Optional[str]:
    if i is None:
        return None
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    for t in tj.get("added_tokens") or []:
        if isinstance(t, dict) and t.get("id") == i:
            return t.get("content")
    for k, v in ((tj.get("model") or {}).get("vocab") or {}).items():
        if v == i:
            return k
    return None


def _write_tokenizer(tok_path: str, out_dir: str, special: Mapping[str, Optional[int]], max_len: int) -> list:
    """Copies tokenizer.json (and tokenizer_config.json / special_tokens_map.json when they sit next to it) into
    out_dir; writes a tokenizer_config.json naming the special tokens when there is none. Returns the files."""
    import shutil

    src_dir = os.path.dirname(os.path.abspath(tok_path))
    written = ["tokenizer.json"]
    shutil.copyfile(tok_path, os.path.join(out_dir, "tokenizer.json"))
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):
        src = os.path.join(src_dir, extra)
        if os.path.isfile(src) and os.path.basename(tok_path) == "tokenizer.json":
            shutil.copyfile(src, os.path.join(out_dir, extra))
            written.append(extra)
    if "tokenizer_config.json" not in written:
        cfg: Dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(max_len),
                               "clean_up_tokenization_spaces": False}
        for key, name in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"), ("pad_token_id", "pad_token")):
            tok = _tokenizer_token(tok_path, special.get(key))
            if tok is not None:
                cfg[name] = tok
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        written.append("tokenizer_config.json")
    return written


# ----------------------------------------------------------------------------- tensors

def _read_hf_tensors(hf_dir: str) -> Dict[str, np.ndarray]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    files = []
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise MegacoreIOError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json (PyTorch .bin "
                              "checkpoints are not read; re-save with safe_serialization=True)")
    out = {}
    for fn in files:
        r = SafetensorsReader(os.path.join(hf_dir, fn))
        for n in r.names():
            out[n] = r.get(n)
    return out


# Per-expert tensor names of the two MoE families: (router, expert prefix with {} for the expert, gate, up, down),
# relative to a layer's HF prefix.
_MIXTRAL_EXPERT_NAMES = ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.", "w1", "w3", "w2")
_QWEN3_EXPERT_NAMES = ("mlp.gate.weight", "mlp.experts.{}.", "gate_proj", "up_proj", "down_proj")


def _experts_to_megacore(take, hf: Mapping[str, np.ndarray], p: str, m: str, e: int, names) -> Dict[str, np.ndarray]:
    """One MoE layer's router and experts (HF prefix ``p``) → megacore's MoE tensors (prefix ``m``).

    Hub checkpoints (and transformers' save_pretrained) hold the router [E, H] and per expert gate / up [F, H] and
    down [H, F] (Mixtral: ``block_sparse_moe.gate``, ``experts.{e}.w1`` / ``w3`` / ``w2``; Qwen3-MoE: ``mlp.gate``,
    ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``); the modules of transformers >= 5 hold them fused
    (a raw state_dict has these names): ``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` [E, 2F, H] (gate rows,
    then up rows) and ``mlp.experts.down_proj`` [E, H, F].
    megacore's ``mlp.experts.linear_fc1.weight`` is [E, 2F, H] with each expert's [gate; up] rows (its SwiGLU
    layout), ``linear_fc2`` [E, H, F]; both layouts map without any arithmetic."""
    if p + "mlp.experts.gate_up_proj" in hf:
        return {m + "mlp.router.weight": take(p + "mlp.gate.weight"),
                m + "mlp.experts.linear_fc1.weight": take(p + "mlp.experts.gate_up_proj"),
                m + "mlp.experts.linear_fc2.weight": take(p + "mlp.experts.down_proj")}
    router, expert, gate, up, down = names
    x = [p + expert.format(j) for j in range(e)]
    return {m + "mlp.router.weight": take(p + router),
            m + "mlp.experts.linear_fc1.weight": _stack([_cat([take(q + gate + ".weight"), take(q + up + ".weight")])
                                                         for q in x]),
            m + "mlp.experts.linear_fc2.weight": _stack([take(q + down + ".weight") for q in x])}


def _experts_to_hf(take, p: str, m: str, e: int, names) -> Dict[str, np.ndarray]:
    """Inverse of _experts_to_megacore, in the hub layout of ``names``."""
    fc1, fc2 = take(m + "mlp.experts.linear_fc1.weight"), take(m + "mlp.experts.linear_fc2.weight")
    if fc1.shape[0] != e or fc2.shape[0] != e:
        raise ConfigError(f"'{m}mlp.experts.*' hold {fc1.shape[0]} experts but the model config says {e}")
    f = fc1.shape[1] // 2
    router, expert, gate, up, down = names
    out = {p + router: take(m + "mlp.router.weight")}
    a1, a2 = np.asarray(fc1), np.asarray(fc2)
    for j in range(e):
        q = p + expert.format(j)
        out[q + gate + ".weight"] = _keep(np.ascontiguousarray(a1[j, :f]), fc1)
        out[q + up + ".weight"] = _keep(np.ascontiguousarray(a1[j, f:]), fc1)
        out[q + down + ".weight"] = _keep(np.ascontiguousarray(a2[j]), fc2)
    return out


def hf_state_to_megacore(hf: Mapping[str, np.ndarray], c: Mapping[str, Any]) -> Dict[str, np.ndarray]:
    """HF tensor names/layouts → megacore's (whole tensors)."""
    def take(name):
        if name not in hf:
            raise MegacoreIOError(f"the Hugging Face checkpoint lacks '{name}' (it has {len(hf)} tensors, e.g. "
                                  f"{', '.join(list(hf)[:4])})")
        return hf[name]

    out: Dict[str, np.ndarray] = {}
    L, heads, groups = c["num_layers"], c["num_attention_heads"], c["num_query_groups"]
    flavour = _flavour(c)
    if flavour in ("llama", "mixtral", "qwen3", "qwen3_moe"):
        out["embedding.weight"] = take("model.embed_tokens.weight")
        for i in range(L):
            p, m = f"model.layers.{i}.", f"layers.{i}."
            out[m + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
            out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
                take(p + "self_attn.q_proj.weight"), take(p + "self_attn.k_proj.weight"),
                take(p + "self_attn.v_proj.weight"), heads, groups)
            if c.get("qk_layernorm"):
                out[m + "self_attention.q_layernorm.weight"] = take(p + "self_attn.q_norm.weight")
                out[m + "self_attention.k_layernorm.weight"] = take(p + "self_attn.k_norm.weight")
            out[m + "self_attention.linear_proj.weight"] = take(p + "self_attn.o_proj.weight")
            out[m + "pre_mlp_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
            if _is_moe(c):
                names = _QWEN3_EXPERT_NAMES if flavour == "qwen3_moe" else _MIXTRAL_EXPERT_NAMES
                out.update(_experts_to_megacore(take, hf, p, m, int(c["num_moe_experts"]), names))
                continue
            out[m + "mlp.linear_fc1.weight"] = _cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            out[m + "mlp.linear_fc2.weight"] = take(p + "mlp.down_proj.weight")
        out["final_layernorm.weight"] = take("model.norm.weight")
        if not c["tie_word_embeddings"]:
            out["output_layer.weight"] = take("lm_head.weight")
        return out
    hf = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in hf.items()}
    out["embedding.weight"] = take("wte.weight")
    out["position_embedding.weight"] = take("wpe.weight")
    for i in range(L):
        p, m = f"h.{i}.", f"layers.{i}."
        for src, dst in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            out[m + dst + ".weight"] = take(p + src + ".weight")
            out[m + dst + ".bias"] = take(p + src + ".bias")
        w = _t(take(p + "attn.c_attn.weight"))  # [3h, h] = [q; k; v]
        b = take(p + "attn.c_attn.bias")
        h = w.shape[1]
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(w[:h], w[h:2 * h], w[2 * h:], heads, heads)
        out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(b[:h], b[h:2 * h], b[2 * h:], heads, heads)
        out[m + "self_attention.linear_proj.weight"] = _t(take(p + "attn.c_proj.weight"))
        out[m + "self_attention.linear_proj.bias"] = take(p + "attn.c_proj.bias")
        out[m + "mlp.linear_fc1.weight"] = _t(take(p + "mlp.c_fc.weight"))
        out[m + "mlp.linear_fc1.bias"] = take(p + "mlp.c_fc.bias")
        out[m + "mlp.linear_fc2.weight"] = _t(take(p + "mlp.c_proj.weight"))
        out[m + "mlp.linear_fc2.bias"] = take(p + "mlp.c_proj.bias")
    out["final_layernorm.weight"] = take("ln_f.weight")
    out["final_layernorm.bias"] = take("ln_f.bias")
    if not c["tie_word_embeddings"]:
        out["output_layer.weight"] = take("lm_head.weight")
    return out


def megacore_state_to_hf(t: Mapping[str, np.ndarray], c: Mapping[str, Any]) -> Dict[str, np.ndarray]:
    """megacore's whole tensors → HF names/layouts."""
    def take(name):
        if name not in t:
            raise MegacoreIOError(f"the megacore checkpoint lacks '{name}'; was it saved from this model config?")
        return t[name]

    out: Dict[str, np.ndarray] = {}
    L, heads, groups = c["num_layers"], c["num_attention_heads"], c["num_query_groups"]
    flavour = _flavour(c)
    if _is_moe(c):  # before any tensor is looked up: a model with dense layers between MoE ones is refused here
        (_check_qwen3_moe_compatible if flavour == "qwen3_moe" else _check_mixtral_compatible)(c)
    if flavour in ("llama", "mixtral", "qwen3", "qwen3_moe"):
        out["model.embed_tokens.weight"] = take("embedding.weight")
        f = c["ffn_hidden_size"]
        for i in range(L):
            p, m = f"model.layers.{i}.", f"layers.{i}."
            out[p + "input_layernorm.weight"] = take(m + "input_layernorm.weight")
            q, k, v = split_qkv(take(m + "self_attention.linear_qkv.weight"), heads, groups)
            out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
            out[p + "self_attn.v_proj.weight"] = v
            if c.get("qk_layernorm"):
                out[p + "self_attn.q_norm.weight"] = take(m + "self_attention.q_layernorm.weight")
                out[p + "self_attn.k_norm.weight"] = take(m + "self_attention.k_layernorm.weight")
            out[p + "self_attn.o_proj.weight"] = take(m + "self_attention.linear_proj.weight")
            out[p + "post_attention_layernorm.weight"] = take(m + "pre_mlp_layernorm.weight")
            if _is_moe(c):
                names = _QWEN3_EXPERT_NAMES if flavour == "qwen3_moe" else _MIXTRAL_EXPERT_NAMES
                out.update(_experts_to_hf(take, p, m, int(c["num_moe_experts"]), names))
                continue
            fc1 = take(m + "mlp.linear_fc1.weight")
            out[p + "mlp.gate_proj.weight"] = _keep(np.ascontiguousarray(fc1[:f]), fc1)
            out[p + "mlp.up_proj.weight"] = _keep(np.ascontiguousarray(fc1[f:]), fc1)
            out[p + "mlp.down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
        out["model.norm.weight"] = take("final_layernorm.weight")
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = take("output_layer.weight")
        return out
    out["transformer.wte.weight"] = take("embedding.weight")
    out["transformer.wpe.weight"] = take("position_embedding.weight")
    for i in range(L):
        p, m = f"transformer.h.{i}.", f"layers.{i}."
        for dst, src in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            out[p + dst + ".weight"] = take(m + src + ".weight")
            out[p + dst + ".bias"] = take(m + src + ".bias")
        q, k, v = split_qkv(take(m + "self_attention.linear_qkv.weight"), heads, heads)
        out[p + "attn.c_attn.weight"] = _t(_cat([q, k, v]))
        qb, kb, vb = split_qkv(take(m + "self_attention.linear_qkv.bias"), heads, heads)
        out[p + "attn.c_attn.bias"] = _cat([qb, kb, vb])
        out[p + "attn.c_proj.weight"] = _t(take(m + "self_attention.linear_proj.weight"))
        out[p + "attn.c_proj.bias"] = take(m + "self_attention.linear_proj.bias")
        out[p + "mlp.c_fc.weight"] = _t(take(m + "mlp.linear_fc1.weight"))
        out[p + "mlp.c_fc.bias"] = take(m + "mlp.linear_fc1.bias")
        out[p + "mlp.c_proj.weight"] = _t(take(m + "mlp.linear_fc2.weight"))
        out[p + "mlp.c_proj.bias"] = take(m + "mlp.linear_fc2.bias")
    out["transformer.ln_f.weight"] = take("final_layernorm.weight")
    out["transformer.ln_f.bias"] = take("final_layernorm.bias")
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = take("output_layer.weight")
    return out


_PARAMS_DTYPE = {"F32": "f32", "BF16": "bf16", "F16": "f16"}


# ----------------------------------------------------------------------------- entry points

def hf_to_megacore(hf_dir: str, out_root: str, step: int = 0) -> str:
    """Converts a Hugging Face model directory into a megacore checkpoint under ``out_root``; returns its
    directory (``out_root/step_<step>``, with ``latest`` pointing at it)."""
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise MegacoreIOError(f"{hf_dir}: no config.json; pass a Hugging Face model directory")
    with open(cfg_path) as f:
        hf_cfg = json.load(f)
    hf = _read_hf_tensors(hf_dir)
    dts = {dtype_name(a) for a in hf.values()}
    if len(dts) != 1 or next(iter(dts)) not in _PARAMS_DTYPE:
        raise ConfigError(f"{hf_dir}: tensors have dtypes {sorted(dts)}; megacore needs one of F32/BF16/F16 for all")
    c = config_from_hf(hf_cfg, _PARAMS_DTYPE[next(iter(dts))])
    tensors = hf_state_to_megacore(hf, c)
    return save_full_checkpoint(out_root, step, tensors, {"config": c, "hf_config": hf_cfg})


def _model_tensor_names(meta: Mapping[str, Any]) -> list:
    """The model's parameters among a checkpoint's tensors: optimizer state (``optimizer.*``, also ZeRO's) is not
    exported."""
    return [n for n in meta["tensors"] if not n.startswith("optimizer.")]


def _strip_vocab_padding(t: Dict[str, np.ndarray], c: Mapping[str, Any]) -> None:
    vocab = int(c["vocab_size"])
    for name in ("embedding.weight", "output_layer.weight"):
        if name in t:
            a = t[name]
            if a.shape[0] < vocab:
                raise MegacoreIOError(f"'{name}' has {a.shape[0]} rows but the model's vocab_size is {vocab}")
            if a.shape[0] > vocab:  # padding rows (make_vocab_size_divisible_by × TP) are not part of the model
                t[name] = _keep(np.ascontiguousarray(a[:vocab]), a)


def _check_shapes(t: Mapping[str, np.ndarray], c: Mapping[str, Any]) -> None:
    """The layer-0 shapes agree with the config (a wrong config would otherwise split tensors silently wrong)."""
    heads, groups, d, h = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"], c["hidden_size"]
    gated = 2 if c["activation"] == "SwiGLU" else 1
    f = c["ffn_hidden_size"] * gated
    want = {"layers.0.self_attention.linear_qkv.weight": ((heads + 2 * groups) * d, h),
            "layers.0.mlp.linear_fc1.weight": (f, h), "embedding.weight": (c["vocab_size"], h)}
    if c.get("qk_layernorm"):
        want.update({"layers.0.self_attention.q_layernorm.weight": (d,), "layers.0.self_attention.k_layernorm.weight": (d,)})
    if _is_moe(c):  # layer 0 is a MoE layer whenever the model has any
        e, fm = int(c["num_moe_experts"]), int(c.get("moe_ffn_hidden_size") or 0) or c["ffn_hidden_size"]
        want.update({"layers.0.mlp.router.weight": (e, h),
                     "layers.0.mlp.experts.linear_fc1.weight": (e, fm * gated, h),
                     "layers.0.mlp.experts.linear_fc2.weight": (e, h, fm)})
    for name, shape in want.items():
        if name in t and tuple(t[name].shape) != shape:
            raise ConfigError(f"the checkpoint's '{name}' is {list(t[name].shape)} but its model config says "
                              f"{list(shape)}; the config does not describe these weights")


def megacore_to_hf(ckpt: str, out_dir: str, max_shard_size: int = 5 * 1024 ** 3, tokenizer: Optional[str] = None,
                   log=print, base: Optional[str] = None) -> str:
    """Exports the megacore checkpoint at ``ckpt`` (a step directory, or a root such as a run's ``checkpoints``
    folder: its ``latest``) as a Hugging Face model directory ``out_dir``: config.json and
    generation_config.json as transformers >= 5 writes them, model.safetensors (or model-0000k-of-0000n
    .safetensors + index above ``max_shard_size`` bytes) and, when the run used a ``tokenizer.json``, the
    tokenizer files. Works for checkpoints of ``megacore train`` (model from the stored recipe) and of the
    conversion tools (the "config" blob). ``tokenizer``: "byte" or a tokenizer.json path, overriding the
    recipe's ``data.tokenizer``. Vocabulary padding rows are dropped. A LoRA checkpoint (adapters only: a LoRA
    run's, or one ``megacore.peft.import_peft`` wrote) exports its base model with the adapters merged in
    (W + alpha/r · B A); the base is the run's ``checkpoint.pretrained_checkpoint`` unless ``base`` names it.
    Returns ``out_dir``."""
    from .checkpoint import _metadata

    from . import peft

    say = log or (lambda *_: None)
    d, blobs = _checkpoint_blobs(ckpt)
    recipe = _blob(blobs["recipe"]) if "recipe" in blobs else {}
    tok_spec = tokenizer if tokenizer is not None else (recipe.get("data") or {}).get("tokenizer")
    adapter = peft.read_adapter(d, base) if peft.is_lora_checkpoint(d) else None
    if adapter is not None:  # a LoRA run: its base's weights with the adapters folded in
        tensors, c, weights_dir = peft.load_base(adapter)
        tensors = peft.merge_state(tensors, adapter, c)
        say(f"merged the LoRA adapters of {d} (r={adapter.lora.dim}, alpha={adapter.lora.alpha:g}, "
            f"{len(adapter.modules())} modules) into the base {weights_dir}")
    else:
        c = dict(config_from_checkpoint(d))
        tensors, _ = load_full_checkpoint(d, names=_model_tensor_names(_metadata(d)))
    meta = _metadata(d)
    emb = tensors.get("embedding.weight")
    if emb is not None:  # the stored weights' dtype is what is exported
        c["params_dtype"] = _PARAMS_DTYPE.get(dtype_name(emb), c.get("params_dtype", "f32"))
    _strip_vocab_padding(tensors, c)
    _check_shapes(tensors, c)
    hf = megacore_state_to_hf(tensors, c)

    special: Dict[str, Optional[int]] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    tok_path = None
    if tok_spec == "byte":
        special = dict(BYTE_SPECIAL)
    elif tok_spec:
        tok_path = os.path.join(tok_spec, "tokenizer.json") if os.path.isdir(tok_spec) else tok_spec
        if not os.path.isfile(tok_path):
            raise MegacoreIOError(f"the run's tokenizer '{tok_spec}' does not exist here; pass its path with "
                                  "--tokenizer PATH (tokenizer=...) so the exported model gets its tokenizer files")
        special = tokenizer_json_special_ids(tok_path)

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_to_hf(c, special), f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation_config_to_hf(special), f, indent=2)
    shards, cur, size = [], {}, 0
    for name, a in hf.items():
        if cur and size + a.nbytes > max_shard_size:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = a
        size += a.nbytes
    shards.append(cur)
    if len(shards) == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), shards[0], {"format": "pt"})
    else:
        weight_map = {}
        for k, sh in enumerate(shards):
            fn = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(out_dir, fn), sh, {"format": "pt"})
            weight_map.update({n: fn for n in sh})
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": int(sum(a.nbytes for a in hf.values()))}, "weight_map": weight_map},
                      f, indent=2)
    say(f"exported {d} (step {meta.get('step')}): {_flavour(c)}, {len(hf)} tensors, {c['params_dtype']}, "
        f"vocab {c['vocab_size']} -> {out_dir}")
    if tok_path:
        files = _write_tokenizer(tok_path, out_dir, special, c["max_position_embeddings"])
        say(f"tokenizer: copied {tok_path} ({', '.join(files)}); special ids {special}")
    elif tok_spec == "byte":
        say("tokenizer: the run used megacore's byte tokenizer, which has no Hugging Face tokenizer file, so none "
            "is written. Ids 0..255 are the UTF-8 bytes of the text, 256 is <eos> (eos_token_id), 257 <pad> "
            "(pad_token_id), 258 <bos> (bos_token_id); encode with list(text.encode('utf-8')) and decode with "
            "bytes(i for i in ids if i < 256).decode('utf-8', 'replace') (megacore.tokenizers.ByteTokenizer)")
    else:
        say("tokenizer: the checkpoint names no tokenizer; no tokenizer files are written and the special token ids "
            "are null (pass --tokenizer PATH to add them)")
    return out_dir


__all__ = ["hf_to_megacore", "megacore_to_hf", "fuse_qkv", "split_qkv", "config_from_hf", "config_to_hf",
           "generation_config_to_hf", "config_from_recipe", "tokenizer_json_special_ids",
           "config_dict", "transformer_config", "config_from_checkpoint", "hf_state_to_megacore",
           "megacore_state_to_hf"]
