"""Mixtral (MoE) Hugging Face import/export.

Without torch: a random Mixtral state in the hub layout (block_sparse_moe.gate, experts.{e}.w1/w2/w3) written as
safetensors imports and exports back bit for bit (f32 and bf16), and what megacore cannot express is refused.

With torch and transformers (skipped otherwise), in f32 on the CPU:
1. Import: a small random MixtralForCausalLM (2 layers, hidden 64, 4 experts, top-2, GQA) written by
   save_pretrained imports into a megacore GPTModel with transformers' logits.
2. Export: a megacore MoE GPTModel with random parameters, exported, loads in transformers with megacore's logits.
The two implementations differ in summation order only, and both pick the same top-2 experts (a near tie would show
as a large difference), so logits are held to 1e-4 of their largest magnitude.
"""

import json
import os

import numpy as np
import pytest

import megacore as mc
from megacore import checkpoint as ck
from megacore import convert, model
from megacore.errors import ConfigError
from test_convert import hf_llama_numpy, load_into_model

try:
    import torch
    import transformers
except ImportError:  # the logits tests are skipped
    torch = transformers = None

needs_transformers = pytest.mark.skipif(transformers is None, reason="needs torch and transformers")
TOL = 1e-4

HF_CONFIG = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 256, "hidden_size": 64,
             "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 8, "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
             "rope_theta": 1e6, "sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2,
             "router_aux_loss_coef": 0.02, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def world():
    return mc.comm.init_from_env("cpu")


def hub_state(hc, rng, dtype=np.float32):
    """Random tensors with the names and shapes of a hub Mixtral checkpoint."""
    h, f, e, d = hc["hidden_size"], hc["intermediate_size"], hc["num_local_experts"], hc["head_dim"]
    heads, groups = hc["num_attention_heads"], hc["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (hc["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (hc["vocab_size"], h)}
    for i in range(hc["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (groups * d, h),
                       p + "self_attn.v_proj.weight": (groups * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                       p + "block_sparse_moe.gate.weight": (e, h)})
        for j in range(e):
            q = p + f"block_sparse_moe.experts.{j}."
            shapes.update({q + "w1.weight": (f, h), q + "w2.weight": (h, f), q + "w3.weight": (f, h)})
    out = {}
    for n, s in shapes.items():
        a = rng.standard_normal(s).astype(np.float32)
        out[n] = ck.BF16Array.from_float32(a) if dtype == "bf16" else a
    return out


def write_hf(path, hc, tensors):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hc, f)
    ck.write_safetensors(os.path.join(path, "model.safetensors"), tensors, {"format": "pt"})


def assert_same_tensors(a_ckpt, b_ckpt):
    """Two megacore checkpoints hold the same tensor names with bit-identical contents."""
    a, _ = ck.load_full_checkpoint(a_ckpt)
    b, _ = ck.load_full_checkpoint(b_ckpt)
    assert sorted(a) == sorted(b)
    for n in a:
        assert np.asarray(a[n]).tobytes() == np.asarray(b[n]).tobytes(), n


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_hub_mixtral_round_trips_bit_exactly(tmp_path, dtype):
    src = hub_state(HF_CONFIG, np.random.default_rng(3), dtype)
    write_hf(str(tmp_path / "hf"), HF_CONFIG, src)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    c = convert.config_from_checkpoint(str(tmp_path / "mc"))
    assert (c["num_moe_experts"], c["moe_router_topk"], c["moe_ffn_hidden_size"]) == (4, 2, 48)
    assert c["moe_router_pre_softmax"] is False and c["moe_router_score_function"] == "softmax"
    assert c["moe_aux_loss_coeff"] == pytest.approx(0.04)  # HF's coefficient × top-k (Megatron normalisation)
    assert c["rope_theta"] == 1e6 and c["params_dtype"] == dtype
    t, _ = ck.load_full_checkpoint(str(tmp_path / "mc"))
    assert t["layers.1.mlp.experts.linear_fc1.weight"].shape == (4, 96, 64)
    assert t["layers.1.mlp.experts.linear_fc2.weight"].shape == (4, 64, 48)
    # expert 2's fc1 rows are its w1 (gate) then its w3 (up)
    fc1 = np.asarray(t["layers.1.mlp.experts.linear_fc1.weight"])
    assert np.array_equal(fc1[2, :48], np.asarray(src["model.layers.1.block_sparse_moe.experts.2.w1.weight"]))
    assert np.array_equal(fc1[2, 48:], np.asarray(src["model.layers.1.block_sparse_moe.experts.2.w3.weight"]))

    convert.megacore_to_hf(str(tmp_path / "mc"), str(tmp_path / "out"), log=None)
    with open(tmp_path / "out" / "config.json") as f:
        hc = json.load(f)
    assert hc["model_type"] == "mixtral" and hc["architectures"] == ["MixtralForCausalLM"]
    for k in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "num_key_value_heads", "head_dim"):
        assert hc[k] == HF_CONFIG[k], k
    assert hc["router_aux_loss_coef"] == pytest.approx(0.02) and hc["sliding_window"] is None
    assert hc["rope_parameters"]["rope_theta"] == 1e6
    r = ck.SafetensorsReader(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(r.names()) == sorted(src)
    for n, a in src.items():
        got = r.get(n)
        assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes(), n


def test_sharded_export_reimports_identically(tmp_path):
    src = hub_state(HF_CONFIG, np.random.default_rng(4))
    write_hf(str(tmp_path / "hf"), HF_CONFIG, src)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    convert.megacore_to_hf(str(tmp_path / "mc"), str(tmp_path / "out"), max_shard_size=200_000, log=None)
    assert os.path.isfile(tmp_path / "out" / "model.safetensors.index.json")
    convert.hf_to_megacore(str(tmp_path / "out"), str(tmp_path / "mc2"))
    assert_same_tensors(str(tmp_path / "mc"), str(tmp_path / "mc2"))


@pytest.mark.parametrize("change,match", [
    ({"sliding_window": 64}, "sliding_window = 64"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok = 5"),
    ({"model_type": "qwen2_moe"}, "shared_expert_gate"),
])
def test_import_refusals(change, match):
    with pytest.raises(ConfigError, match=match):
        convert.config_from_hf({**HF_CONFIG, **change})


def test_long_sliding_window_is_full_attention():
    c = convert.config_from_hf({**HF_CONFIG, "sliding_window": 128})
    assert c["num_moe_experts"] == 4


@pytest.mark.parametrize("change,match", [
    ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax"),
    ({"moe_shared_expert_size": 32}, "moe_shared_expert_size"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
    ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias"),
])
def test_export_refuses_what_mixtral_cannot_express(change, match):
    c = {**convert.config_from_hf(HF_CONFIG), **change}
    with pytest.raises(ConfigError, match=match):
        convert.config_to_hf(c)
    with pytest.raises(ConfigError, match=match):  # before the tensors are mapped (a freq-2 model lacks experts)
        convert.megacore_state_to_hf({}, c)


def test_imported_mixtral_matches_hf_layout_forward(tmp_path, world):
    """An imported hub-layout Mixtral gives the logits of an independent numpy forward in HF's layout and routing
    (f64): a wrong expert order, gate/up swap or routing rule would move them far past the tolerance."""
    rng = np.random.default_rng(7)
    t = hub_state(HF_CONFIG, rng)
    for n, a in t.items():  # weights of a trained scale (norms near 1, a decisive router)
        a *= 0.3 if "norm" in n else (0.5 if "gate" in n else 0.1)
        if "norm" in n:
            a += 1.0
    write_hf(str(tmp_path / "hf"), HF_CONFIG, t)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    m, _ = load_into_model(str(tmp_path / "mc"), world)
    tokens = rng.integers(0, 256, size=(2, 9)).astype(np.int64)
    m.forward(tokens, tokens, training=False)
    got, want = np.asarray(m.logits().numpy()), hf_llama_numpy(t, HF_CONFIG, tokens)
    assert np.abs(got - want).max() <= TOL * np.abs(want).max(), np.abs(got - want).max()


# ----------------------------------------------------------------------------- against transformers

@needs_transformers
def test_transformers_mixtral_imports_with_same_logits(tmp_path, world):
    from test_convert_transformers import _close, hf_logits, megacore_logits

    torch.manual_seed(0)
    kw = {k: v for k, v in HF_CONFIG.items() if k not in ("architectures", "model_type")}
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**kw)).float().eval()
    with torch.no_grad():  # norms start at 1 and the router small: randomise so both are tested
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
            elif "gate" in n and p.dim() == 2 and p.shape[0] == kw["num_local_experts"]:
                p.normal_(0.0, 0.5)
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    m, cfg = load_into_model(str(tmp_path / "mc"), world)
    assert cfg.num_moe_experts == 4 and cfg.moe_router_topk == 2 and cfg.query_groups == 2
    tokens = np.random.default_rng(1).integers(0, 256, size=(2, 12)).astype(np.int64)
    _close(megacore_logits(m, cfg, tokens), hf_logits(hf, tokens))

    # The module's own (fused) names, as a raw state_dict saved without transformers' conversion, import the same.
    fused = {n: p.detach().numpy().copy() for n, p in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    write_hf(str(tmp_path / "fused"), HF_CONFIG, fused)
    convert.hf_to_megacore(str(tmp_path / "fused"), str(tmp_path / "mc_fused"))
    assert_same_tensors(str(tmp_path / "mc"), str(tmp_path / "mc_fused"))


def export_random_model_to_transformers(tmp_path, world, hf_config):
    """A megacore model of ``hf_config``'s shape with random parameters (norms near 1, a decisive router), exported
    and loaded by transformers: megacore's and transformers' logits must agree. Returns the HF model's class name."""
    from test_convert_transformers import _close, hf_logits, megacore_logits, save_model

    cfg = convert.transformer_config(convert.config_from_hf(hf_config))
    m = model.GPTModel(cfg, world)
    rng = np.random.default_rng(0)
    for name, (data, _) in m.parameters().items():
        a = data.numpy()
        scale = 0.3 if "norm" in name else (0.5 if "router" in name else 0.05)
        a[...] = (rng.standard_normal(a.shape) * scale + (1.0 if "norm" in name else 0.0)).astype(np.float32)
    save_model(m, cfg, world, str(tmp_path / "mc"))
    convert.megacore_to_hf(str(tmp_path / "mc"), str(tmp_path / "hf"), log=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens = rng.integers(0, cfg.vocab_size, size=(2, 12)).astype(np.int64)
    _close(megacore_logits(m, cfg, tokens), hf_logits(hf, tokens))
    return type(hf).__name__


@needs_transformers
def test_exported_megacore_moe_model_gives_same_logits_in_transformers(tmp_path, world):
    assert export_random_model_to_transformers(tmp_path, world, HF_CONFIG) == "MixtralForCausalLM"


@pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI (the trainer runs on CPU ranks)")
def test_trained_tiny_moe_at_ep2_exports_as_mixtral(tmp_path, world):
    """What `megacore train` writes for tiny_moe at EP = 2 (experts sharded over 2 CPU ranks, 3 steps) exports with
    `megacore convert megacore-to-hf` as a Mixtral whose HF-layout forward (numpy) gives the logits of the trained
    checkpoint loaded into one process; re-importing the export gives the checkpoint's tensors bit for bit."""
    from megacore import cli, recipes
    from test_convert_trained import train_tiny

    r = train_tiny(tmp_path, steps=3, save_interval=0, tp=1, ranks=2, recipe=recipes.tiny_moe,
                   parallel__expert_model_parallel_size=2)
    root, out = r.checkpoint.save_dir, str(tmp_path / "hf")
    assert cli.main(["convert", "megacore-to-hf", root, out]) == 0
    with open(os.path.join(out, "config.json")) as f:
        hc = json.load(f)
    assert (hc["model_type"], hc["num_local_experts"], hc["num_experts_per_tok"]) == ("mixtral", 4, 2)
    assert hc["intermediate_size"] == r.model.moe_ffn_hidden_size and hc["eos_token_id"] == 256
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    t = {}
    for fn in files:
        rd = ck.SafetensorsReader(os.path.join(out, fn))
        t.update({n: rd.get(n) for n in rd.names()})
    m, cfg = load_into_model(root, world)
    tokens = np.random.default_rng(2).integers(0, 259, size=(2, 16)).astype(np.int64)
    m.forward(tokens, tokens, training=False)
    hf_cfg = {**hc, "rope_theta": hc["rope_parameters"]["rope_theta"]}
    got, want = np.asarray(m.logits().numpy())[..., :259], hf_llama_numpy(t, hf_cfg, tokens)
    assert np.abs(got - want).max() <= TOL * np.abs(want).max(), np.abs(got - want).max()

    convert.hf_to_megacore(out, str(tmp_path / "back"))
    a, _ = ck.load_full_checkpoint(str(tmp_path / "back"))
    b, _ = ck.load_full_checkpoint(root, names=list(a))
    convert._strip_vocab_padding(b, convert.config_from_checkpoint(root))  # the export drops padding rows too
    assert sorted(a) == sorted(b) and "layers.3.mlp.experts.linear_fc1.weight" in a
    for n in a:
        assert np.asarray(a[n]).tobytes() == np.asarray(b[n]).tobytes(), n


def test_mixtral_8x7b_config_imports_with_the_preset_shapes():
    """The config.json of Mixtral-8x7B-v0.1 imports with the shapes of megacore's mixtral_8x7b preset, and the
    preset exports back to those fields."""
    real = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
            "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
            "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "vocab_size": 32000}
    got = convert.config_from_hf(real, "bf16")
    preset = convert.config_dict(model.mixtral_8x7b())
    shape = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size",
             "norm_eps", "rope_theta", "tie_word_embeddings", "num_moe_experts", "moe_router_topk",
             "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_layer_freq", "max_position_embeddings")
    assert {k: got[k] for k in shape} == {k: preset[k] for k in shape}
    hc = convert.config_to_hf(preset)
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
              "num_key_value_heads", "num_local_experts", "rms_norm_eps", "vocab_size", "tie_word_embeddings"):
        assert hc[k] == real[k], k
    assert hc["rope_parameters"]["rope_theta"] == real["rope_theta"] and hc["model_type"] == "mixtral"


def test_finetune_recipe_from_a_mixtral_directory_keeps_the_experts(tmp_path):
    """`megacore finetune --model HF_MIXTRAL_DIR` builds its recipe's model from config.json, MoE fields included."""
    from megacore import finetuning

    write_hf(str(tmp_path / "hf"), HF_CONFIG, hub_state(HF_CONFIG, np.random.default_rng(8)))
    data = tmp_path / "qa.jsonl"
    data.write_text('{"input": "a", "output": "b"}\n')
    r = finetuning.finetune_recipe(str(tmp_path / "hf"), str(data), output_path=str(tmp_path / "ft"))
    m = r.model
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (4, 2, 48, 48)
    assert m.moe_router_pre_softmax is False and m.moe_aux_loss_coeff == pytest.approx(0.04)
