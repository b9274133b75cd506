"""DLPack exchange with torch on the GPU: shared memory and the stream handshake."""

import numpy as np
import pytest

import megacore as mc

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def _spin_kernel_stream_busy(stream):
    """Queues ~100 ms of work on a torch stream so that missing synchronisation would show."""
    with torch.cuda.stream(stream):
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            x = x @ x
            x = x / x.norm()
    return x


def test_cuda_tensor_shares_memory_with_torch_both_ways():
    t = mc.zeros((64, 33), device="cuda:0")
    tt = torch.from_dlpack(t)
    assert tt.is_cuda and tt.data_ptr() == t.data_ptr and tt.shape == (64, 33)
    tt.fill_(3.0)                                     # torch writes, megacore sees it
    torch.cuda.synchronize()
    assert np.all(np.asarray(t.to("cpu")) == 3.0)
    t.fill_(5.0)                                      # megacore writes, torch sees it
    mc.synchronize()
    assert torch.all(tt == 5.0)
    src = torch.randn(17, 9, device="cuda", dtype=torch.bfloat16)
    m = mc.from_dlpack(src)
    assert m.data_ptr == src.data_ptr() and m.dtype == "bf16"
    np.testing.assert_array_equal(np.asarray(m.to("f32").to("cpu")), src.float().cpu().numpy())
    ts = src.t()                                      # strided views keep their strides
    ms = mc.from_dlpack(ts)
    assert ms.strides == tuple(ts.stride())
    np.testing.assert_array_equal(np.asarray(ms.to("f32").contiguous().to("cpu")), ts.float().cpu().numpy())


def test_dlpack_export_orders_megacore_stream_before_consumer_stream():
    # megacore fills on its own non-blocking stream after a long chain of work; torch reads on its
    # current stream. The handshake must make torch's stream wait, so the values are final.
    s = mc.Stream("cuda:0")
    busy = torch.cuda.Stream()
    for trial in range(3):
        t = mc.empty((1 << 22,), device="cuda:0", stream=s)
        # make megacore's stream wait for a long torch computation, then fill
        _spin_kernel_stream_busy(busy)
        s.wait_stream(mc.Stream.from_handle("cuda:0", busy.cuda_stream))
        with mc.stream(s):
            t.fill_(float(trial + 1))
            tt = torch.from_dlpack(t)                 # consumer: torch's current stream
        total = tt.sum().item()                       # ordered after megacore's fill by the handshake
        assert total == float(trial + 1) * (1 << 22)


def test_dlpack_import_orders_producer_stream_before_megacore_stream():
    busy = torch.cuda.Stream()
    s = mc.Stream("cuda:0")
    with torch.cuda.stream(busy):
        x = torch.empty(1 << 22, device="cuda")
        _spin_kernel_stream_busy(busy)
        x.fill_(7.0)
    with mc.stream(s), torch.cuda.stream(busy):
        m = mc.from_dlpack(x)                         # torch (producer) syncs its stream into ours
        out = m.clone()                               # runs on s
        host = np.asarray(out.to("cpu"))              # same stream, so ordered after the clone
    np.testing.assert_array_equal(host, np.full(1 << 22, 7.0, np.float32))


def test_cuda_memory_stats_and_oom_error():
    mc.empty_cache("cuda:0")
    base = mc.memory_stats("cuda:0")
    t = mc.empty((1 << 20,), device="cuda:0")
    assert mc.memory_stats("cuda:0")["allocated"] - base["allocated"] == 4 << 20
    del t
    with pytest.raises(mc.OutOfMemoryError, match="CUDA out of memory"):
        mc.empty((1 << 40,), device="cuda:0")
