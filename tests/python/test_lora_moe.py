"""LoRA on MoE experts (Mixtral-shaped models): PEFT export/import, merge, megacore's own forward, fine-tuning.

1. Round trip: a random adapter on an imported hub-layout Mixtral (q_proj plus every expert's w1/w3/w2) exports as
   PEFT with one pair per expert (base_model.model.model.layers.N.block_sparse_moe.experts.E.w1.lora_A.weight
   [r, h] ...), imports back bit for bit, and exports again byte for byte.
2. Merge: the merged Hugging Face export holds W_e + alpha/r · B_e A_e per expert (w1 = gate, w3 = up, w2 = down)
   computed here in HF's layout (f32, 1e-6 of the largest weight), and megacore's LoRA forward (GPTModel.apply_lora
   with the adapter loaded) gives the logits of the merged model (the Python merge, the merged HF export
   re-imported, the numpy HF-layout forward of the merged weights, and GPTModel.merge_lora) within 1e-5 of the
   largest logit: f32, only summation order differs; the router weights are decisive so no near tie flips a
   top-2 choice.
3. `megacore finetune` from a tiny_moe checkpoint on 2 CPU ranks with EP = 2 and LoRA on gate_proj/up_proj/down_proj
   trains only the expert adapters (the logged trainable count is the size of the saved adapter tensors, which hold
   every expert) and the training loss falls (mean of the last 3 of 12 steps at least 0.5 below the first 3's; measured
   4.99 -> 3.96).
4. With torch, transformers and peft installed (the GPU machine): the exported adapter loads with peft.PeftModel on
   the MixtralForCausalLM transformers wrote, with the logits of megacore's merged model (f32, 1e-4).
5. Bad input: w1 on a dense model, the router as a target, a PEFT adapter missing some experts: typed errors.
"""

import json
import re

import numpy as np
import pytest

import megacore as mc
from megacore import checkpoint as ck
from megacore import cli, convert, peft

from test_convert import hf_llama_numpy, load_into_model
from test_convert_mixtral import HF_CONFIG, hub_state, write_hf
from test_peft import peft_library_vs_megacore, save_adapter
from test_user_path import _cli, _rows

TARGETS = ["q_proj", "w1", "w3", "w2"]


def expert_adapter(c, r, rng):
    """megacore-named adapter tensors (q_proj and the experts' gate/up/down), B non-zero so merging matters."""
    h, heads, d = c["hidden_size"], c["num_attention_heads"], c["kv_channels"]
    e, f = c["num_moe_experts"], int(c.get("moe_ffn_hidden_size") or 0) or c["ffn_hidden_size"]
    shapes = {"self_attention.linear_qkv.q_proj": ((r, h), (heads * d, r)),
              "mlp.experts.linear_fc1.gate_proj": ((e, r, h), (e, f, r)),
              "mlp.experts.linear_fc1.up_proj": ((e, r, h), (e, f, r)),
              "mlp.experts.linear_fc2": ((e, r, f), (e, h, r))}
    t = {}
    for i in range(c["num_layers"]):
        for mod, (sa, sb) in shapes.items():
            t[f"layers.{i}.{mod}.lora_A.weight"] = (rng.standard_normal(sa) * 0.2).astype(np.float32)
            t[f"layers.{i}.{mod}.lora_B.weight"] = (rng.standard_normal(sb) * 0.2).astype(np.float32)
    return t


@pytest.fixture
def base(tmp_path):
    """An imported hub-layout Mixtral (2 layers, 4 experts, top-2, GQA) with weights of a trained scale."""
    t = hub_state(HF_CONFIG, np.random.default_rng(7))
    for n, a in t.items():
        a *= 0.3 if "norm" in n else (0.5 if "gate" in n else 0.1)
        if "norm" in n:
            a += 1.0
    write_hf(str(tmp_path / "hf"), HF_CONFIG, t)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "base"))
    return tmp_path / "base", t


def test_expert_adapter_peft_round_trip_is_exact(tmp_path, base):
    root, _ = base
    c = convert.config_from_checkpoint(str(root))
    a = expert_adapter(c, 4, np.random.default_rng(0))
    save_adapter(tmp_path / "ad", a, 4, 8.0, root, TARGETS)
    out = peft.export_peft(str(tmp_path / "ad"), str(tmp_path / "peft"), base_model_name_or_path="org/tiny-mixtral")
    cfg = json.load(open(tmp_path / "peft" / "adapter_config.json"))
    assert sorted(cfg["target_modules"]) == ["q_proj", "w1", "w2", "w3"]
    st = ck.read_safetensors(str(tmp_path / "peft" / "adapter_model.safetensors"))
    e = HF_CONFIG["num_local_experts"]
    assert len(st) == 2 * HF_CONFIG["num_hidden_layers"] * (1 + 3 * e)
    p = "base_model.model.model.layers.1.block_sparse_moe.experts.3."
    assert np.array_equal(st[p + "w1.lora_A.weight"], a["layers.1.mlp.experts.linear_fc1.gate_proj.lora_A.weight"][3])
    assert np.array_equal(st[p + "w3.lora_B.weight"], a["layers.1.mlp.experts.linear_fc1.up_proj.lora_B.weight"][3])
    assert np.array_equal(st[p + "w2.lora_B.weight"], a["layers.1.mlp.experts.linear_fc2.lora_B.weight"][3])
    assert st[p + "w2.lora_A.weight"].shape == (4, HF_CONFIG["intermediate_size"])

    assert cli.main(["convert", "peft-to-megacore", out, str(tmp_path / "imp"), "--base", str(root)]) == 0
    back = peft.read_adapter(str(tmp_path / "imp"))
    assert set(back.tensors) == set(a)
    for n in a:
        assert np.array_equal(np.asarray(back.tensors[n]).view(np.uint8), a[n].view(np.uint8)), n
    assert cli.main(["convert", "megacore-to-peft", str(tmp_path / "imp"), str(tmp_path / "peft2"),
                        "--base-model-name", "org/tiny-mixtral"]) == 0
    assert open(tmp_path / "peft2" / "adapter_model.safetensors", "rb").read() == \
        open(tmp_path / "peft" / "adapter_model.safetensors", "rb").read()


def test_merged_mixtral_export_and_megacore_lora_forward_equal_the_merged_model(tmp_path, base):
    world = mc.comm.init_from_env("cpu")
    root, t = base
    c = convert.config_from_checkpoint(str(root))
    a = expert_adapter(c, 4, np.random.default_rng(4))
    save_adapter(tmp_path / "ad", a, 4, 8.0, root, TARGETS)
    scale = 2.0

    # The merged HF export: every targeted weight is W + scale · B A in HF's layout, per expert.
    convert.megacore_to_hf(str(tmp_path / "ad"), str(tmp_path / "merged_hf"))
    from test_convert import read_hf

    got = read_hf(str(tmp_path / "merged_hf"))
    want = {k: np.array(v, dtype=np.float64) for k, v in t.items()}
    for n, arr in peft.to_peft_tensors(peft.read_adapter(str(tmp_path / "ad"))).items():
        if n.endswith("lora_A.weight"):
            mod = n[len("base_model.model."):-len(".lora_A.weight")]
            b = peft.to_peft_tensors(peft.read_adapter(str(tmp_path / "ad")))[n.replace("lora_A", "lora_B")]
            want[mod + ".weight"] += scale * b.astype(np.float64) @ arr.astype(np.float64)
    assert set(got) == set(want)
    big = max(np.abs(v).max() for v in want.values())
    changed = 0
    for k in want:
        assert np.abs(got[k] - want[k]).max() <= 1e-6 * big, k
        changed += not np.array_equal(got[k], np.asarray(t[k]))
    assert changed == HF_CONFIG["num_hidden_layers"] * (1 + 3 * HF_CONFIG["num_local_experts"])

    tokens = np.random.default_rng(5).integers(0, 256, size=(2, 9)).astype(np.int64)
    m, _ = load_into_model(str(root), world)
    m.forward(tokens, tokens, training=False)
    base_logits = np.asarray(m.logits().numpy())[..., :256].copy()
    m.apply_lora(4, 8.0, 0.0, TARGETS)
    names = list(m.parameters())
    assert names and all("lora_" in n for n in names)
    assert "layers.0.mlp.experts.linear_fc1.gate_proj.lora_A.weight" in names
    ck.load(None, str(tmp_path / "ad"), [(n, data, list(data.shape), [0] * data.ndim)
                                         for n, (data, _) in m.parameters().items()])
    m.forward(tokens, tokens, training=False)
    lora_logits = np.asarray(m.logits().numpy())[..., :256].copy()
    m.merge_lora()
    m.forward(tokens, tokens, training=False)
    results = {"cpp_merge_lora": np.asarray(m.logits().numpy())[..., :256].copy(),
               "numpy_hf_forward": hf_llama_numpy(got, HF_CONFIG, tokens)}
    peft.merge(str(tmp_path / "ad"), str(tmp_path / "merged_mc"))
    convert.hf_to_megacore(str(tmp_path / "merged_hf"), str(tmp_path / "reimported"))
    for name in ("merged_mc", "reimported"):
        mm, _ = load_into_model(str(tmp_path / name), world)
        mm.forward(tokens, tokens, training=False)
        results[name] = np.asarray(mm.logits().numpy())[..., :256]
    top = np.abs(lora_logits).max()
    diff = np.abs(lora_logits - base_logits).max()
    print(f"expert adapters change the logits by {diff:.3g} (largest logit {top:.3g}); merged vs LoRA forward: "
          + ", ".join(f"{k} {np.abs(v - lora_logits).max():.3g}" for k, v in results.items()))
    assert diff > 0.05 * top  # the adapter matters, so the comparisons below can fail
    for k, v in results.items():
        assert np.abs(v - lora_logits).max() <= 1e-5 * top, k


def test_bad_expert_adapters_are_clear_errors(tmp_path, base):
    world = mc.comm.init_from_env("cpu")
    root, _ = base
    m, _ = load_into_model(str(root), world)
    with pytest.raises(mc.ConfigError, match="router, which stays frozen"):
        m.apply_lora(4, 8.0, 0.0, ["q_proj", "router"])
    c = convert.config_from_checkpoint(str(root))
    save_adapter(tmp_path / "ad", expert_adapter(c, 4, np.random.default_rng(0)), 4, 8.0, root, TARGETS)
    peft.export_peft(str(tmp_path / "ad"), str(tmp_path / "p"))
    st = ck.read_safetensors(str(tmp_path / "p" / "adapter_model.safetensors"))
    ck.write_safetensors(str(tmp_path / "p" / "adapter_model.safetensors"),
                         {k: np.array(v) for k, v in st.items() if ".experts.2." not in k})
    with pytest.raises(mc.ConfigError, match=r"lacks the adapters of experts \[2\]"):
        peft.import_peft(str(tmp_path / "p"), str(root), str(tmp_path / "imp"))
    assert not (tmp_path / "imp").exists()


@pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI")
def test_finetune_lora_on_experts_from_tiny_moe_at_ep2(tmp_path):
    pre = ["train", "--recipe", "tiny_moe", "--cpu", "--nproc-per-node", "2", "--set", "parallel.ep=2", "--set",
           "trainer.max_steps=4", "--set", "trainer.generate_tokens=0", "--set", "trainer.val_check_interval=0",
           "--set", "optim.lr_warmup_iters=2", "--set", f"data.cache_dir={tmp_path / 'data'}"]
    rc, out, err = _cli(pre, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(200):
            x, y = i % 9 + 1, (i * 7) % 9 + 1
            f.write(json.dumps({"input": f"what is {x} plus {y}?", "output": f"{x + y}"}) + "\n")
    ft = ["finetune", "--model", str(tmp_path / "runs" / "tiny_moe_pretrain" / "checkpoints"), "--data",
          str(tmp_path / "train.jsonl"), "--output", str(tmp_path / "ft"), "--lora-dim", "4", "--lora-alpha", "8",
          "--target-modules", "gate_proj", "up_proj", "down_proj", "--devices", "2", "--cpu", "--max-steps", "12",
          "--set", "parallel.ep=2", "--set", "optim.lr=1e-2",
          "--set", "data.seq_length=64", "--set", "data.global_batch_size=8", "--set", "data.micro_batch_size=4",
          "--set", "trainer.val_check_interval=0"]
    rc, out, err = _cli(ft, tmp_path)
    assert rc == 0, out[-3000:] + err[-3000:]
    m = re.search(r"trainable (\d+) of (\d+) parameters", out)
    assert m, out[-3000:]
    # The logged count is the adapters' (whole tensors, all experts over both EP ranks), and they are experts' only.
    ad = peft.read_adapter(str(tmp_path / "ft" / "checkpoints"))
    assert ad.tensors and all(".mlp.experts.linear_fc" in n for n in ad.tensors), sorted(ad.tensors)
    assert int(m.group(1)) == sum(int(np.asarray(v).size) for v in ad.tensors.values())
    a0 = np.asarray(ad.tensors["layers.0.mlp.experts.linear_fc1.gate_proj.lora_A.weight"])
    assert a0.shape[0] == 4 and a0.shape[1] == 4  # [E, r, h]: tiny_moe's 4 experts, r = 4
    steps, _ = _rows(tmp_path / "ft" / "logs")
    losses = [r["loss"] for r in steps]
    print("LoRA-on-experts fine-tuning losses (EP 2):", [round(x, 4) for x in losses])
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses  # measured 4.99 -> 3.96
    # The run's adapter as a Hugging Face PEFT adapter of the Mixtral the base exports as (experts' w1, w3, w2).
    assert "LoRA adapter (Hugging Face PEFT) ->" in out, out[-3000:]
    cfg = json.load(open(tmp_path / "ft" / "peft" / "adapter_config.json"))
    assert sorted(cfg["target_modules"]) == ["w1", "w2", "w3"], cfg
    assert (tmp_path / "ft" / "peft" / "adapter_model.safetensors").is_file()


def test_peft_library_loads_the_exported_mixtral_expert_adapter(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft_lib = pytest.importorskip("peft")
    torch.manual_seed(0)
    hc = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=1e6,
                                    num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    hf = transformers.MixtralForCausalLM(hc).float().eval()
    if not any(n.endswith("experts.0.w1") for n, _ in hf.named_modules()):
        pytest.skip(f"transformers {transformers.__version__} holds Mixtral's experts fused (no experts.E.w1 "
                    "modules), so PEFT cannot attach per-expert LoRA modules to them")
    err, effect = peft_library_vs_megacore(tmp_path, torch, peft_lib, hf,
                                           lambda c: (expert_adapter(c, 8, np.random.default_rng(7)), TARGETS), 8, 16.0)
    print(f"peft vs megacore merged (Mixtral experts): max |diff| / max |logit| = {err:.3g} (effect {effect:.3g})")
    assert effect > 0.01
    assert err <= 1e-4
