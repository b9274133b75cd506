"""Hugging Face ↔ megacore conversion without torch: synthetic HF directories (Llama with GQA, tied and
untied, llama3 RoPE scaling, single-file and sharded with an index, f32 and bf16; GPT-2 with Conv1D
weights) convert to megacore and back bit-exactly, configs survive the round trip, the CLI works, and an
imported Llama gives the logits of an independent numpy forward written in HF's own layout (separate
q/k/v, rotate-half RoPE, [gate, up]) — which checks the QKV fusion and that no q/k permutation is needed.
Tolerance for that last check (f32 megacore vs f64 numpy): 1e-4 of the largest logit magnitude.
"""

import json
import os

import numpy as np
import pytest

from megacore import checkpoint as ck
from megacore import convert, cli


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32) * 0.1


def llama_hf_config(tied=False, scaling=True, new_style=False):
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "vocab_size": 50, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu",
         "tie_word_embeddings": tied}
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    if new_style:  # transformers >= 5
        c["rope_parameters"] = dict(rope, rope_theta=50000.0) if scaling else {"rope_type": "default",
                                                                             "rope_theta": 50000.0}
    else:
        c["rope_theta"] = 50000.0
        c["rope_scaling"] = rope if scaling else None
    return c


def llama_hf_tensors(c, rng):
    h, f, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    d, H, G = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    t = {"model.embed_tokens.weight": _rand(rng, V, h), "model.norm.weight": 1 + _rand(rng, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + _rand(rng, h), p + "post_attention_layernorm.weight": 1 + _rand(rng, h),
                  p + "self_attn.q_proj.weight": _rand(rng, H * d, h), p + "self_attn.k_proj.weight": _rand(rng, G * d, h),
                  p + "self_attn.v_proj.weight": _rand(rng, G * d, h), p + "self_attn.o_proj.weight": _rand(rng, h, H * d),
                  p + "mlp.gate_proj.weight": _rand(rng, f, h), p + "mlp.up_proj.weight": _rand(rng, f, h),
                  p + "mlp.down_proj.weight": _rand(rng, h, f)})
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = _rand(rng, V, h)
    return t


def gpt2_hf(rng):
    c = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 4,
         "n_positions": 32, "vocab_size": 40, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"}
    h = 16
    t = {"transformer.wte.weight": _rand(rng, 40, h), "transformer.wpe.weight": _rand(rng, 32, h),
         "transformer.ln_f.weight": 1 + _rand(rng, h), "transformer.ln_f.bias": _rand(rng, h)}
    for i in range(2):
        p = f"transformer.h.{i}."
        t.update({p + "ln_1.weight": 1 + _rand(rng, h), p + "ln_1.bias": _rand(rng, h), p + "ln_2.weight": 1 + _rand(rng, h),
                  p + "ln_2.bias": _rand(rng, h), p + "attn.c_attn.weight": _rand(rng, h, 3 * h),
                  p + "attn.c_attn.bias": _rand(rng, 3 * h), p + "attn.c_proj.weight": _rand(rng, h, h),
                  p + "attn.c_proj.bias": _rand(rng, h), p + "mlp.c_fc.weight": _rand(rng, h, 4 * h),
                  p + "mlp.c_fc.bias": _rand(rng, 4 * h), p + "mlp.c_proj.weight": _rand(rng, 4 * h, h),
                  p + "mlp.c_proj.bias": _rand(rng, h)})
    return c, t


def write_hf(d, config, tensors, shards=1):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    names = list(tensors)
    if shards == 1:
        ck.write_safetensors(os.path.join(d, "model.safetensors"), tensors)
        return
    wm = {}
    for k in range(shards):
        fn = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        ck.write_safetensors(os.path.join(d, fn), part)
        wm.update({n: fn for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)


def read_hf(d):
    files = ["model.safetensors"]
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        files = sorted(set(json.load(open(idx))["weight_map"].values()))
    out = {}
    for fn in files:
        out.update({k: np.array(v) for k, v in ck.read_safetensors(os.path.join(d, fn)).items()})
    return out


def assert_bit_equal(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert a[k].dtype == b[k].dtype, k
        assert np.array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8)), k


def test_fuse_split_qkv_layout():
    rng = np.random.default_rng(0)
    H, G, d, h = 8, 2, 3, 5
    wq, wk, wv = _rand(rng, H * d, h), _rand(rng, G * d, h), _rand(rng, G * d, h)
    w = convert.fuse_qkv(wq, wk, wv, H, G)
    # The documented layout, row by row: group g = [its H/G query heads; k_g; v_g], each head d rows.
    hpg, r = H // G, 0
    for g in range(G):
        for j in range(hpg):
            assert np.array_equal(w[r:r + d], wq[(g * hpg + j) * d:(g * hpg + j + 1) * d])
            r += d
        assert np.array_equal(w[r:r + d], wk[g * d:(g + 1) * d])
        assert np.array_equal(w[r + d:r + 2 * d], wv[g * d:(g + 1) * d])
        r += 2 * d
    for x, y in zip(convert.split_qkv(w, H, G), (wq, wk, wv)):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("tied,scaling,new_style,shards,bf16", [
    (False, True, False, 1, False), (True, False, True, 3, False), (False, True, True, 2, True)])
def test_llama_hf_round_trip_is_bit_exact(tmp_path, tied, scaling, new_style, shards, bf16):
    rng = np.random.default_rng(1)
    cfg = llama_hf_config(tied, scaling, new_style)
    t = llama_hf_tensors(cfg, rng)
    if bf16:
        t = {k: ck.BF16Array.from_float32(v) for k, v in t.items()}
    write_hf(tmp_path / "hf", cfg, t, shards)
    out = convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    assert out == str(tmp_path / "mc" / "step_0")
    c = convert.config_from_checkpoint(str(tmp_path / "mc"))
    assert (c["num_query_groups"], c["kv_channels"], c["tie_word_embeddings"]) == (2, 8, tied)
    assert c["rope_theta"] == 50000.0
    assert c["rope_scaling"]["type"] == ("Llama3" if scaling else "None")
    assert c["params_dtype"] == ("bf16" if bf16 else "f32")
    mc, _ = ck.load_full_checkpoint(str(tmp_path / "mc"))
    assert ("output_layer.weight" in mc) == (not tied)
    convert.megacore_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"), max_shard_size=4000 if shards > 1 else 1 << 30)
    assert_bit_equal(read_hf(tmp_path / "back"), {k: np.array(v) for k, v in t.items()})
    back_cfg = json.load(open(tmp_path / "back" / "config.json"))
    assert convert.config_from_hf(back_cfg, c["params_dtype"]) == {k: v for k, v in c.items()}
    # megacore → HF → megacore is bit-exact too.
    convert.hf_to_megacore(str(tmp_path / "back"), str(tmp_path / "mc2"))
    mc2, _ = ck.load_full_checkpoint(str(tmp_path / "mc2"))
    assert_bit_equal(mc2, mc)


def test_gpt2_round_trip_transposes_conv1d(tmp_path):
    rng = np.random.default_rng(2)
    cfg, t = gpt2_hf(rng)
    write_hf(tmp_path / "hf", cfg, t)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    mc, _ = ck.load_full_checkpoint(str(tmp_path / "mc"))
    w = t["transformer.h.0.attn.c_attn.weight"]  # [in, out]: output columns q | k | v
    q = w[:, :16].T
    assert np.array_equal(convert.split_qkv(mc["layers.0.self_attention.linear_qkv.weight"], 4, 4)[0], q)
    assert np.array_equal(mc["layers.1.mlp.linear_fc1.weight"], t["transformer.h.1.mlp.c_fc.weight"].T)
    assert "output_layer.weight" not in mc
    convert.megacore_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"))
    assert_bit_equal(read_hf(tmp_path / "back"), t)


def test_bad_inputs_are_clear_errors(tmp_path):
    import megacore

    with pytest.raises(megacore.IOError, match="config.json"):
        convert.hf_to_megacore(str(tmp_path), str(tmp_path / "out"))
    cfg = llama_hf_config()
    cfg["model_type"] = "bert"
    write_hf(tmp_path / "bert", cfg, {"x": np.zeros(2, np.float32)})
    with pytest.raises(megacore.ConfigError, match="bert"):
        convert.hf_to_megacore(str(tmp_path / "bert"), str(tmp_path / "out"))
    cfg = llama_hf_config()
    t = llama_hf_tensors(cfg, np.random.default_rng(3))
    del t["model.layers.1.mlp.up_proj.weight"]
    write_hf(tmp_path / "missing", cfg, t)
    with pytest.raises(megacore.IOError, match="up_proj"):
        convert.hf_to_megacore(str(tmp_path / "missing"), str(tmp_path / "out"))
    with pytest.raises(megacore.IOError):
        convert.megacore_to_hf(str(tmp_path / "nothing"), str(tmp_path / "o"))


def test_cli_convert(tmp_path, capsys):
    cfg = llama_hf_config()
    t = llama_hf_tensors(cfg, np.random.default_rng(4))
    write_hf(tmp_path / "hf", cfg, t)
    assert cli.main(["convert", "hf-to-megacore", str(tmp_path / "hf"), str(tmp_path / "mc")]) == 0
    assert cli.main(["convert", "megacore-to-hf", str(tmp_path / "mc"), str(tmp_path / "back")]) == 0
    assert_bit_equal(read_hf(tmp_path / "back"), t)
    assert cli.main(["convert", "megacore-to-hf", str(tmp_path / "nope"), str(tmp_path / "x")]) == 1
    assert "no complete megacore checkpoint" in capsys.readouterr().err


# ----------------------------------------------------------------------------- imported model gives HF logits

def swiglu_numpy(p, gate, up, down, n):
    g, u = n @ p[gate + "weight"].T, n @ p[up + "weight"].T
    return (g / (1 + np.exp(-g)) * u) @ p[down + "weight"].T


def mixtral_moe_numpy(p, q_, n, c):
    """HF Mixtral's sparse MoE block: softmax over all experts, the top k kept and renormalised to sum 1."""
    b = q_ + "block_sparse_moe."
    logits = n @ p[b + "gate.weight"].T
    pr = np.exp(logits - logits.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    top = np.argsort(-pr, axis=-1, kind="stable")[..., :c["num_experts_per_tok"]]
    w = np.take_along_axis(pr, top, -1)
    w /= w.sum(-1, keepdims=True)
    out = np.zeros_like(n)
    for e in range(c["num_local_experts"]):
        q = b + f"experts.{e}."
        y = swiglu_numpy(p, q + "w1.", q + "w3.", q + "w2.", n)
        out += y * ((top == e) * w).sum(-1, keepdims=True)
    return out


def qwen3_moe_numpy(p, q_, n, c):
    """HF Qwen3-MoE's sparse block: softmax over all experts, the top k, renormalised when norm_topk_prob."""
    logits = n @ p[q_ + "mlp.gate.weight"].T
    pr = np.exp(logits - logits.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    top = np.argsort(-pr, axis=-1, kind="stable")[..., :c["num_experts_per_tok"]]
    w = np.take_along_axis(pr, top, -1)
    if c.get("norm_topk_prob", False):  # transformers' default
        w /= w.sum(-1, keepdims=True)
    out = np.zeros_like(n)
    for e in range(c["num_experts"]):
        q = q_ + f"mlp.experts.{e}."
        out += swiglu_numpy(p, q + "gate_proj.", q + "up_proj.", q + "down_proj.", n) * \
            ((top == e) * w).sum(-1, keepdims=True)
    return out


def hf_llama_numpy(t, c, tokens):
    """Logits of a Llama (or, with num_local_experts in ``c``, Mixtral; with q_norm / k_norm tensors, Qwen3; with
    num_experts, Qwen3-MoE) forward written in HF's layout (f64), with llama3 RoPE scaling when configured."""
    h, H, G, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps, theta = c["rms_norm_eps"], c.get("rope_theta", 10000.0)
    p = {k: np.asarray(v, dtype=np.float64) for k, v in t.items()}
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    rs = c.get("rope_scaling")
    if rs:
        lo_wl, hi_wl = rs["original_max_position_embeddings"] / rs["low_freq_factor"], \
            rs["original_max_position_embeddings"] / rs["high_freq_factor"]
        wl = 2 * np.pi / inv
        smooth = (rs["original_max_position_embeddings"] / wl - rs["low_freq_factor"]) / \
            (rs["high_freq_factor"] - rs["low_freq_factor"])
        scaled = np.where(wl > lo_wl, inv / rs["factor"], inv)
        mid = (wl <= lo_wl) & (wl >= hi_wl)
        inv = np.where(mid, (1 - smooth) * inv / rs["factor"] + smooth * inv, scaled)
    b, s = tokens.shape
    ang = np.arange(s)[:, None] * inv[None]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[None, :, None]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[None, :, None]

    def rope(x):
        return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    x = p["model.embed_tokens.weight"][tokens]
    mask = np.tril(np.ones((s, s), bool))
    for i in range(c["num_hidden_layers"]):
        q_ = f"model.layers.{i}."
        n = norm(x, p[q_ + "input_layernorm.weight"])
        q = (n @ p[q_ + "self_attn.q_proj.weight"].T).reshape(b, s, H, d)
        k = (n @ p[q_ + "self_attn.k_proj.weight"].T).reshape(b, s, G, d)
        if q_ + "self_attn.q_norm.weight" in p:  # Qwen3: RMSNorm of each head before RoPE
            q, k = norm(q, p[q_ + "self_attn.q_norm.weight"]), norm(k, p[q_ + "self_attn.k_norm.weight"])
        q, k = rope(q), np.repeat(rope(k), H // G, 2)
        v = np.repeat((n @ p[q_ + "self_attn.v_proj.weight"].T).reshape(b, s, G, d), H // G, 2)
        sc = np.where(mask, np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d), -np.inf)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + np.einsum("bhqk,bkhd->bqhd", pr, v).reshape(b, s, H * d) @ p[q_ + "self_attn.o_proj.weight"].T
        n = norm(x, p[q_ + "post_attention_layernorm.weight"])
        x = x + (mixtral_moe_numpy(p, q_, n, c) if "num_local_experts" in c else
                 qwen3_moe_numpy(p, q_, n, c) if "num_experts" in c else
                 swiglu_numpy(p, q_ + "mlp.gate_proj.", q_ + "mlp.up_proj.", q_ + "mlp.down_proj.", n))
    x = norm(x, p["model.norm.weight"])
    head = p["model.embed_tokens.weight"] if c["tie_word_embeddings"] else p["lm_head.weight"]
    return x @ head.T


def load_into_model(ckpt, tp_world):
    """A megacore GPTModel (TP = 1) with the checkpoint's parameters loaded through the C++ loader."""
    from megacore import model

    cfg = convert.transformer_config(convert.config_from_checkpoint(ckpt))
    m = model.GPTModel(cfg, tp_world)
    targets = []
    for name, (data, _) in m.parameters().items():
        shape = list(data.shape)
        if name in ("embedding.weight", "output_layer.weight"):
            shape[0] = cfg.vocab_size
        targets.append((name, data, shape, [0] * len(shape)))
    ck.load(None, ckpt, targets)
    return m, cfg


@pytest.mark.parametrize("tied,scaling", [(False, True), (True, False)])
def test_imported_llama_matches_hf_layout_forward(tmp_path, tied, scaling):
    megacore = pytest.importorskip("megacore._C")
    import megacore as mc

    world = mc.comm.init_from_env("cpu")
    cfg_hf = llama_hf_config(tied, scaling)
    cfg_hf["vocab_size"] = 128  # no vocabulary padding at TP 1 (divisible by 128)
    t = llama_hf_tensors(cfg_hf, np.random.default_rng(5))
    write_hf(tmp_path / "hf", cfg_hf, t)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    m, cfg = load_into_model(str(tmp_path / "mc"), world)
    tokens = np.random.default_rng(6).integers(0, 128, size=(2, 7)).astype(np.int64)
    m.forward(tokens, tokens, training=False)
    got = np.asarray(m.logits().numpy())[..., :128]
    want = hf_llama_numpy(t, cfg_hf, tokens)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
