"""LoRA adapters out of and into megacore: merge, Hugging Face PEFT export and import.

1. Round trip: a random adapter on an imported Llama (GQA, q/k/v/o and gate/up/down targets) exported as
   PEFT and imported back gives the same tensors bit for bit and the same settings.
2. Merge: the merged export's Hugging Face weights equal W + alpha/r · B A computed directly in HF's layout
   (f32, 1e-6 of the largest weight), so the fused-QKV and [gate; up] placement is right.
3. megacore's own LoRA forward (GPTModel.apply_lora with the adapter loaded) gives the logits of the merged
   model (Python merge, exported to HF and imported back) and of GPTModel.merge_lora, within 1e-5 of the
   largest logit (f32, only summation order differs).
4. With torch, transformers and peft installed: the exported adapter loads with peft.PeftModel on the
   LlamaForCausalLM transformers wrote, and its logits equal megacore's merged model's (f32, 1e-4).
5. Bad input: an adapter for another base, a non-LoRA PEFT adapter, a missing base: typed errors naming it.
"""

import json

import numpy as np
import pytest

import megacore as mc
from megacore import checkpoint as ck
from megacore import cli, convert, peft

from test_convert import hf_llama_numpy, llama_hf_config, llama_hf_tensors, load_into_model, read_hf, write_hf

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapter(c, r, rng, targets=TARGETS, layers=None):
    """megacore-named adapter tensors for config dict c (HF-shaped fan-in/out), B non-zero so merging matters."""
    h, H, G, d, f = c["hidden_size"], c["num_attention_heads"], c["num_query_groups"], c["kv_channels"], \
        c["ffn_hidden_size"]
    shapes = {"q_proj": ("self_attention.linear_qkv.q_proj", h, H * d),
              "k_proj": ("self_attention.linear_qkv.k_proj", h, G * d),
              "v_proj": ("self_attention.linear_qkv.v_proj", h, G * d),
              "o_proj": ("self_attention.linear_proj", H * d, h), "gate_proj": ("mlp.linear_fc1.gate_proj", h, f),
              "up_proj": ("mlp.linear_fc1.up_proj", h, f), "down_proj": ("mlp.linear_fc2", f, h)}
    t = {}
    for i in range(layers or c["num_layers"]):
        for name in targets:
            mod, fin, fout = shapes[name]
            t[f"layers.{i}.{mod}.lora_A.weight"] = (rng.standard_normal((r, fin)) * 0.2).astype(np.float32)
            t[f"layers.{i}.{mod}.lora_B.weight"] = (rng.standard_normal((fout, r)) * 0.2).astype(np.float32)
    return t


def save_adapter(root, tensors, r, alpha, base, targets=TARGETS):
    blob = {"scheme": "lora", "dim": r, "alpha": alpha, "dropout": 0.05, "target_modules": list(targets),
            "pretrained_checkpoint": str(base)}
    return ck.save_full_checkpoint(str(root), 0, tensors, {"peft": blob})


@pytest.fixture
def base(tmp_path):
    """An imported HF Llama (GQA 4/2 heads, untied) and its HF config/tensors."""
    hc = llama_hf_config(tied=False, scaling=False)
    hc["vocab_size"] = 128
    t = llama_hf_tensors(hc, np.random.default_rng(3))
    write_hf(tmp_path / "hf", hc, t)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "base"))
    return tmp_path / "base", hc, t


def test_peft_export_import_round_trip_is_exact(tmp_path, base):
    root, hc, _ = base
    c = convert.config_from_checkpoint(str(root))
    a = random_adapter(c, 4, np.random.default_rng(0))
    save_adapter(tmp_path / "ad", a, 4, 8.0, root)
    out = peft.export_peft(str(tmp_path / "ad"), str(tmp_path / "peft"), base_model_name_or_path="org/tiny-llama")
    cfg = json.load(open(tmp_path / "peft" / "adapter_config.json"))
    assert (cfg["peft_type"], cfg["task_type"], cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == \
        ("LORA", "CAUSAL_LM", 4, 8.0, 0.05)
    assert cfg["base_model_name_or_path"] == "org/tiny-llama"
    assert sorted(cfg["target_modules"]) == sorted(TARGETS)
    st = ck.read_safetensors(str(tmp_path / "peft" / "adapter_model.safetensors"))
    q_a = st["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    k_b = st["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"]
    assert q_a.shape == (4, 32) and k_b.shape == (2 * 8, 4)
    assert np.array_equal(st["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"],
                          a["layers.0.mlp.linear_fc2.lora_B.weight"])
    assert len(st) == 2 * 7 * hc["num_hidden_layers"]

    # Import onto the base through the CLI, export again: identical tensors and settings.
    assert cli.main(["convert", "peft-to-megacore", out, str(tmp_path / "imp"), "--base", str(root)]) == 0
    back = peft.read_adapter(str(tmp_path / "imp"))
    assert set(back.tensors) == set(a)
    for n in a:
        assert np.array_equal(np.asarray(back.tensors[n]).view(np.uint8), a[n].view(np.uint8)), n
    assert (back.lora.dim, back.lora.alpha, back.lora.dropout) == (4, 8.0, 0.05)
    assert cli.main(["convert", "megacore-to-peft", str(tmp_path / "imp"), str(tmp_path / "peft2"),
                     "--base-model-name", "org/tiny-llama"]) == 0
    assert open(tmp_path / "peft2" / "adapter_model.safetensors", "rb").read() == \
        open(tmp_path / "peft" / "adapter_model.safetensors", "rb").read()
    assert json.load(open(tmp_path / "peft2" / "adapter_config.json")) == cfg


@pytest.mark.parametrize("targets", [TARGETS, ["q_proj", "v_proj"], ["k_proj", "up_proj", "down_proj"]])
def test_merged_export_equals_base_plus_scaled_BA_in_hf_layout(tmp_path, base, targets):
    root, hc, t = base
    c = convert.config_from_checkpoint(str(root))
    a = random_adapter(c, 3, np.random.default_rng(1), targets)
    save_adapter(tmp_path / "ad", a, 3, 6.0, root, targets)
    assert cli.main(["convert", "megacore-to-hf", str(tmp_path / "ad"), str(tmp_path / "merged")]) == 0
    got = read_hf(str(tmp_path / "merged"))
    peft_t = peft.to_peft_tensors(peft.read_adapter(str(tmp_path / "ad")))
    want = {k: np.array(v, dtype=np.float64) for k, v in t.items()}
    for n in list(peft_t):
        if n.endswith("lora_A.weight"):
            mod = n[len("base_model.model."):-len(".lora_A.weight")]
            want[mod + ".weight"] += 2.0 * peft_t[n.replace("lora_A", "lora_B")].astype(np.float64) @ peft_t[n]
    assert set(got) == set(want)
    scale = max(np.abs(v).max() for v in want.values())
    changed = 0
    for k in want:
        assert np.abs(got[k] - want[k]).max() <= 1e-6 * scale, k
        changed += not np.array_equal(got[k], np.asarray(t[k]))
    assert changed == len(targets) * hc["num_hidden_layers"]
    # And the merged model is a working Llama: the HF-layout numpy forward of merged weights runs.
    tokens = np.random.default_rng(2).integers(0, 128, size=(1, 5))
    assert np.isfinite(hf_llama_numpy(got, hc, tokens)).all()


def test_megacore_lora_forward_equals_merged_model(tmp_path, base):
    world = mc.comm.init_from_env("cpu")
    root, hc, _ = base
    c = convert.config_from_checkpoint(str(root))
    a = random_adapter(c, 4, np.random.default_rng(4))
    save_adapter(tmp_path / "ad", a, 4, 8.0, root)
    tokens = np.random.default_rng(5).integers(0, 128, size=(2, 9)).astype(np.int64)

    m, cfg = load_into_model(str(root), world)
    m.forward(tokens, tokens, training=False)
    base_logits = np.asarray(m.logits().numpy())[..., :128].copy()
    m.apply_lora(4, 8.0, 0.0, TARGETS)
    assert m.has_lora and all("lora_" in n for n in m.parameters())
    ck.load(None, str(tmp_path / "ad"), [(n, data, list(data.shape), [0] * data.ndim)
                                         for n, (data, _) in m.parameters().items()])
    m.forward(tokens, tokens, training=False)
    lora_logits = np.asarray(m.logits().numpy())[..., :128].copy()
    m.merge_lora()
    m.forward(tokens, tokens, training=False)
    cpp_merged = np.asarray(m.logits().numpy())[..., :128].copy()

    peft.merge(str(tmp_path / "ad"), str(tmp_path / "merged_mc"))
    convert.megacore_to_hf(str(tmp_path / "ad"), str(tmp_path / "merged_hf"))
    convert.hf_to_megacore(str(tmp_path / "merged_hf"), str(tmp_path / "reimported"))
    results = {}
    for name in ("merged_mc", "reimported"):
        mm, _ = load_into_model(str(tmp_path / name), world)
        mm.forward(tokens, tokens, training=False)
        results[name] = np.asarray(mm.logits().numpy())[..., :128]
    scale = np.abs(lora_logits).max()
    diff = np.abs(lora_logits - base_logits).max()
    print(f"adapter changes the logits by {diff:.3g} (largest logit {scale:.3g}); merged vs LoRA forward: "
          + ", ".join(f"{k} {np.abs(v - lora_logits).max():.3g}" for k, v in
                      dict(results, cpp_merge_lora=cpp_merged).items()))
    assert diff > 0.05 * scale  # the adapter matters, so the comparison below can fail
    for v in list(results.values()) + [cpp_merged]:
        assert np.abs(v - lora_logits).max() <= 1e-5 * scale


def test_bad_adapters_are_clear_errors(tmp_path, base):
    root, hc, _ = base
    c = dict(convert.config_from_checkpoint(str(root)))
    other = dict(c, hidden_size=48)  # an adapter made for a wider model
    save_adapter(tmp_path / "ad", random_adapter(other, 4, np.random.default_rng(0), ["q_proj"]), 4, 8.0, root,
                 ["q_proj"])
    with pytest.raises(mc.ConfigError, match="do not fit this base model"):
        peft.merge(str(tmp_path / "ad"), str(tmp_path / "m"))
    assert not (tmp_path / "m").exists()
    save_adapter(tmp_path / "ad2", random_adapter(c, 4, np.random.default_rng(0), ["q_proj"]), 4, 8.0,
                 tmp_path / "nope", ["q_proj"])
    with pytest.raises(mc.IOError, match="--base PATH"):
        convert.megacore_to_hf(str(tmp_path / "ad2"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    convert.megacore_to_hf(str(tmp_path / "ad2"), str(tmp_path / "out"), base=str(root))  # with the base: fine
    with pytest.raises(mc.ConfigError, match="holds no LoRA adapters"):
        peft.export_peft(str(root), str(tmp_path / "p"))
    # A PEFT adapter that is not plain LoRA, or targets a module megacore does not have.
    peft.export_peft(str(tmp_path / "ad2"), str(tmp_path / "p"), base=str(root))
    cfg = json.load(open(tmp_path / "p" / "adapter_config.json"))
    json.dump(dict(cfg, use_dora=True), open(tmp_path / "p" / "adapter_config.json", "w"))
    with pytest.raises(mc.ConfigError, match="use_dora"):
        peft.import_peft(str(tmp_path / "p"), str(root), str(tmp_path / "imp"))
    json.dump(cfg, open(tmp_path / "p" / "adapter_config.json", "w"))
    with pytest.raises(mc.IOError, match="hf-to-megacore"):
        peft.import_peft(str(tmp_path / "p"), str(tmp_path / "nope"), str(tmp_path / "imp"))
    st = ck.read_safetensors(str(tmp_path / "p" / "adapter_model.safetensors"))
    ck.write_safetensors(str(tmp_path / "p" / "adapter_model.safetensors"),
                         {k.replace("q_proj", "qkv_proj"): np.array(v) for k, v in st.items()})
    with pytest.raises(mc.ConfigError, match="supported modules"):
        peft.import_peft(str(tmp_path / "p"), str(root), str(tmp_path / "imp"))
    assert not (tmp_path / "imp").exists()


def peft_library_vs_megacore(tmp_path, torch, peft_lib, hf, make_adapter, r, alpha, vocab=256):
    """Saves the transformers model ``hf``, imports it, puts the adapter ``make_adapter(config dict)`` on it, exports
    it as PEFT and loads that with ``peft`` onto ``hf``. Returns (max |megacore merged − peft logits|, max |base −
    peft logits|), each over the largest peft logit."""
    world = mc.comm.init_from_env("cpu")
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "base"))
    c = convert.config_from_checkpoint(str(tmp_path / "base"))
    tensors, targets = make_adapter(c)
    save_adapter(tmp_path / "ad", tensors, r, alpha, tmp_path / "base", targets)
    peft.export_peft(str(tmp_path / "ad"), str(tmp_path / "peft"))
    pm = peft_lib.PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    peft.merge(str(tmp_path / "ad"), str(tmp_path / "merged"))
    tokens = np.random.default_rng(1).integers(0, vocab, size=(2, 12)).astype(np.int64)
    logits = {}
    for name in ("merged", "base"):
        m, _ = load_into_model(str(tmp_path / name), world)
        m.forward(tokens, tokens, training=False)
        logits[name] = np.asarray(m.logits().numpy())[..., :vocab].astype(np.float64)
    with torch.no_grad():
        want = pm(torch.from_numpy(tokens)).logits.double().numpy()
    top = np.abs(want).max()
    return np.abs(logits["merged"] - want).max() / top, np.abs(logits["base"] - want).max() / top


def _check_peft_library(tmp_path, torch, peft_lib, hf, what):
    """The adapter exported as PEFT, loaded by the peft library onto ``hf``, gives megacore's merged logits (1e-4),
    and the adapter changes the logits (a dropped or misplaced adapter would fail)."""
    err, effect = peft_library_vs_megacore(tmp_path, torch, peft_lib, hf,
                                           lambda c: (random_adapter(c, 8, np.random.default_rng(7)), TARGETS), 8, 16.0)
    print(f"peft vs megacore merged ({what}): max |diff| / max |logit| = {err:.3g} (the adapter's effect: {effect:.3g})")
    assert effect > 0.01
    assert err <= 1e-4


def test_peft_library_loads_the_exported_adapter_with_megacore_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft_lib = pytest.importorskip("peft")
    torch.manual_seed(0)
    hc = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                  rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=False)
    _check_peft_library(tmp_path, torch, peft_lib, transformers.LlamaForCausalLM(hc).float().eval(), "Llama")


def test_peft_library_loads_an_exported_qwen3_adapter_with_megacore_logits(tmp_path):
    """The same for a Qwen3ForCausalLM base (per-head q/k norms): its modules have Llama's names."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft_lib = pytest.importorskip("peft")
    torch.manual_seed(0)
    hc = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                                  rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=False)
    hf = transformers.Qwen3ForCausalLM(hc).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    _check_peft_library(tmp_path, torch, peft_lib, hf, "Qwen3")
