"""cuDNN attention forward and backward through megacore._C in a Python process (scripts/probe/cudnn_in_python.sh).

argv[1]: "plain" or "torch_first" (import torch before megacore). PROBE_SS names a tiny C++ library
(probe_ss.cpp) whose stringstream << long is called before and after megacore is loaded and used.
"""
import ctypes, os, sys
mode = sys.argv[1]
def maps():
    return sorted({l.split()[-1] for l in open("/proc/self/maps") if "stdc++" in l or "libcudnn" in l or "_C." in l})
if mode == "torch_first":
    import torch  # noqa
mini = ctypes.CDLL(os.environ["PROBE_SS"])
print("mini before import:", mini.mc_probe_ss(42), flush=True)
import megacore as mc
print(mode, mc._C.__file__, flush=True)
print("maps after import:", maps(), flush=True)
print("mini after import:", mini.mc_probe_ss(42), flush=True)
mc.ops.set_cudnn_attention_enabled(True)
b, s, h, d = 1, 512, 4, 128
z = lambda *shape, **kw: mc.zeros(shape, device="cuda:0", **kw)
q, out, do, dq, dk, dv = (z(b, s, h, d, dtype="bf16") for _ in range(6))
lse = z(b, h, s)
print("resolve:", mc.ops.attention_resolve_backend(q, q, causal=True), flush=True)
mc.ops.attention_forward(q, q, q, out, lse, causal=True, backend="cudnn")
mc.synchronize("cuda:0")
print("maps after fwd:", maps(), flush=True)
print("mini after fwd:", mini.mc_probe_ss(42), flush=True)
print("OK fwd", flush=True)
mc.ops.attention_backward(q, q, q, out, lse, do, dq, dk, dv, causal=True, backend="cudnn")
mc.synchronize("cuda:0")
print("OK bwd", flush=True)
