"""Export of what `megacore train` writes: a checkpoint of the tiny recipe (CPU ranks) exports from its root
(the latest step) and from a given step_N directory into a Hugging Face directory that transformers >= 5 reads
(config.json with rope_parameters, dtype and the special token ids; generation_config.json), with HF tensor
names and shapes, and imports back bit-exactly. Checkpoints with vocabulary padding rows and a tokenizer.json
export the true vocabulary and the tokenizer files. (Logits against transformers: test_convert_transformers.py.)
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import megacore as mc
from megacore import checkpoint as ck
from megacore import cli, convert, recipes

needs_mpi = pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI")


def train_tiny(tmp_path, name="run", steps=4, save_interval=2, tp=2, recipe=recipes.tiny, ranks=None, **sets):
    """The tiny recipe (or ``recipe``) on CPU ranks (TP = 2 on 2 ranks; ``ranks`` CPU ranks when given) for a few
    steps; returns the recipe."""
    r = recipe.pretrain_recipe(dir=str(tmp_path / name))
    r.resources.num_gpus_per_node = ranks or tp
    r.parallel.tensor_model_parallel_size = tp
    r.parallel.pipeline_model_parallel_size = 1
    r.trainer.max_steps = steps
    r.trainer.generate_tokens = 0
    r.trainer.val_check_interval = 0
    r.optim.lr_warmup_iters = 1
    r.checkpoint.save_interval = save_interval
    r.checkpoint.keep_last = 0
    r.data.cache_dir = str(tmp_path / "data")
    for k, v in sets.items():
        r.set(k.replace("__", "."), v)
    cfg = tmp_path / f"{name}.json"
    r.to_json(str(cfg))
    cmd = [sys.executable, "-m", "megacore.launch", "--nproc-per-node", str(r.world_size), "--cpu",
           "-m", "megacore.train", "--config", str(cfg)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return r


def read_hf(d):
    out = {}
    for fn in os.listdir(d):
        if fn.endswith(".safetensors"):
            out.update({k: np.array(v) for k, v in ck.read_safetensors(os.path.join(d, fn)).items()})
    return out


def model_tensors(ckpt):
    meta = ck._metadata(ck.resolve_checkpoint(ckpt))
    names = [n for n in meta["tensors"] if not n.startswith("optimizer.")]
    t, _ = ck.load_full_checkpoint(ckpt, names=names)
    return t


@needs_mpi
def test_trainer_checkpoint_exports_from_root_and_step_dir(tmp_path, capsys):
    r = train_tiny(tmp_path)
    root = r.checkpoint.save_dir
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_2", "step_4"]
    # trainer.precision 'auto' resolves to the dtype the weights were saved in (f32 on CPU ranks).
    c = convert.config_from_checkpoint(root)
    assert r.trainer.precision == "auto" and c["params_dtype"] == "f32"
    assert convert.transformer_config(c).num_layers == r.model.num_layers

    out = str(tmp_path / "hf")
    assert cli.main(["convert", "megacore-to-hf", root, out]) == 0
    log = capsys.readouterr().out
    assert "step_4" in log and "byte tokenizer" in log and "256 is <eos>" in log

    cfg = json.load(open(os.path.join(out, "config.json")))
    m = r.model
    want = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.hidden_size,
            "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_query_groups,
            "head_dim": m.hidden_size // m.num_attention_heads, "vocab_size": 259,
            "max_position_embeddings": m.max_position_embeddings, "rms_norm_eps": m.norm_eps,
            "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "float32",
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "bos_token_id": 258, "eos_token_id": 256, "pad_token_id": 257}
    assert {k: cfg.get(k) for k in want} == want
    for legacy in ("rope_theta", "rope_scaling", "torch_dtype"):  # transformers >= 5 form only
        assert legacy not in cfg
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (258, 256, 257)
    assert "tokenizer.json" not in os.listdir(out)  # the byte tokenizer has no HF file (the log says what ids mean)

    hf = read_hf(out)
    h, f, d = m.hidden_size, m.ffn_hidden_size, m.hidden_size // m.num_attention_heads
    shapes = {"model.embed_tokens.weight": (259, h), "lm_head.weight": (259, h), "model.norm.weight": (h,)}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (m.num_attention_heads * d, h),
                       p + "self_attn.k_proj.weight": (m.num_query_groups * d, h),
                       p + "self_attn.v_proj.weight": (m.num_query_groups * d, h),
                       p + "self_attn.o_proj.weight": (h, m.num_attention_heads * d),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    assert {k: v.shape for k, v in hf.items()} == shapes

    # Re-import: bit-exact against the trainer's own checkpoint.
    convert.hf_to_megacore(out, str(tmp_path / "back"))
    back, trained = model_tensors(str(tmp_path / "back")), model_tensors(root)
    assert sorted(back) == sorted(trained)
    for k in trained:
        assert np.array_equal(np.asarray(back[k]), np.asarray(trained[k])), k

    # A given step directory exports that step (not the latest).
    out2 = str(tmp_path / "hf2")
    convert.megacore_to_hf(os.path.join(root, "step_2"), out2, log=False)
    hf2 = read_hf(out2)
    step2 = model_tensors(os.path.join(root, "step_2"))
    assert np.array_equal(hf2["model.embed_tokens.weight"], step2["embedding.weight"])
    assert not np.array_equal(hf2["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])


def tiny_llama_tensors(rng, vocab_rows, h=32, heads=4, groups=2, f=48, layers=2):
    d = h // heads
    t = {"embedding.weight": rng.standard_normal((vocab_rows, h)).astype(np.float32),
         "output_layer.weight": rng.standard_normal((vocab_rows, h)).astype(np.float32),
         "final_layernorm.weight": rng.standard_normal(h).astype(np.float32)}
    for i in range(layers):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = rng.standard_normal(h).astype(np.float32)
        t[p + "self_attention.linear_qkv.weight"] = rng.standard_normal(((heads + 2 * groups) * d, h)).astype(np.float32)
        t[p + "self_attention.linear_proj.weight"] = rng.standard_normal((h, heads * d)).astype(np.float32)
        t[p + "pre_mlp_layernorm.weight"] = rng.standard_normal(h).astype(np.float32)
        t[p + "mlp.linear_fc1.weight"] = rng.standard_normal((2 * f, h)).astype(np.float32)
        t[p + "mlp.linear_fc2.weight"] = rng.standard_normal((h, f)).astype(np.float32)
    return t


def tiny_recipe_blob(tokenizer, vocab=50):
    # As the trainer stores it: JSON text, extra fields tolerated, derived fields 0.
    return json.dumps({"name": "t", "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                              "num_query_groups": 2, "ffn_hidden_size": 48, "kv_channels": 0,
                                              "vocab_size": vocab, "max_position_embeddings": 64,
                                              "rope_theta": 500000.0, "rope_scaling": "llama3",
                                              "rope_scaling_factor": 32.0, "some_new_field": 1},
                       "trainer": {"precision": "bf16"}, "data": {"tokenizer": tokenizer}, "extra_section": {}})


def write_tokenizer_json(path):
    tj = {"version": "1.0", "added_tokens": [{"id": 0, "content": "<s>", "special": True},
                                             {"id": 1, "content": "</s>", "special": True},
                                             {"id": 2, "content": "<pad>", "special": True}],
          "model": {"type": "WordLevel", "vocab": {"<s>": 0, "</s>": 1, "<pad>": 2, "a": 3}, "unk_token": "a"}}
    with open(path, "w") as f:
        json.dump(tj, f)


def test_export_strips_vocab_padding_and_copies_the_tokenizer(tmp_path):
    rng = np.random.default_rng(0)
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    write_tokenizer_json(tok)
    t = tiny_llama_tensors(rng, vocab_rows=64)  # 50 real rows + 14 padding rows
    t = {k: ck.BF16Array.from_float32(v) for k, v in t.items()}
    ck.save_full_checkpoint(str(tmp_path / "ckpt"), 7, t, {"recipe": tiny_recipe_blob(str(tok))})
    logs = []
    out = convert.megacore_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), log=logs.append)
    files = sorted(os.listdir(out))
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["vocab_size"] == 50 and cfg["dtype"] == "bfloat16" and cfg["head_dim"] == 8
    assert cfg["rope_parameters"] == {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1, 2)
    tc = json.load(open(os.path.join(out, "tokenizer_config.json")))
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert open(os.path.join(out, "tokenizer.json")).read() == tok.read_text()
    hf = read_hf(out)
    assert hf["model.embed_tokens.weight"].shape == (50, 32) and hf["lm_head.weight"].shape == (50, 32)
    assert np.array_equal(hf["model.embed_tokens.weight"], np.asarray(t["embedding.weight"])[:50])
    assert any("tokenizer: copied" in line for line in logs)
    # Round trip through the HF importer.
    back, _ = ck.load_full_checkpoint(convert.hf_to_megacore(out, str(tmp_path / "back")))
    assert np.array_equal(np.asarray(back["embedding.weight"]), np.asarray(t["embedding.weight"])[:50])

    # The run's tokenizer is gone: a clear error with the fix, and --tokenizer overrides.
    ck.save_full_checkpoint(str(tmp_path / "c2"), 1, t, {"recipe": tiny_recipe_blob("/no/such/tokenizer.json")})
    with pytest.raises(mc.IOError, match="--tokenizer"):
        convert.megacore_to_hf(str(tmp_path / "c2"), str(tmp_path / "hf2"), log=False)
    assert cli.main(["convert", "megacore-to-hf", str(tmp_path / "c2"), str(tmp_path / "hf3"),
                     "--tokenizer", str(tok.parent)]) == 0
    assert "tokenizer.json" in os.listdir(tmp_path / "hf3")


def test_checkpoint_without_model_description_is_a_clear_error(tmp_path):
    t = tiny_llama_tensors(np.random.default_rng(1), vocab_rows=50)
    ck.save_full_checkpoint(str(tmp_path / "c"), 1, t, {"trainer": {"step": 1}})
    with pytest.raises(mc.IOError, match="neither a 'config' nor a 'recipe'"):
        convert.megacore_to_hf(str(tmp_path / "c"), str(tmp_path / "hf"), log=False)
    # A recipe whose model does not describe the weights is refused before anything is written.
    bad = json.loads(tiny_recipe_blob("byte"))
    bad["model"]["ffn_hidden_size"] = 40
    ck.save_full_checkpoint(str(tmp_path / "c3"), 1, t, {"recipe": json.dumps(bad)})
    with pytest.raises(mc.ConfigError, match="linear_fc1"):
        convert.megacore_to_hf(str(tmp_path / "c3"), str(tmp_path / "hf3"), log=False)
    assert not os.path.exists(tmp_path / "hf3")
