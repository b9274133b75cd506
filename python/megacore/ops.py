"""Stateless ops from ``megacore/ops`` (C++), callable on megacore, DLPack (torch, cupy) or numpy tensors.

Attention takes the layouts of ``include/megacore/ops/attention.hpp``: dense q/out ``[B, Sq, H, D]``,
k/v ``[B, Skv, Hkv, D]``, lse f32 ``[B, H, Sq]`` (H a multiple of Hkv: GQA/MQA), or packed sequences with
``cu_seqlens_q``/``cu_seqlens_kv``. Outputs are written in place (DLPack and contiguous numpy outputs share
memory with the caller's array); the call runs on ``stream`` or the current megacore stream::

    import torch, megacore
    q = torch.randn(2, 4096, 16, 128, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q); lse = torch.empty(2, 16, 4096, device="cuda")
    megacore.ops.attention_forward(q, q, q, o, lse, causal=True)          # cuDNN where built in, else flash
    megacore.ops.attention_forward(q, q, q, o, lse, causal=True, backend="flash")

Bad shapes, dtypes, head dims or backends raise ``megacore.ValueError`` naming the problem.

Where the build contains cuDNN's SDPA, Auto uses it (``attention_cudnn_built()``);
``set_cudnn_attention_enabled(False)`` turns it off for the process (Auto then runs megacore's flash kernel).

Grouped GEMM over experts (the MoE layer's products; docs/kernels.md, "Grouped GEMM"): rows grouped by expert
one group after another, ``group_sizes`` host ints (zeros allowed), one weight per group::

    x = torch.randn(n, 2048, device="cuda", dtype=torch.bfloat16); w = torch.randn(e, 2816, 2048, ...)
    megacore.ops.grouped_gemm_forward(x, w, sizes, y)           # y_g = x_g w_g^T
    megacore.ops.grouped_gemm_dgrad(dy, w, sizes, dx)           # dx_g = dy_g w_g
    megacore.ops.grouped_gemm_wgrad(dy, x, sizes, main_grad)    # main_grad_g += dy_g^T x_g (f32, beta=1)

On Hopper they run megacore's grouped kernel (``grouped_gemm_sm90_available()``), elsewhere cuBLAS;
``set_grouped_gemm_path("loop")`` etc. force a path, ``grouped_gemm_sm90_launches()`` counts the kernel's runs.

FP8 (docs/fp8.md): ``fp8_cast``, ``fp8_cast_transpose``, ``fp8_amax``, ``fp8_dequant``, ``fp8_update_scales``
(Transformer Engine's delayed scaling) and ``gemm_fp8``; FP8 tensors are ``megacore.Tensor`` of dtype ``f8e4m3``/``f8e5m2``
(``t.view_as_dtype('u8').numpy()`` shows their codes).
"""

from ._C import ops as _o

attention_forward = _o.attention_forward
attention_backward = _o.attention_backward
attention_resolve_backend = _o.attention_resolve_backend
attention_cudnn_available = _o.attention_cudnn_available
attention_cudnn_built = _o.attention_cudnn_built
set_cudnn_attention_enabled = _o.set_cudnn_attention_enabled
cudnn_attention_enabled = _o.cudnn_attention_enabled
set_cudnn_attention_autotune = _o.set_cudnn_attention_autotune
cudnn_attention_autotune = _o.cudnn_attention_autotune
fp8_cast = _o.fp8_cast
fp8_cast_transpose = _o.fp8_cast_transpose
fp8_amax = _o.fp8_amax
fp8_dequant = _o.fp8_dequant
fp8_update_scales = _o.fp8_update_scales
gemm_fp8 = _o.gemm_fp8
grouped_gemm_forward = _o.grouped_gemm_forward
grouped_gemm_dgrad = _o.grouped_gemm_dgrad
grouped_gemm_wgrad = _o.grouped_gemm_wgrad
grouped_gemm_path = _o.grouped_gemm_path
set_grouped_gemm_path = _o.set_grouped_gemm_path
grouped_gemm_sm90_available = _o.grouped_gemm_sm90_available
grouped_gemm_sm90_launches = _o.grouped_gemm_sm90_launches

__all__ = ["attention_forward", "attention_backward", "attention_resolve_backend", "attention_cudnn_available",
           "attention_cudnn_built", "set_cudnn_attention_enabled", "cudnn_attention_enabled",
           "set_cudnn_attention_autotune", "cudnn_attention_autotune", "fp8_cast", "fp8_cast_transpose", "fp8_amax",
           "fp8_dequant", "fp8_update_scales", "gemm_fp8", "grouped_gemm_forward", "grouped_gemm_dgrad",
           "grouped_gemm_wgrad", "grouped_gemm_path", "set_grouped_gemm_path", "grouped_gemm_sm90_available",
           "grouped_gemm_sm90_launches"]
