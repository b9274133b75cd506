"""megacore.ops from Python: attention against a numpy float64 reference (CPU), against torch SDPA and
torch autograd (GPU, cuDNN and flash backends), and bad calls that must raise."""

import numpy as np
import pytest

import megacore as mc


def _ref_attention(q, k, v, causal, scale=None):
    """float64 forward (out, lse) and a function giving (dq, dk, dv) for an upstream dout; [B, S, H, D]."""
    b, sq, h, d = q.shape
    skv, hk = k.shape[1], k.shape[2]
    g = h // hk
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    kk = np.repeat(k, g, axis=2)  # GQA: query head i uses kv head i // g
    vv = np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        s = np.where(np.triu(np.ones((sq, skv), bool), 1), -np.inf, s)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse = (np.log(p.sum(-1, keepdims=True)) + m)[..., 0]
    p = p / p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p, vv)

    def backward(dout):
        dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
        dp = np.einsum("bqhd,bkhd->bhqk", dout, vv)
        ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
        dq = np.einsum("bhqk,bkhd->bqhd", ds, kk)
        dk = np.einsum("bhqk,bqhd->bkhd", ds, q)
        fold = lambda x: x.reshape(b, skv, hk, g, d).sum(3)  # noqa: E731
        return dq, fold(dk), fold(dv)

    return out, lse, backward


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,skv,h,hk,d", [(13, 13, 4, 2, 16), (7, 19, 3, 1, 8), (21, 9, 2, 2, 32)])
def test_attention_cpu_matches_float64_reference(causal, sq, skv, h, hk, d):
    rng = np.random.default_rng()
    b = 2
    q = rng.standard_normal((b, sq, h, d), dtype=np.float32)
    k = rng.standard_normal((b, skv, hk, d), dtype=np.float32)
    v = rng.standard_normal((b, skv, hk, d), dtype=np.float32)
    dout = rng.standard_normal((b, sq, h, d), dtype=np.float32)
    out = np.full_like(q, np.nan)  # poisoned: every element must be written
    lse = np.full((b, h, sq), np.nan, np.float32)
    mc.ops.attention_forward(q, k, v, out, lse, causal=causal)
    ro, rl, rb = _ref_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal)
    np.testing.assert_allclose(out, ro, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, rl, rtol=1e-5, atol=1e-5)
    dq, dk, dv = (np.full_like(x, np.nan) for x in (q, k, v))
    mc.ops.attention_backward(q, k, v, out, lse, dout, dq, dk, dv, causal=causal)
    for got, want in zip((dq, dk, dv), rb(dout.astype(np.float64))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_attention_cpu_accepts_megacore_tensors_and_scale():
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 5, 2, 8), dtype=np.float32)
    out = mc.zeros((1, 5, 2, 8))
    lse = mc.zeros((1, 2, 5))
    mc.ops.attention_forward(mc.tensor(q), mc.tensor(q), mc.tensor(q), out, lse, softmax_scale=0.5)
    ro, rl, _ = _ref_attention(q.astype(np.float64), q.astype(np.float64), q.astype(np.float64), False, 0.5)
    np.testing.assert_allclose(np.asarray(out), ro, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), rl, rtol=1e-5, atol=1e-5)
    assert mc.ops.attention_resolve_backend(mc.tensor(q), mc.tensor(q)) == "reference"
    assert mc.ops.cudnn_attention_autotune() is False
    assert isinstance(mc.ops.attention_cudnn_available(), bool)


def test_attention_bad_calls_raise_typed_errors():
    q = np.zeros((1, 4, 2, 8), np.float32)
    lse = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(mc.ValueError, match="unknown attention backend 'fast'"):
        mc.ops.attention_forward(q, q, q, np.zeros_like(q), lse, backend="fast")
    with pytest.raises(mc.ValueError, match="non-contiguous numpy array"):
        mc.ops.attention_forward(q, q, q, np.zeros((1, 4, 2, 16), np.float32)[..., ::2], lse)
    with pytest.raises(mc.ValueError, match="is None"):
        mc.ops.attention_forward(q, q, q, None, lse)
    with pytest.raises(mc.ValueError, match="both cu_seqlens_q and cu_seqlens_kv"):
        mc.ops.attention_forward(q, q, q, np.zeros_like(q), lse, cu_seqlens_q=np.array([0, 4], np.int32))
    with pytest.raises(mc.ValueError):  # 3 query heads over 2 kv heads: not a GQA grouping
        mc.ops.attention_forward(np.zeros((1, 4, 3, 8), np.float32), q, q, np.zeros((1, 4, 3, 8), np.float32),
                                 np.zeros((1, 3, 4), np.float32))
    out = np.full_like(q, 7.0)
    with pytest.raises(mc.ValueError):  # lse of the wrong shape: nothing is written
        mc.ops.attention_forward(q, q, q, out, np.zeros((1, 4, 2), np.float32))
    assert np.all(out == 7.0)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_attention_gpu_on_torch_tensors_matches_torch(causal):
    torch = pytest.importorskip("torch")
    backends = ["flash"] + (["cudnn"] if mc.ops.attention_cudnn_available() else [])
    b, s, h, hk, d = 2, 333, 8, 2, 128
    for backend in backends:
        g = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 30)))
        q, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, s), float("nan"), device="cuda")
        mc.ops.attention_forward(q, k, v, out, lse, causal=causal, backend=backend)
        dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
        mc.ops.attention_backward(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, backend=backend)
        mc.synchronize("cuda:0")
        # torch in float32 from the same bf16 inputs
        qf, kf, vf = (x.float().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
        of = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=True)
        gq, gk, gv = torch.autograd.grad(of, (qf, kf, vf), dout.float().transpose(1, 2))
        # ||got - want|| / ||want|| as in the C++ GPU tests (bf16 outputs: 1e-2); lse is f32 (1e-3)
        def rel(got, want):
            return ((got.float() - want).norm() / want.norm()).item()

        assert rel(out, of.transpose(1, 2)) < 1e-2, backend
        for got, want in ((dq, gq), (dk, gk), (dv, gv)):
            assert rel(got, want.transpose(1, 2)) < 1e-2, backend
        sc = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(h // hk, dim=2)) / d ** 0.5
        if causal:
            sc = sc.masked_fill(torch.ones(sc.shape[-2:], dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        assert rel(lse, torch.logsumexp(sc, dim=-1)) < 1e-3, backend


@pytest.mark.gpu
def test_cudnn_attention_switch_from_python():
    """cuDNN is on by default inside Python where built in (docs/kernels.md, 'cuDNN inside the Python
    module'); the process-wide switch turns it off and on."""
    q = mc.zeros((1, 64, 2, 128), dtype="bf16", device="cuda:0")
    out = mc.zeros((1, 64, 2, 128), dtype="bf16", device="cuda:0")
    lse = mc.zeros((1, 2, 64), device="cuda:0")
    built = mc.ops.attention_cudnn_built()
    assert mc.ops.cudnn_attention_enabled()
    assert mc.ops.attention_cudnn_available() == built
    assert mc.ops.attention_resolve_backend(q, q, causal=True) == ("cudnn" if built else "flash")
    mc.ops.set_cudnn_attention_enabled(False)
    try:
        assert not mc.ops.attention_cudnn_available()
        assert mc.ops.attention_resolve_backend(q, q, causal=True) == "flash"
        why = "set_cudnn_attention_enabled\\(True\\)" if built else "built without cuDNN"
        with pytest.raises(mc.ValueError, match=why):
            mc.ops.attention_forward(q, q, q, out, lse, causal=True, backend="cudnn")
    finally:
        mc.ops.set_cudnn_attention_enabled(True)
    assert mc.ops.attention_resolve_backend(q, q, causal=True) == ("cudnn" if built else "flash")
    if built:  # the call that used to crash inside Python: build and run a cuDNN graph
        out = mc.full(out.shape, float("nan"), dtype="bf16", device="cuda:0")
        lse = mc.full(lse.shape, float("nan"), device="cuda:0")
        mc.ops.attention_forward(q, q, q, out, lse, causal=True, backend="cudnn")
        # zero scores: causal row i averages i + 1 zero values, so lse = log(i + 1) and out = 0
        want = np.broadcast_to(np.log(np.arange(1, 65, dtype=np.float64)), (2, 64)).ravel()
        np.testing.assert_allclose(lse.tolist_flat(), want, rtol=1e-5, atol=1e-5)
        assert not np.any(out.tolist_flat())


@pytest.mark.gpu
def test_cudnn_choice_is_logged_once_per_process_at_debug_level():
    """Sampling runs attention at a new length per generated token: the cuDNN choice is one debug line per
    process, not one line per shape (and none at the default level)."""
    import os
    import subprocess
    import sys

    if not mc.ops.attention_cudnn_available():
        pytest.skip("built without cuDNN SDPA")
    code = """
import megacore as mc
for s in range(60, 72):
    q = mc.zeros((1, s, 2, 128), dtype="bf16", device="cuda:0")
    out = mc.zeros((1, s, 2, 128), dtype="bf16", device="cuda:0")
    lse = mc.zeros((1, 2, s), device="cuda:0")
    mc.ops.attention_forward(q, q, q, out, lse, causal=True)
mc.synchronize("cuda:0")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("MEGACORE_LOG_LEVEL", None)
    for level, lines in ((None, 0), ("debug", 1)):
        e = dict(env, **({"MEGACORE_LOG_LEVEL": level} if level else {}))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("using cuDNN SDPA") == lines, r.stderr


# ---- grouped GEMM over experts (megacore.ops.grouped_gemm_*) ----

def _ref_grouped(x, w, dy, sizes):
    """float64 per-group products: y_g = x_g w_g^T, dx_g = dy_g w_g, dw_g = dy_g^T x_g."""
    off = np.concatenate([[0], np.cumsum(sizes)])
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    y = np.zeros((x.shape[0], w.shape[1]))
    dx = np.zeros((x.shape[0], w.shape[2]))
    dw = np.zeros(w.shape)
    for g in range(len(sizes)):
        r = slice(off[g], off[g + 1])
        y[r] = x64[r] @ w64[g].T
        dx[r] = dy64[r] @ w64[g]
        dw[g] = dy64[r].T @ x64[r]
    return y, dx, dw


@pytest.mark.parametrize("sizes", [[3, 0, 7, 1, 5], [0, 0, 9], [4]])
def test_grouped_gemm_cpu_matches_float64_reference(sizes):
    rng = np.random.default_rng()
    g, m, k, n = len(sizes), 6, 5, sum(sizes)
    x = rng.standard_normal((n, k), dtype=np.float32)
    w = rng.standard_normal((g, m, k), dtype=np.float32)
    dy = rng.standard_normal((n, m), dtype=np.float32)
    y_ref, dx_ref, dw_ref = _ref_grouped(x, w, dy, sizes)
    y = np.full((n, m), np.nan, np.float32)
    dx = np.full((n, k), np.nan, np.float32)
    mc.ops.grouped_gemm_forward(x, w, sizes, y)
    mc.ops.grouped_gemm_dgrad(dy, w, np.array(sizes), dx)  # numpy sizes are taken too
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    dw0 = rng.standard_normal(w.shape, dtype=np.float32)
    dw = dw0.copy()
    mc.ops.grouped_gemm_wgrad(dy, x, tuple(sizes), dw)  # beta = 1 accumulates (an empty group keeps dw_g)
    np.testing.assert_allclose(dw, dw0 + dw_ref, rtol=1e-5, atol=1e-5)
    dw = dw0.copy()
    mc.ops.grouped_gemm_wgrad(dy, x, sizes, dw, beta=0.5)
    np.testing.assert_allclose(dw, 0.5 * dw0 + dw_ref, rtol=1e-5, atol=1e-5)


def test_grouped_gemm_bad_calls_raise_typed_errors():
    x = np.zeros((6, 4), np.float32)
    w = np.zeros((2, 3, 4), np.float32)
    y = np.zeros((6, 3), np.float32)
    with pytest.raises(mc.ValueError, match="sum to 5 but the input has 6 rows"):
        mc.ops.grouped_gemm_forward(x, w, [2, 3], y)
    with pytest.raises(mc.ValueError, match="3 group sizes for 2 expert weights"):
        mc.ops.grouped_gemm_forward(x, w, [2, 2, 2], y)
    with pytest.raises(mc.ValueError, match=r"group_sizes\[1\] = -1 is negative"):
        mc.ops.grouped_gemm_forward(x, w, [7, -1], y)
    with pytest.raises(mc.ValueError, match="features"):
        mc.ops.grouped_gemm_forward(np.zeros((6, 5), np.float32), w, [3, 3], y)
    with pytest.raises(mc.ValueError, match="dw must be"):
        mc.ops.grouped_gemm_wgrad(y, x, [3, 3], np.zeros((2, 4, 3), np.float32))

    class DeviceArray:  # what a CUDA torch tensor or cupy array says through DLPack
        def __dlpack_device__(self):
            return (2, 0)

        def __iter__(self):
            raise AssertionError("a device array must be refused before it is read")

    bad_sizes = [
        ([3.5, 2.5], r"group_sizes\[0\] is 3.5, not an integer"),
        (np.array([3.0, 3.0]), "dtype float64"),
        (np.array([True, False]), "dtype bool"),
        (np.array([[3], [3]]), "2 dimensions"),
        ([True, 5], "a bool"),
        ("33", "group_sizes is '33'"),
        (b"\x03\x03", "group_sizes is b"),
        ({3, 4}, "group_sizes is"),
        ([2 ** 63, 0], "does not fit in int64"),
        (DeviceArray(), "DLPack device type 2"),
        (7, "must be a sequence"),
        (mc.tensor([3.0, 3.0]), "dtype float32"),
    ]
    for sizes, message in bad_sizes:
        with pytest.raises(mc.ValueError, match=message):
            mc.ops.grouped_gemm_forward(x, w, sizes, y)
    # host integers in any of the accepted forms
    for sizes in ([3, 3], (3, 3), np.array([3, 3], np.int32), np.array([3, 3], np.uint64), [np.int64(3), 3],
                  mc.tensor([3, 3], dtype="i64")):
        mc.ops.grouped_gemm_forward(x, w, sizes, y)
    with pytest.raises(mc.ConfigError, match="auto, loop, grouped or sm90"):
        mc.ops.set_grouped_gemm_path("fastest")
    assert mc.ops.grouped_gemm_path() in ("auto", "loop", "grouped", "sm90")
    assert mc.ops.grouped_gemm_sm90_available("cpu") is False


@pytest.mark.gpu
def test_grouped_gemm_gpu_on_torch_tensors_every_path():
    """bf16 torch tensors through each CUDA path against torch f32 products of the same inputs. The sizes hold an
    empty group, tails of 1, 63, 64 and 65 rows past whole 128-row tiles and enough rows per group (294 on average)
    for the Hopper kernel's 64 x 256 tail tiles; M = 120 gives the forward output a single 128-column n-tile."""
    torch = pytest.importorskip("torch")
    sizes = [0, 257, 319, 320, 321, 1, 600, 130, 700]
    gen = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 30)))
    n = sum(sizes)
    paths = ["auto", "loop", "grouped"] + (["sm90"] if mc.ops.grouped_gemm_sm90_available("cuda:0") else [])
    before = mc.ops.grouped_gemm_path()
    try:
        for m, k in ((120, 256), (264, 136)):
            x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            w = torch.randn(len(sizes), m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            dy = torch.randn(n, m, device="cuda", dtype=torch.bfloat16, generator=gen)
            xs, dys = x.float().split(sizes), dy.float().split(sizes)
            y_ref = torch.cat([a @ w[g].float().T for g, a in enumerate(xs)])
            dx_ref = torch.cat([a @ w[g].float() for g, a in enumerate(dys)])
            dw_ref = torch.stack([dys[g].T @ xs[g] for g in range(len(sizes))])
            for path in paths:
                mc.ops.set_grouped_gemm_path(path)
                launches = mc.ops.grouped_gemm_sm90_launches()
                y, dx = torch.full((n, m), float("nan"), device="cuda", dtype=torch.bfloat16), torch.empty_like(x)
                dx.fill_(float("nan"))
                assert mc.ops.grouped_gemm_path() == path
                dw0 = torch.randn(w.shape, device="cuda", generator=gen)
                dw = dw0.clone()
                mc.ops.grouped_gemm_forward(x, w, sizes, y)
                mc.ops.grouped_gemm_dgrad(dy, w, sizes, dx)
                mc.ops.grouped_gemm_wgrad(dy, x, sizes, dw)
                mc.synchronize("cuda:0")
                # the path switch holds: loop and grouped never reach the Hopper kernel, auto and sm90 run all three
                # products on it where it is available
                on_hopper = path in ("auto", "sm90") and mc.ops.grouped_gemm_sm90_available("cuda:0")
                assert mc.ops.grouped_gemm_sm90_launches() == launches + (3 if on_hopper else 0), path

                def rel(got, want):
                    return ((got.float() - want).norm() / want.norm()).item()

                # bf16 outputs: 1e-2 relative (as the C++ GPU tests); the f32 main grad: 1e-3
                assert rel(y, y_ref) < 1e-2, (path, m, k)
                assert rel(dx, dx_ref) < 1e-2, (path, m, k)
                assert rel(dw - dw0, dw_ref) < 1e-3, (path, m, k)
                assert torch.equal(dw[0], dw0[0]), path  # the empty group keeps its main grad
    finally:
        mc.ops.set_grouped_gemm_path(before)
