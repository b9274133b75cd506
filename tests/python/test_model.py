"""megacore.model / megacore.layers from Python, on one CPU rank (TP = 1).

The centrepiece is an independent reference: a small Llama forward written here in plain numpy (f64),
fed with megacore's own parameters, must agree with megacore's logits and loss. Tolerances (f32 model
against an f64 reference): logits within 1e-4 of the largest logit magnitude, loss within 1e-5 relative.
"""

import numpy as np
import pytest

import megacore
from megacore import layers, model


@pytest.fixture(scope="module")
def world():
    # A single process: MPI initialises as a singleton world of size 1.
    return megacore.comm.init_from_env("cpu")


# ----------------------------------------------------------------------------- numpy reference

def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, theta):
    """Rotate-half RoPE on [b, s, heads, d], positions 0..s-1."""
    s, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d // 2, dtype=np.float64) * 2.0 / d)
    ang = np.arange(s, dtype=np.float64)[:, None] * inv_freq[None, :]       # [s, d/2]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1)[None, :, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1)[None, :, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


def split_qkv(w, heads, groups, d):
    """megacore's fused QKV rows [per group g: its heads/groups query heads; k_g; v_g] → Wq, Wk, Wv."""
    hpg = heads // groups
    w = w.reshape(groups, hpg + 2, d, -1)
    wq = w[:, :hpg].reshape(heads * d, -1)   # query head i belongs to group i // hpg
    wk = w[:, hpg].reshape(groups * d, -1)
    wv = w[:, hpg + 1].reshape(groups * d, -1)
    return wq, wk, wv


def numpy_llama(p, cfg, tokens):
    """Logits [b, s, vocab] of a Llama-style decoder from parameters p (name → f64 array)."""
    h, heads, groups, d = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    ffn, eps = cfg.ffn_size, cfg.norm_eps
    b, s = tokens.shape
    x = p["embedding.weight"][tokens]                                        # [b, s, h]
    causal = np.tril(np.ones((s, s), dtype=bool))
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        n = rms_norm(x, p[pre + "input_layernorm.weight"], eps)
        wq, wk, wv = split_qkv(p[pre + "self_attention.linear_qkv.weight"], heads, groups, d)
        q = rope((n @ wq.T).reshape(b, s, heads, d), cfg.rope_theta)
        k = rope((n @ wk.T).reshape(b, s, groups, d), cfg.rope_theta)
        v = (n @ wv.T).reshape(b, s, groups, d)
        k = np.repeat(k, heads // groups, axis=2)                            # GQA: head i uses group i // hpg
        v = np.repeat(v, heads // groups, axis=2)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        scores = np.where(causal[None, None], scores, -np.inf)
        scores = scores - scores.max(axis=-1, keepdims=True)
        prob = np.exp(scores)
        prob /= prob.sum(axis=-1, keepdims=True)
        attn = np.einsum("bhqk,bkhd->bqhd", prob, v).reshape(b, s, heads * d)
        x = x + attn @ p[pre + "self_attention.linear_proj.weight"].T
        n = rms_norm(x, p[pre + "pre_mlp_layernorm.weight"], eps)
        fc1 = n @ p[pre + "mlp.linear_fc1.weight"].T                         # [gate | up] at TP = 1
        gate, up = fc1[..., :ffn], fc1[..., ffn:]
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ p[pre + "mlp.linear_fc2.weight"].T
    n = rms_norm(x, p["final_layernorm.weight"], eps)
    out = p["embedding.weight"] if cfg.tie_word_embeddings else p["output_layer.weight"]
    return (n @ out.T)[..., : cfg.vocab_size]


def cross_entropy(logits, labels, mask=None):
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    keep = labels != -100
    w = keep.astype(np.float64) * (1.0 if mask is None else mask)
    nll = -np.take_along_axis(logp, np.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
    return float((nll * w).sum() / w.sum())


def tiny_config():
    cfg = model.tiny_llama()
    cfg.num_layers = 2
    cfg.max_position_embeddings = 32
    cfg.init_method_std = 0.1  # larger than the default so attention is far from uniform
    cfg.seed = 7
    return cfg


def randomize_norms(m, rng):
    # Norm weights start at 1; give them values so a wrong norm or a swapped weight shows.
    for name, (data, _) in m.parameters().items():
        if "layernorm" in name:
            data.numpy()[...] = rng.uniform(0.5, 1.5, size=data.shape).astype(np.float32)


# ----------------------------------------------------------------------------- tests

def test_single_rank_world(world):
    assert world.size == 1 and world.rank == 0


def test_config_fields_presets_and_counts():
    cfg = model.tiny_llama()
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == (64, 8, 4)
    assert cfg.head_dim == 8 and cfg.qkv_width == (8 + 2 * 4) * 8
    cfg.hidden_size = 128
    cfg.normalization = "layernorm"  # strings convert, case-insensitively
    assert cfg.normalization == model.NormType.LayerNorm
    cfg.params_dtype = "bf16"
    assert cfg.params_dtype == "bf16"
    c2 = model.TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=100,
                                 max_position_embeddings=16)
    model.validate(c2)
    with pytest.raises(megacore.ValueError):
        model.TransformerConfig(hiden_size=32)
    for preset in (model.tiny_llama, model.tiny_gpt2, model.llama32_1b, model.llama3_8b, model.gpt2_124m):
        model.validate(preset(), 1)
    n = model.parameter_count(model.llama3_8b())["total"]
    assert 7.9e9 < n < 8.1e9, n
    assert 120e6 < model.parameter_count(model.gpt2_124m())["total"] < 130e6
    f = model.flops_per_token(model.llama3_8b(), 4096)
    assert f["total"] == pytest.approx(f["dense"] + f["attention"]) and f["dense"] > 6 * 6e9


def test_bad_config_raises_config_error_naming_the_fix(world):
    cfg = model.tiny_llama()
    cfg.num_attention_heads = 7  # 64 % 7 != 0, 7 % 4 groups != 0
    with pytest.raises(megacore.ConfigError) as e:
        model.validate(cfg, 1)
    msg = str(e.value)
    assert "num_attention_heads" in msg and "hidden_size" in msg
    with pytest.raises(megacore.ConfigError):
        model.GPTModel(cfg, world)
    cfg = model.tiny_llama()
    with pytest.raises(megacore.ConfigError) as e:
        model.validate(cfg, 3)  # 8 heads, 4 groups: not divisible by TP 3
    assert "3" in str(e.value)
    cfg.sequence_parallel = True
    with pytest.raises(megacore.ConfigError) as e:
        model.validate(cfg, 1)
    assert "sequence_parallel" in str(e.value)


def test_numpy_llama_matches_megacore_logits_and_loss(world):
    cfg = tiny_config()
    m = model.GPTModel(cfg, world, device="cpu")
    rng = np.random.default_rng(0)
    randomize_norms(m, rng)
    params = {k: np.array(d.numpy(), dtype=np.float64) for k, (d, _) in m.parameters().items()}
    assert "layers.0.self_attention.linear_qkv.weight" in params and "output_layer.weight" in params

    b, s = 2, 12
    tokens = rng.integers(0, cfg.vocab_size, size=(b, s), dtype=np.int64)
    labels = rng.integers(0, cfg.vocab_size, size=(b, s), dtype=np.int64)
    loss = m.forward(tokens, labels)
    logits = m.logits().numpy()
    assert logits.shape == (b, s, m.padded_vocab_size)

    ref = numpy_llama(params, cfg, tokens)
    got = logits[..., : cfg.vocab_size].astype(np.float64)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 1e-4, f"logits differ: max |diff| / max |ref| = {err:.3e}"
    assert np.abs(ref).max() > 0.1  # not a trivially small signal
    assert loss == pytest.approx(cross_entropy(ref, labels), rel=1e-5)

    # Ignored labels and a loss mask, passed as megacore tensors this time.
    labels2 = labels.copy()
    labels2[0, :3] = -100
    mask = rng.uniform(0, 1, size=(b, s)).astype(np.float32)
    loss2 = m.forward(megacore.from_numpy(tokens), megacore.from_numpy(labels2), megacore.from_numpy(mask))
    assert loss2 == pytest.approx(cross_entropy(ref, labels2, mask.astype(np.float64)), rel=1e-5)


def test_backward_zero_grad_and_keep_alive():
    import gc

    cfg = tiny_config()
    # The communicator is only referenced by the model: keep_alive must hold it.
    m = model.GPTModel(cfg, megacore.comm.init_from_env("cpu"))
    gc.collect()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, size=(2, 8))
    m.forward(tokens, np.roll(tokens, -1, axis=1))
    m.backward()
    grads = {k: g.numpy().copy() for k, (_, g) in m.parameters().items()}
    assert all(np.isfinite(g).all() for g in grads.values())
    assert all(np.abs(g).max() > 0 for g in grads.values()), [k for k, g in grads.items() if not np.abs(g).any()]
    m.zero_grad()
    assert all(not g.numpy().any() for _, (_, g) in m.parameters().items())


def test_column_parallel_linear_matches_numpy(world):
    rng = np.random.default_rng(2)
    lin = layers.ColumnParallelLinear(world, 16, 8, bias=True, init_std=0.3, seed=3)
    w, gw = lin.weight
    b, gb = lin.bias
    assert w.shape == (8, 16) and b.shape == (8,)
    b.numpy()[...] = rng.normal(size=8).astype(np.float32)
    x = rng.normal(size=(5, 3, 16)).astype(np.float32)
    y = lin.forward(x).numpy()
    W, B = w.numpy().astype(np.float64), b.numpy().astype(np.float64)
    np.testing.assert_allclose(y, x.astype(np.float64) @ W.T + B, rtol=1e-5, atol=1e-5)

    dy = rng.normal(size=(5, 3, 8)).astype(np.float32)
    dx = lin.backward(dy).numpy()
    np.testing.assert_allclose(dx, dy.astype(np.float64) @ W, rtol=1e-5, atol=1e-5)
    x2, dy2 = x.reshape(-1, 16).astype(np.float64), dy.reshape(-1, 8).astype(np.float64)
    np.testing.assert_allclose(gw.numpy(), dy2.T @ x2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gb.numpy(), dy2.sum(0), rtol=1e-5, atol=1e-5)


def test_row_parallel_linear_matches_numpy(world):
    rng = np.random.default_rng(3)
    lin = layers.RowParallelLinear(world, 12, 6, bias=False, init_std=0.3)
    assert lin.bias is None
    W = lin.weight[0].numpy().astype(np.float64)
    x = megacore.tensor(rng.normal(size=(4, 12)))
    y = lin.forward(x).numpy()
    np.testing.assert_allclose(y, x.numpy().astype(np.float64) @ W.T, rtol=1e-5, atol=1e-5)


def test_megacore_gradients_match_f64_finite_differences(world):
    """The whole model's gradient check in f64: central differences of the loss are taken in float64 on the
    independent numpy reference (whose forward equals megacore's, test above), at sampled entries of every
    parameter, and compared with megacore's backward. With eps = 1e-5 in f64 the differences are exact to
    ~1e-9; megacore's f32 gradients carry ~1e-6 relative rounding. Held to 1e-4 relative (norm over the sampled
    entries of each tensor), measured ~1e-6."""
    cfg = tiny_config()
    m = model.GPTModel(cfg, world, device="cpu")
    rng = np.random.default_rng(3)
    randomize_norms(m, rng)
    b, s = 2, 8
    tokens = rng.integers(0, cfg.vocab_size, size=(b, s), dtype=np.int64)
    labels = rng.integers(0, cfg.vocab_size, size=(b, s), dtype=np.int64)
    labels[1, 2] = -100
    mask = rng.uniform(0.2, 1.0, size=(b, s)).astype(np.float32)
    m.zero_grad()
    m.forward(tokens, labels, mask)
    m.backward()
    params = {k: np.array(d.numpy(), dtype=np.float64) for k, (d, _) in m.parameters().items()}
    grads = {k: np.array(g.numpy(), dtype=np.float64) for k, (_, g) in m.parameters().items()}

    def loss(p):
        return cross_entropy(numpy_llama(p, cfg, tokens), labels, mask.astype(np.float64))

    eps = 1e-5
    for name, w in params.items():
        flat = w.reshape(-1)
        if name == "embedding.weight":  # rows of the tokens seen carry gradient; one unseen row must be zero
            rows = np.unique(tokens)[:4]
            idx = [int(r) * w.shape[1] + int(c) for r in rows for c in rng.integers(0, w.shape[1], 2)]
            unseen = int(np.setdiff1d(np.arange(cfg.vocab_size), tokens)[0])
            idx.append(unseen * w.shape[1])
        else:
            idx = rng.choice(flat.size, size=min(8, flat.size), replace=False).tolist()
        fd = []
        for i in idx:
            keep = flat[i]
            flat[i] = keep + eps
            up = loss(params)
            flat[i] = keep - eps
            down = loss(params)
            flat[i] = keep
            fd.append((up - down) / (2 * eps))
        fd = np.array(fd)
        got = grads[name].reshape(-1)[idx]
        scale = max(np.linalg.norm(fd), 1e-3 * np.abs(grads[name]).max(), 1e-12)
        err = np.linalg.norm(got - fd) / scale
        assert err < 1e-4, f"{name}: megacore {got} vs f64 finite differences {fd} (rel {err:.2e})"
        if name == "embedding.weight":
            assert got[-1] == 0.0 and abs(fd[-1]) < 1e-9
