"""Qwen3 (dense) and Qwen3-MoE Hugging Face import/export: per-head q/k norms (megacore's qk_layernorm).

Without torch: random Qwen3 / Qwen3-MoE states in the hub layout (self_attn.q_norm / k_norm, mlp.gate,
mlp.experts.{e}.gate_proj/up_proj/down_proj) written as safetensors import and export back bit for bit (f32 and
bf16); an imported model gives the logits of an independent numpy forward in HF's layout (f64: RMSNorm of each
query and key head before RoPE, the top-k routing with and without norm_topk_prob); what megacore cannot express
is refused with the fix.

With torch and transformers (skipped otherwise), in f32 on the CPU: Qwen3ForCausalLM and Qwen3MoeForCausalLM
(small random configs) written by save_pretrained import with transformers' logits, and a megacore model with
qk_layernorm exported loads in transformers with megacore's logits. Logits are held to 1e-4 of their largest
magnitude (summation order only; both pick the same experts).
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
from test_convert_mixtral import (TOL, export_random_model_to_transformers, needs_transformers, torch,  # noqa: F401
                                  transformers, world, write_hf)  # world: the module fixture

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
         "rope_theta": 1e6, "attention_bias": False, "use_sliding_window": False, "sliding_window": 32,
         "max_window_layers": 2, "tie_word_embeddings": True}
QWEN3_MOE = {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "tie_word_embeddings": False}


def hub_state(hc, rng, dtype=np.float32):
    """Random tensors with the names and shapes of a hub Qwen3 / Qwen3-MoE checkpoint (norms near 1, a decisive
    router: the scale of trained weights)."""
    h, d, heads, groups = hc["hidden_size"], hc["head_dim"], hc["num_attention_heads"], hc["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (hc["vocab_size"], h), "model.norm.weight": (h,)}
    if not hc["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (hc["vocab_size"], h)
    for i in range(hc["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (groups * d, h),
                       p + "self_attn.v_proj.weight": (groups * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if "num_experts" in hc:
            f = hc["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (hc["num_experts"], h)
            for j in range(hc["num_experts"]):
                q = p + f"mlp.experts.{j}."
                shapes.update({q + "gate_proj.weight": (f, h), q + "up_proj.weight": (f, h),
                               q + "down_proj.weight": (h, f)})
        else:
            f = hc["intermediate_size"]
            shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                           p + "mlp.down_proj.weight": (h, f)})
    out = {}
    for n, s in shapes.items():
        a = rng.standard_normal(s).astype(np.float32)
        a *= 0.3 if "norm" in n else (0.5 if n.endswith("mlp.gate.weight") else 0.1)
        if "norm" in n:
            a += 1.0
        out[n] = ck.BF16Array.from_float32(a) if dtype == "bf16" else a
    return out


@pytest.mark.parametrize("hc", [QWEN3, QWEN3_MOE, {**QWEN3_MOE, "norm_topk_prob": False}],
                         ids=["qwen3", "qwen3_moe", "qwen3_moe_unnormalised"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_hub_qwen3_round_trips_bit_exactly(tmp_path, hc, dtype):
    src = hub_state(hc, np.random.default_rng(3), dtype)
    write_hf(str(tmp_path / "hf"), hc, src)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    c = convert.config_from_checkpoint(str(tmp_path / "mc"))
    assert c["qk_layernorm"] is True and c["kv_channels"] == 16 and c["norm_eps"] == 1e-6
    t, _ = ck.load_full_checkpoint(str(tmp_path / "mc"))
    assert np.asarray(t["layers.1.self_attention.q_layernorm.weight"]).tobytes() == \
        np.asarray(src["model.layers.1.self_attn.q_norm.weight"]).tobytes()
    if "num_experts" in hc:
        assert (c["num_moe_experts"], c["moe_router_topk"], c["moe_ffn_hidden_size"]) == (4, 2, 48)
        assert c["moe_router_pre_softmax"] is (not hc["norm_topk_prob"])
        assert c["moe_aux_loss_coeff"] == pytest.approx(0.002)  # HF's coefficient × top-k
        fc1 = np.asarray(t["layers.1.mlp.experts.linear_fc1.weight"])  # expert 2: gate rows, then up rows
        assert np.array_equal(fc1[2, :48], np.asarray(src["model.layers.1.mlp.experts.2.gate_proj.weight"]))
        assert np.array_equal(fc1[2, 48:], np.asarray(src["model.layers.1.mlp.experts.2.up_proj.weight"]))

    convert.megacore_to_hf(str(tmp_path / "mc"), str(tmp_path / "out"), log=None)
    with open(tmp_path / "out" / "config.json") as f:
        out = json.load(f)
    assert out["model_type"] == hc["model_type"] and out["architectures"] == hc["architectures"]
    for k in ("head_dim", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        if k in hc:
            assert out[k] == hc[k], k
    if "num_experts" in hc:
        assert out["router_aux_loss_coef"] == pytest.approx(hc["router_aux_loss_coef"])
    r = ck.SafetensorsReader(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(r.names()) == sorted(src)
    for n, a in src.items():
        got = r.get(n)
        assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes(), n


@pytest.mark.parametrize("hc", [QWEN3, {**QWEN3, "tie_word_embeddings": False}, QWEN3_MOE,
                                {**QWEN3_MOE, "norm_topk_prob": False}],
                         ids=["qwen3_tied", "qwen3", "qwen3_moe", "qwen3_moe_unnormalised"])
def test_imported_qwen3_matches_hf_layout_forward(tmp_path, world, hc):
    """An imported hub-layout Qwen3 gives the logits of an independent numpy forward in HF's layout (f64): a
    missing head norm, a norm after RoPE, or a wrong routing rule would move them far past the tolerance."""
    rng = np.random.default_rng(7)
    t = hub_state(hc, rng)
    write_hf(str(tmp_path / "hf"), hc, t)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    m, cfg = load_into_model(str(tmp_path / "mc"), world)
    assert cfg.qk_layernorm
    tokens = rng.integers(0, 256, size=(2, 9)).astype(np.int64)
    m.forward(tokens, tokens, training=False)
    got, want = np.asarray(m.logits().numpy()), hf_llama_numpy(t, hc, tokens)
    assert np.abs(got - want).max() <= TOL * np.abs(want).max(), np.abs(got - want).max()


@pytest.mark.parametrize("change,match", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok = 5"),
    ({"num_experts": None}, "neither num_experts nor num_local_experts"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "sliding_window = 32"),
])
def test_import_refusals(change, match):
    with pytest.raises(ConfigError, match=match):
        convert.config_from_hf({**QWEN3_MOE, **change})


@pytest.mark.parametrize("change,match", [
    ({"moe_shared_expert_size": 32}, "moe_shared_expert_size"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
    ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias"),
])
def test_export_refuses_what_qwen3_moe_cannot_express(change, match):
    c = {**convert.config_from_hf(QWEN3_MOE), **change}
    with pytest.raises(ConfigError, match=match):
        convert.config_to_hf(c)
    with pytest.raises(ConfigError, match=match):  # before the tensors are mapped
        convert.megacore_state_to_hf({}, c)


def test_qk_layernorm_needs_rmsnorm(world):
    cfg = convert.transformer_config(convert.config_from_hf(QWEN3))
    cfg.normalization = model.NormType.LayerNorm
    with pytest.raises(ConfigError, match="set normalization = RMSNorm or qk_layernorm = false"):
        model.GPTModel(cfg, world)


# ----------------------------------------------------------------------------- against transformers

def _randomise_norms_and_router(hf, experts):
    with torch.no_grad():  # norms start at 1 and the router small: randomise so both are tested
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
            elif n.endswith("mlp.gate.weight") and p.shape[0] == experts:
                p.normal_(0.0, 0.5)


@needs_transformers
@pytest.mark.parametrize("hc", [QWEN3, QWEN3_MOE, {**QWEN3_MOE, "norm_topk_prob": False}],
                         ids=["qwen3", "qwen3_moe", "qwen3_moe_unnormalised"])
def test_transformers_qwen3_imports_with_same_logits(tmp_path, world, hc):
    from test_convert_transformers import _close, hf_logits, megacore_logits

    torch.manual_seed(0)
    kw = {k: v for k, v in hc.items() if k not in ("architectures", "model_type")}
    moe = "num_experts" in hc
    cls, conf = ((transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig) if moe else
                 (transformers.Qwen3ForCausalLM, transformers.Qwen3Config))
    hf = cls(conf(**kw)).float().eval()
    _randomise_norms_and_router(hf, hc.get("num_experts", 0))
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    with open(tmp_path / "hf" / "config.json") as f:
        print("transformers", transformers.__version__, "wrote config keys", sorted(json.load(f)))
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    m, cfg = load_into_model(str(tmp_path / "mc"), world)
    assert cfg.qk_layernorm and cfg.num_moe_experts == hc.get("num_experts", 0)
    tokens = np.random.default_rng(1).integers(0, 256, size=(2, 12)).astype(np.int64)
    _close(megacore_logits(m, cfg, tokens), hf_logits(hf, tokens))


QWEN3_LLAMA3_ROPE = {**QWEN3, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16}}


@needs_transformers
@pytest.mark.parametrize("hc", [QWEN3, QWEN3_MOE, QWEN3_LLAMA3_ROPE], ids=["qwen3", "qwen3_moe", "qwen3_llama3_rope"])
def test_exported_megacore_qk_layernorm_model_gives_same_logits_in_transformers(tmp_path, world, hc):
    assert export_random_model_to_transformers(tmp_path, world, hc) == hc["architectures"][0]


# ----------------------------------------------------------------------------- the user path

@pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI (the trainer runs on CPU ranks)")
def test_finetune_from_a_qwen3_moe_hub_directory_exports_qwen3_moe(tmp_path, world):
    """`megacore.finetune` from a Qwen3-MoE hub directory (imported on the fly) trains LoRA adapters on 2 CPU ranks
    (experts split over EP 2) and exports the merged model as Qwen3MoeForCausalLM, whose numpy HF-layout forward
    gives the logits of the run's merged checkpoint loaded into one process; the losses are finite and fall."""
    from test_user_path import _qa_jsonl, _rows

    hc = {**QWEN3_MOE, "vocab_size": 320}  # room for the byte tokenizer's 259 ids
    write_hf(str(tmp_path / "hf"), hc, hub_state(hc, np.random.default_rng(11)))
    _qa_jsonl(tmp_path / "qa.jsonl", 200)
    res = mc.finetune(model_path=str(tmp_path / "hf"), data_path=str(tmp_path / "qa.jsonl"), peft=mc.peft.LoRA(),
                      trainer={"devices": 2, "max_steps": 8, "precision": "f32"}, output_path=str(tmp_path / "ft"),
                      cpu=True, export_hf=True, log=lambda *a: None,
                      overrides=["data.seq_length=64", "trainer.val_check_interval=0",
                                 "parallel.expert_model_parallel_size=2", "optim.lr=3e-3"])
    steps, _ = _rows(res.logs)
    losses = [r["loss"] for r in steps]
    print("qwen3-moe LoRA fine-tune losses", [round(x, 3) for x in losses])
    assert len(losses) == 8 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    with open(os.path.join(res.hf, "config.json")) as f:
        out = json.load(f)
    assert out["model_type"] == "qwen3_moe" and out["num_experts"] == 4 and out["norm_topk_prob"] is True
    t = {}
    for fn in os.listdir(res.hf):
        if fn.endswith(".safetensors"):
            r = ck.SafetensorsReader(os.path.join(res.hf, fn))
            t.update({n: r.get(n) for n in r.names()})
    assert "model.layers.1.self_attn.k_norm.weight" in t
    convert.hf_to_megacore(res.hf, str(tmp_path / "reimported"))
    m, cfg = load_into_model(str(tmp_path / "reimported"), world)
    tokens = np.random.default_rng(2).integers(0, 259, size=(2, 10)).astype(np.int64)
    m.forward(tokens, tokens, training=False)
    got = np.asarray(m.logits().numpy())[..., :hc["vocab_size"]]
    want = hf_llama_numpy(t, {**out, "rope_theta": out["rope_parameters"]["rope_theta"]}, tokens)
    assert np.abs(got - want).max() <= TOL * np.abs(want).max(), np.abs(got - want).max()


def test_expert_count_under_either_name():
    hc = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    assert convert.config_from_hf({**hc, "num_local_experts": 4})["num_moe_experts"] == 4


def test_hf_defaults_and_rope_scaling_round_trip():
    """Keys a Qwen3 config.json may leave out take transformers' defaults (norm_topk_prob false, head_dim 128,
    use_sliding_window false); llama3 RoPE scaling travels both ways."""
    hc = {k: v for k, v in QWEN3_MOE.items() if k not in ("norm_topk_prob", "head_dim", "use_sliding_window")}
    c = convert.config_from_hf(hc)
    assert c["moe_router_pre_softmax"] is True and c["kv_channels"] == 128
    c = convert.config_from_hf(QWEN3_LLAMA3_ROPE)
    assert c["rope_scaling"]["type"] == "Llama3"
    back = convert.config_from_hf(convert.config_to_hf(c))
    assert back["rope_scaling"] == c["rope_scaling"] and back["qk_layernorm"] is True


def test_a_recipe_without_qk_layernorm_refuses_a_converted_qwen3_checkpoint(tmp_path):
    """The loader fills the tensors the model asks for; a Qwen3 import loaded by a model without qk_layernorm would
    drop its q/k norms without a word, so validation compares the converted checkpoint's config first."""
    from megacore import finetuning

    hc = {**QWEN3, "vocab_size": 320}  # room for the byte tokenizer's 259 ids
    write_hf(str(tmp_path / "hf"), hc, hub_state(hc, np.random.default_rng(5)))
    ckpt = convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    (tmp_path / "sft.jsonl").write_text('{"input": "a", "output": "b"}\n')
    r = finetuning.finetune_recipe(str(tmp_path / "mc"), str(tmp_path / "sft.jsonl"), output_path=str(tmp_path / "ft"))
    assert r.model.qk_layernorm is True
    r.validate(check_paths=True)  # the recipe built from the checkpoint's config is accepted
    r.model.qk_layernorm = False
    with pytest.raises(ConfigError, match=r"holds another model \(qk_layernorm true vs false.*qk_layernorm = true"):
        r.validate(check_paths=True)
    r.model.qk_layernorm, r.model.num_layers = True, 3
    with pytest.raises(ConfigError, match="num_layers 2 vs 3"):
        r.validate(check_paths=True)
    assert os.path.isdir(ckpt)


@pytest.mark.parametrize("from_hf", [True, False], ids=["hf_dir", "megacore_checkpoint"])
def test_a_finetune_of_a_converted_qwen3_keeps_its_rope_theta_and_norm_eps(tmp_path, from_hf):
    """`megacore finetune` (from the Hugging Face directory, or from its import) takes rope_theta 1e6 and norm_eps
    1e-6 from the model, so validation has nothing to say; a recipe that sets them back to the defaults is told:
    another norm_eps is an error, another rope_theta (a context extension, perhaps) a warning."""
    from megacore import finetuning

    hc = {**QWEN3, "vocab_size": 320}  # room for the byte tokenizer's 259 ids
    assert hc["rope_theta"] == 1e6 and hc["rms_norm_eps"] == 1e-6
    write_hf(str(tmp_path / "hf"), hc, hub_state(hc, np.random.default_rng(6)))
    (tmp_path / "sft.jsonl").write_text('{"input": "a", "output": "b"}\n')
    ft = str(tmp_path / "ft")
    if from_hf:  # finetune imports the directory into ft/base after validating without paths
        r = finetuning.finetune_recipe(str(tmp_path / "hf"), str(tmp_path / "sft.jsonl"), output_path=ft)
        r.validate(check_paths=False)
        finetuning._import_hf(str(tmp_path / "hf"), ft, log=lambda m: None)
    else:
        convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
        r = finetuning.finetune_recipe(str(tmp_path / "mc"), str(tmp_path / "sft.jsonl"), output_path=ft)
    assert (r.model.rope_theta, r.model.norm_eps, r.model.rope_scaling) == (1e6, 1e-6, "none")
    assert r.validate(check_paths=True) == []
    r.model.rope_theta = 10000.0
    w = r.validate(check_paths=True)
    assert len(w) == 1 and "checkpoint.pretrained_checkpoint" in w[0] and "rope_theta 1000000 vs 10000" in w[0]
    assert "set model.rope_theta = 1000000 to train the imported model as it was" in w[0]
    r.model.norm_eps = 1e-5
    with pytest.raises(ConfigError, match=r"norm_eps 1e-06 vs 1e-05, checkpoint vs recipe\); set model.norm_eps = "
                                          r"1e-06"):
        r.validate(check_paths=True)
