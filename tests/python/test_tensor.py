"""megacore.Tensor from Python: numpy sharing, factories, views, errors."""

import numpy as np
import pytest

import megacore as mc


def test_numpy_round_trip_shares_memory():
    rng = np.random.default_rng()
    a = rng.standard_normal((5, 7)).astype(np.float32)
    t = mc.from_numpy(a)
    assert t.shape == (5, 7) and t.dtype == "f32" and t.device == "cpu"
    assert t.data_ptr == a.ctypes.data
    b = np.asarray(t)
    assert b.ctypes.data == a.ctypes.data
    a[2, 3] = 42.0
    assert b[2, 3] == 42.0                     # writes through numpy are visible through megacore
    t.select(0, 1).fill_(-1.0)
    assert (a[1] == -1.0).all()                # and the other way round
    np.testing.assert_array_equal(t.numpy(), a)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64, np.uint8])
def test_numpy_dtypes_and_strided_views(dtype):
    a = (np.arange(60).reshape(3, 4, 5) % 50).astype(dtype)
    t = mc.from_numpy(a)
    np.testing.assert_array_equal(np.asarray(t.transpose(0, 2)), a.transpose(2, 1, 0))
    np.testing.assert_array_equal(np.asarray(t.slice(2, 1, 5, 2)), a[:, :, 1:5:2])
    np.testing.assert_array_equal(np.asarray(t.permute([1, 2, 0]).contiguous()), a.transpose(1, 2, 0))
    sliced = mc.from_numpy(a[:, ::2])          # numpy views come in with their strides
    np.testing.assert_array_equal(np.asarray(sliced), a[:, ::2])


def test_bf16_conversion_matches_rounding_reference():
    rng = np.random.default_rng()
    a = (rng.standard_normal(10001) * 100).astype(np.float32)
    got = np.asarray(mc.from_numpy(a).to("bf16").to("f32"))
    # reference: round-to-nearest-even on the upper 16 bits
    u = a.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    np.testing.assert_array_equal(got, r.astype(np.uint32).view(np.float32))


def test_random_is_reproducible_and_tensor_factories():
    g1, g2 = mc.Generator(3), mc.Generator(3)
    a = mc.empty((100, 10)).normal_(g1)
    b = mc.empty((100, 10)).normal_(g2)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert g1.offset == 1
    z = mc.zeros((2, 3), dtype="i64")
    assert z.dtype == "i64" and np.asarray(z).sum() == 0
    f = mc.full(4, 2.5, dtype="f16")
    np.testing.assert_array_equal(np.asarray(f), np.full(4, 2.5, np.float16))
    t = mc.tensor([[1, 2], [3, 4]], dtype="f32")
    assert t.shape == (2, 2) and np.asarray(t)[1, 0] == 3


def test_cpu_dlpack_round_trip_with_numpy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = mc.from_dlpack(a)                      # numpy is a DLPack producer
    assert t.data_ptr == a.ctypes.data
    back = np.from_dlpack(t)                   # and a consumer
    assert back.ctypes.data == a.ctypes.data
    a[0, 0] = 7
    assert back[0, 0] == 7
    assert t.__dlpack_device__() == (1, 0)


def test_errors_are_typed_and_named():
    t = mc.zeros((3, 4))
    with pytest.raises(mc.ValueError, match="has 15 elements"):
        t.view((5, 3))
    with pytest.raises(ValueError):            # megacore.ValueError is a builtin ValueError too
        t.transpose(0, 5)
    with pytest.raises(mc.ValueError, match="out of range"):
        t.select(0, 3)
    with pytest.raises(mc.ValueError, match="unknown dtype 'f8'"):
        mc.zeros(2, dtype="f8")
    with pytest.raises(mc.ValueError, match="cannot parse device"):
        mc.zeros(2, device="tpu")
    with pytest.raises(mc.ValueError, match="bf16 has no numpy dtype"):
        np.asarray(mc.zeros(2, dtype="bf16"))
    with pytest.raises(mc.ValueError, match="cannot share a buffer"):
        mc.from_numpy(np.zeros(3, dtype=np.float64))
    with pytest.raises(mc.OutOfMemoryError):
        mc.empty((1 << 40, 1 << 20))
    with pytest.raises(mc.ValueError):
        mc.zeros(2, device=f"cuda:{mc.cuda_device_count() + 3}")
    assert issubclass(mc.ConfigError, mc.ValueError)
    assert issubclass(mc.CommError, RuntimeError) and issubclass(mc.IOError, OSError)


def test_memory_stats_on_cpu():
    mc.reset_peak_memory_stats("cpu")
    before = mc.memory_stats("cpu")["allocated"]
    t = mc.empty((1024, 1024))
    assert mc.memory_stats("cpu")["allocated"] - before >= 4 << 20
    del t
    s = mc.memory_stats("cpu")
    assert s["allocated"] == before and s["peak_allocated"] >= before + (4 << 20)
