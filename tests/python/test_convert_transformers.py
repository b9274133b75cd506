"""megacore ↔ transformers logits, both directions (skipped without torch and transformers).

1. Export: a megacore model (tiny Llama with GQA and llama3 RoPE scaling, untied; tiny GPT-2, tied) with
   randomised parameters (norms and biases included) is saved as a megacore checkpoint, exported with
   megacore_to_hf, loaded with transformers' AutoModelForCausalLM, and both give the same logits.
   A checkpoint written by `megacore train` (tiny recipe on CPU ranks, needs MPI) exports through the CLI and
   gives the same logits in LlamaForCausalLM.
2. Import: a tiny LlamaForCausalLM initialised by transformers (GQA, llama3 scaling, tied and untied) is
   written with save_pretrained (safetensors), imported with hf_to_megacore, loaded into a megacore
   GPTModel through the C++ resharding loader, and gives transformers' logits.

Both run in f32 on the CPU. The implementations differ only in summation order and in how softmax and
RoPE are evaluated, so we hold the logits to 1e-4 of their largest magnitude (measured differences are
around 1e-6 of it).
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import megacore as mc  # noqa: E402
from megacore import checkpoint as ck  # noqa: E402
from megacore import cli, convert, model  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def world():
    return mc.comm.init_from_env("cpu")


def _close(got, want):
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL * np.abs(want).max(), np.abs(got - want).max()


def save_model(m, cfg, world, root):
    tensors = []
    for name, (data, _) in m.parameters().items():
        shape = list(data.shape)
        if name in ("embedding.weight", "output_layer.weight"):
            shape[0] = cfg.vocab_size
        tensors.append((name, data, shape, [0] * len(shape)))
    ck.save(world, root, 0, tensors, json={"config": json.dumps(convert.config_dict(cfg))})


def megacore_logits(m, cfg, tokens):
    m.forward(tokens, tokens, training=False)
    return np.asarray(m.logits().numpy())[..., :cfg.vocab_size].astype(np.float64)


def hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.from_numpy(tokens)).logits.double().numpy()


def llama_cfg():
    cfg = model.tiny_llama()
    cfg.num_layers = 2
    cfg.rope_theta = 50000.0
    r = model.RopeScaling()
    r.type = model.RopeScalingType("Llama3")
    r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings = 8.0, 1.0, 4.0, 16
    cfg.rope_scaling = r
    return cfg


@pytest.mark.parametrize("flavour", ["llama", "gpt2"])
def test_exported_megacore_model_gives_same_logits_in_transformers(tmp_path, world, flavour):
    cfg = llama_cfg() if flavour == "llama" else model.tiny_gpt2()
    m = model.GPTModel(cfg, world)
    rng = np.random.default_rng(0)
    for name, (data, _) in m.parameters().items():
        a = data.numpy()
        a[...] = (rng.standard_normal(a.shape) * (0.3 if "norm" in name else 0.05) + (1.0 if "norm" in name and
                  name.endswith("weight") else 0.0)).astype(np.float32)
    save_model(m, cfg, world, str(tmp_path / "mc"))
    convert.megacore_to_hf(str(tmp_path / "mc"), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    hf.eval()
    tokens = rng.integers(0, cfg.vocab_size, size=(2, 12)).astype(np.int64)
    _close(megacore_logits(m, cfg, tokens), hf_logits(hf, tokens))


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_llama_imports_with_same_logits(tmp_path, world, tied):
    torch.manual_seed(0)
    hc = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                  rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=tied,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    hf = transformers.LlamaForCausalLM(hc).float().eval()
    with torch.no_grad():  # the default init leaves norms at 1: randomise them so they are tested
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    convert.hf_to_megacore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    cfg = convert.transformer_config(convert.config_from_checkpoint(str(tmp_path / "mc")))
    assert cfg.query_groups == 2 and cfg.tie_word_embeddings == tied
    m = model.GPTModel(cfg, world)
    targets = []
    for name, (data, _) in m.parameters().items():
        shape = list(data.shape)
        if name in ("embedding.weight", "output_layer.weight"):
            shape[0] = cfg.vocab_size
        targets.append((name, data, shape, [0] * len(shape)))
    ck.load(None, str(tmp_path / "mc"), targets)
    tokens = np.random.default_rng(1).integers(0, 256, size=(2, 12)).astype(np.int64)
    _close(megacore_logits(m, cfg, tokens), hf_logits(hf, tokens))


@pytest.mark.skipif(not mc.comm.mpi_available(), reason="built without MPI (the trainer runs on CPU ranks)")
def test_trained_checkpoint_exports_to_transformers_with_same_logits(tmp_path, world):
    """What `megacore train` writes (tiny recipe, TP = 2 on CPU ranks, a few steps) exported with
    `megacore convert megacore-to-hf ROOT OUT` loads in LlamaForCausalLM and gives megacore's logits (f32)."""
    from test_convert_trained import train_tiny

    r = train_tiny(tmp_path, steps=3, save_interval=0)
    root = r.checkpoint.save_dir
    out = str(tmp_path / "hf")
    assert cli.main(["convert", "megacore-to-hf", root, out]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(out).float().eval()
    assert hf.config.vocab_size == 259 and hf.config.num_key_value_heads == r.model.num_query_groups
    assert hf.config.eos_token_id == 256 and hf.generation_config.eos_token_id == 256
    cfg = convert.transformer_config(convert.config_from_checkpoint(root))
    m = model.GPTModel(cfg, world)
    targets = []
    for name, (data, _) in m.parameters().items():
        shape = list(data.shape)
        if name in ("embedding.weight", "output_layer.weight"):
            shape[0] = cfg.vocab_size
        targets.append((name, data, shape, [0] * len(shape)))
    ck.load(None, root, targets)
    tokens = np.random.default_rng(2).integers(0, 259, size=(2, 16)).astype(np.int64)
    _close(megacore_logits(m, cfg, tokens), hf_logits(hf, tokens))
