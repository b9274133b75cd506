"""The smallest real run of megacore until the trainer lands (issue 10 replaces this with a tiny Llama
pretrain under TP=2, PP=2): draw a weight matrix from the Philox generator, share it with numpy without
copying, round it to bf16, move it to the GPU when there is one, and show the allocator's statistics."""

import numpy as np

import megacore as mc


def main():
    info = mc.build_info()
    print(f"megacore {mc.__version__}: cuda={info['cuda']} nccl={info['nccl']} mpi={info['mpi']}, "
          f"{mc.cuda_device_count()} GPU(s) visible")
    g = mc.Generator(seed=1234)
    w = mc.empty((1024, 1024)).normal_(g, std=0.02)          # Megatron-style init
    a = np.asarray(w)                                        # zero-copy view
    print(f"weight: {w}, mean {a.mean():+.5f}, std {a.std():.5f} (target 0.02)")
    wb = w.to("bf16")
    err = np.abs(np.asarray(wb.to("f32")) - a).max() / np.abs(a).max()
    print(f"bf16 copy: max relative rounding error {err:.2e} (bf16 has 8 significant bits: <= 3.9e-3)")
    device = "cuda:0" if mc.cuda_available() else "cpu"
    if device != "cpu":
        print(f"GPU: {mc.cuda_device_name(0)}")
        s = mc.Stream(device)
        d = mc.empty((1024, 1024), device=device, stream=s).normal_(mc.Generator(1234), std=0.02, stream=s)
        same = np.array_equal(np.asarray(d.to("cpu", stream=s)), a)
        print(f"the same seed on {device} gives the same numbers as on the CPU: {same}")
        st = mc.memory_stats(device)
        print(f"{device} allocator: allocated {st['allocated']} B, reserved {st['reserved']} B")
    st = mc.memory_stats("cpu")
    print(f"host allocator: allocated {st['allocated']} B, peak {st['peak_allocated']} B")
    print("quickstart ok")


if __name__ == "__main__":
    main()
