#include "megacore/ops/embedding.hpp"

#include <cmath>

#include "megacore/build_config.hpp"
#include "megacore/ops/ops_common.hpp"
#include "ops/cuda/embedding_cuda.hpp"
#include "ops/memops_cpu.hpp"

namespace megacore::ops {
namespace {

int64_t check_table(const Tensor& weight, const Tensor& ids, const char* op, const char* wname) {
  detail::check_float_input(weight, op, wname);
  MC_CHECK(weight.dim() == 2, "{}: {} must be [vocab, hidden], got shape {}", op, wname, shape_str(weight.shape()));
  detail::check_index_input(ids, op, "ids");
  detail::check_same_device(ids, weight.device(), op, "ids");
  MC_CHECK(weight.size(0) < (int64_t(1) << 31) - 1 && ids.numel() < (int64_t(1) << 31),
           "{}: vocabularies and token counts of 2^31 or more are not supported", op);
  return ids.numel();
}

Shape out_shape(const Tensor& ids, int64_t h) {
  Shape sh = ids.shape();
  sh.push_back(h);
  return sh;
}

template <class L>
void check_ids_cpu(const L* ids, int64_t n, int64_t v, const char* op) {
  for (int64_t i = 0; i < n; ++i)
    MC_CHECK(ids[i] >= 0 && int64_t(ids[i]) < v,
             "{}: id {} at position {} is outside the table [0, {}); pass vocab_start >= 0 for a vocabulary shard",
             op, int64_t(ids[i]), i, v);
}

}  // namespace

void embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out, int64_t vocab_start, const Stream& s) {
  const char* op = "embedding_forward";
  const int64_t n = check_table(weight, ids, op, "weight");
  const int64_t v = weight.size(0), h = weight.size(1);
  detail::check_defined(out, op, "out");
  MC_CHECK(out.dtype() == weight.dtype(), "{}: out has dtype {} but weight has {}", op, dtype_name(out.dtype()),
           dtype_name(weight.dtype()));
  detail::check_shape(out, out_shape(ids, h), op, "out");
  detail::check_contiguous(out, op, "out");
  detail::check_same_device(out, weight.device(), op, "out");
  const Device d = weight.device();
  if (d.is_cuda()) {
    void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
    cuda::embedding_forward(weight.dtype(), weight.data_ptr(), ids.data_ptr(), ids.dtype() == DType::I64,
                            out.data_ptr(), n, v, h, vocab_start, d.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  cpu::dispatch_float_index(weight.dtype(), ids.dtype(), [&](auto tag, auto itag) {
    using T = decltype(tag);
    using L = decltype(itag);
    const L* idp = ids.data<L>();
    if (vocab_start < 0) check_ids_cpu(idp, n, v, op);
    const T* w = weight.data<T>();
    T* o = out.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = int64_t(idp[i]) - (vocab_start < 0 ? 0 : vocab_start);
      for (int64_t c = 0; c < h; ++c) o[i * h + c] = (id >= 0 && id < v) ? w[id * h + c] : cpu::st<T>(0.0);
    }
  });
}

void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dweight, bool accumulate, int64_t vocab_start,
                        const Stream& s) {
  const char* op = "embedding_backward";
  const int64_t n = check_table(dweight, ids, op, "dweight");
  const int64_t v = dweight.size(0), h = dweight.size(1);
  detail::check_float_input(dout, op, "dout");
  detail::check_shape(dout, out_shape(ids, h), op, "dout");
  detail::check_same_device(dout, dweight.device(), op, "dout");
  const Device d = dweight.device();
  if (d.is_cuda()) {
    void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
    const size_t ws_bytes = cuda::embedding_backward_workspace_bytes(n, v, d.index);
    Tensor ws = Tensor::empty({int64_t(ws_bytes / 4 + 1)}, DType::F32, d, s);
    cuda::embedding_backward(dout.dtype(), dweight.dtype(), dout.data_ptr(), ids.data_ptr(), ids.dtype() == DType::I64,
                             dweight.data_ptr(), n, v, h, vocab_start, accumulate, ws.data_ptr(), ws_bytes, d.index,
                             stream);
#else
    (void)stream;
#endif
    return;
  }
  cpu::dispatch_float(dout.dtype(), [&](auto tag) {
    cpu::dispatch_float(dweight.dtype(), [&](auto wtag) {
      cpu::dispatch_index(ids.dtype(), [&](auto itag) {
        using T = decltype(tag);
        using W = decltype(wtag);
        using L = decltype(itag);
        const L* idp = ids.data<L>();
        if (vocab_start < 0) check_ids_cpu(idp, n, v, op);
        // Sum in f32 in token order, as the GPU does (each output row is one ordered sum).
        std::vector<float> acc(static_cast<size_t>(v * h), 0.f);
        W* dw = dweight.data<W>();
        if (accumulate)
          for (int64_t j = 0; j < v * h; ++j) acc[size_t(j)] = float(cpu::ld(dw[j]));
        const T* g = dout.data<T>();
        for (int64_t i = 0; i < n; ++i) {
          const int64_t id = int64_t(idp[i]) - (vocab_start < 0 ? 0 : vocab_start);
          if (id < 0 || id >= v) continue;
          for (int64_t c = 0; c < h; ++c) acc[size_t(id * h + c)] += float(cpu::ld(g[i * h + c]));
        }
        for (int64_t j = 0; j < v * h; ++j) dw[j] = cpu::st<W>(double(acc[size_t(j)]));
      });
    });
  });
}

}  // namespace megacore::ops
