#include "megacore/optim/param_and_grad_buffer.hpp"

#include <algorithm>
#include <map>
#include <numeric>
#include <unordered_set>

#include "megacore/core/error.hpp"

namespace megacore::optim {

using layers::Parameter;

int64_t default_bucket_size(int dp_size) { return std::max<int64_t>(40'000'000, int64_t(1'000'000) * dp_size); }

namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace

ParamAndGradBuffer::ParamAndGradBuffer(std::vector<Parameter*> params, const BufferConfig& cfg,
                                       std::vector<Parameter*> shared_copies)
    : cfg_(cfg), params_(std::move(params)) {
  const char* who = "ParamAndGradBuffer";
  MC_CHECK(cfg.dp_size >= 1, "{}: dp_size {} must be >= 1 (the size of the data-parallel group)", who, cfg.dp_size);
  MC_CHECK(cfg.param_align >= 1, "{}: param_align {} must be >= 1 (64 is usual)", who, cfg.param_align);
  MC_CHECK(cfg.grad_dtype == DType::F32 || cfg.grad_dtype == DType::BF16,
           "{}: grad_dtype {} is not supported; use f32 or bf16", who, dtype_name(cfg.grad_dtype));
  MC_CHECK(!params_.empty(), "{}: no parameters given; pass the model's parameters()", who);
  bucket_size_ = cfg.bucket_size == 0 ? default_bucket_size(cfg.dp_size) : cfg.bucket_size;

  std::unordered_map<const void*, size_t> seen_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter* p = params_[i];
    MC_CHECK(p != nullptr, "{}: parameter {} is null", who, i);
    auto [it, fresh] = index_.emplace(p, i);
    MC_CHECK(fresh, "{}: parameter '{}' is listed twice (positions {} and {}); list each parameter once", who, p->name,
             it->second, i);
    MC_CHECK(p->data.defined() && p->data.is_contiguous(), "{}: parameter '{}' needs a defined, contiguous data tensor",
             who, p->name);
    MC_CHECK(p->main_grad.defined() && (p->main_grad.dtype() == DType::F32 || p->main_grad.dtype() == DType::BF16) &&
                 p->main_grad.is_contiguous() && p->main_grad.shape() == p->data.shape() &&
                 p->main_grad.device() == p->data.device(),
             "{}: parameter '{}' needs a contiguous f32 main_grad (or bf16: bf16 main grads) of its data's shape "
             "and device",
             who, p->name);
    auto [git, gfresh] = seen_grad.emplace(p->main_grad.data_ptr(), i);
    MC_CHECK(gfresh,
             "{}: parameters '{}' and '{}' share one main_grad (a tied weight?); register the shared weight once and "
             "pass the other Parameter object as a shared copy",
             who, params_[git->second]->name, p->name);
    if (i == 0) device_ = p->data.device();
    MC_CHECK(p->data.device() == device_, "{}: parameter '{}' is on {} but '{}' is on {}; one buffer holds one device",
             who, p->name, p->data.device().str(), params_[0]->name, device_.str());
    param_numel_ += p->data.numel();
  }

  // Shared copies: match by the data pointer they alias (before re-pointing).
  std::unordered_map<const void*, size_t> by_data;
  for (size_t i = 0; i < params_.size(); ++i) by_data.emplace(params_[i]->data.data_ptr(), i);
  std::vector<std::pair<Parameter*, size_t>> copies;
  for (Parameter* c : shared_copies) {
    MC_CHECK(c != nullptr, "{}: a shared copy is null", who);
    MC_CHECK(!index_.count(c), "{}: '{}' is both a registered parameter and a shared copy; pass it once", who, c->name);
    auto it = c->data.defined() ? by_data.find(c->data.data_ptr()) : by_data.end();
    MC_CHECK(it != by_data.end(),
             "{}: shared copy '{}' aliases none of the registered parameters' data; pass only Parameter objects that "
             "share a registered parameter's tensors (a tied output layer)",
             who, c->name);
    copies.emplace_back(c, it->second);
    index_.emplace(c, it->second);
  }

  // Groups by dtype, in the order the dtypes first appear in backward order.
  std::vector<size_t> order(params_.size());
  std::iota(order.begin(), order.end(), 0);
  std::reverse(order.begin(), order.end());
  std::vector<DType> dtypes;
  for (size_t i : order)
    if (std::find(dtypes.begin(), dtypes.end(), params_[i]->data.dtype()) == dtypes.end())
      dtypes.push_back(params_[i]->data.dtype());

  std::unordered_set<const Parameter*> separate;
  for (const Parameter* p : cfg.separate) {
    MC_CHECK(p != nullptr && index_.count(p) && params_[index_.at(p)] == p,
             "{}: separate parameter '{}' is not one of the registered parameters; list only parameters passed to "
             "the buffer", who, p ? p->name : std::string("<null>"));
    separate.insert(p);
  }
  locations_.resize(params_.size());
  const int64_t bucket_align = int64_t(cfg.dp_size) * cfg.param_align;
  for (size_t g = 0; g < dtypes.size(); ++g) {
    // Two lanes (separate parameters and the others), each filling its own open bucket; offsets within a
    // bucket first, the bucket's place in the buffer once all are closed.
    struct Open {
      Bucket b;
      int64_t len = 0;
      size_t first = 0;  // position in `order` of its first parameter
    };
    Open lane[2];
    std::vector<Open> closed;
    auto close = [&](Open& o) {
      if (o.b.params.empty()) return;
      o.b.numel = round_up(o.len, bucket_align);
      closed.push_back(std::move(o));
      o = Open{};
    };
    for (size_t k = 0; k < order.size(); ++k) {
      const size_t i = order[k];
      if (params_[i]->data.dtype() != dtypes[g]) continue;
      const bool sep = separate.count(params_[i]) != 0;
      Open& o = lane[sep ? 1 : 0];
      if (o.b.params.empty()) o.first = k, o.b.separate = sep;
      o.len = round_up(o.len, cfg.param_align);
      locations_[i] = ParamLocation{int(g), 0, o.len, params_[i]->data.numel()};  // offset relative for now
      o.b.params.push_back(i);
      o.len += params_[i]->data.numel();
      if (bucket_size_ > 0 && o.len >= bucket_size_) close(o);
    }
    close(lane[0]);
    close(lane[1]);
    std::stable_sort(closed.begin(), closed.end(), [](const Open& a, const Open& b) { return a.first < b.first; });
    int64_t pos = 0;
    for (Open& o : closed) {
      o.b.offset = pos;
      o.b.index = int(buckets_.size());
      o.b.group = int(g);
      for (size_t i : o.b.params) locations_[i].bucket = o.b.index, locations_[i].offset += pos;
      pos += o.b.numel;
      buckets_.push_back(std::move(o.b));
    }
    Group gr{dtypes[g], Tensor::zeros({pos}, dtypes[g], device_), Tensor::zeros({pos}, cfg.grad_dtype, device_)};
    groups_.push_back(std::move(gr));
  }

  // Re-point, copying the current values in.
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter* p = params_[i];
    const ParamLocation& l = locations_[i];
    const Shape shape = p->data.shape();
    Tensor data = groups_[size_t(l.group)].params.narrow(0, l.offset, l.numel).view(shape);
    Tensor grad = groups_[size_t(l.group)].grads.narrow(0, l.offset, l.numel).view(shape);
    data.copy_(p->data);
    grad.copy_(p->main_grad);
    p->data = data;
    p->main_grad = grad;
  }
  for (auto& [c, i] : copies) {
    c->data = params_[i]->data;
    c->main_grad = params_[i]->main_grad;
  }
  // The copies ran on the legacy default stream; a model on a non-blocking stream must not race them.
  if (device_.is_cuda()) synchronize_device(device_);
}

Tensor ParamAndGradBuffer::bucket_params(int b) const {
  const Bucket& k = buckets_.at(size_t(b));
  return groups_[size_t(k.group)].params.narrow(0, k.offset, k.numel);
}

Tensor ParamAndGradBuffer::bucket_grads(int b) const {
  const Bucket& k = buckets_.at(size_t(b));
  return groups_[size_t(k.group)].grads.narrow(0, k.offset, k.numel);
}

size_t ParamAndGradBuffer::index_of(const Parameter* p) const {
  auto it = index_.find(p);
  MC_CHECK(it != index_.end(),
           "ParamAndGradBuffer: parameter '{}' is not registered in this buffer; build the buffer (or DDP) over the "
           "list that contains it (e.g. model.parameters())",
           p ? p->name : std::string("<null>"));
  return it->second;
}

int64_t ParamAndGradBuffer::numel() const {
  int64_t n = 0;
  for (const Group& g : groups_) n += g.grads.numel();
  return n;
}

void ParamAndGradBuffer::zero_grads(const Stream& s) {
  for (Group& g : groups_) g.grads.zero_(s);
}

}  // namespace megacore::optim
