#include "megacore/data/blended_dataset.hpp"

#include <cmath>
#include <limits>

#include "megacore/core/error.hpp"

namespace megacore::data {

namespace {
std::vector<double> normalised(const std::vector<double>& w) {
  MC_CHECK(!w.empty(), "a blend needs at least one dataset");
  MC_CHECK(w.size() <= size_t(std::numeric_limits<int16_t>::max()), "a blend of {} datasets is too many (max {})",
           w.size(), std::numeric_limits<int16_t>::max());
  double sum = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    MC_CHECK(std::isfinite(w[i]) && w[i] > 0, "blend weight {} of dataset {} must be a positive number", w[i], i);
    sum += w[i];
  }
  std::vector<double> out(w);
  for (double& x : out) x /= sum;
  return out;
}
}  // namespace

BlendingIndices build_blending_indices(const std::vector<double>& weights, int64_t size) {
  MC_CHECK(size >= 0, "blend size must be >= 0, got {}", size);
  std::vector<double> w = normalised(weights);
  BlendingIndices r;
  r.dataset_index.resize(size_t(size));
  r.dataset_sample_index.resize(size_t(size));
  std::vector<int64_t> count(w.size(), 0);
  for (int64_t n = 0; n < size; ++n) {
    // Targets are measured against n + 1 (the prefix including this sample) so the first sample already
    // goes to the heaviest dataset rather than to dataset 0.
    double total = double(n + 1);
    size_t best = 0;
    double best_err = -std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < w.size(); ++i) {
      double err = w[i] * total - double(count[i]);
      if (err > best_err) {
        best_err = err;
        best = i;
      }
    }
    r.dataset_index[size_t(n)] = int16_t(best);
    r.dataset_sample_index[size_t(n)] = count[best]++;
  }
  return r;
}

std::vector<int64_t> blend_samples_needed(const std::vector<double>& weights, int64_t size) {
  BlendingIndices idx = build_blending_indices(weights, size);
  std::vector<int64_t> need(weights.size(), 0);
  for (int16_t d : idx.dataset_index) ++need[size_t(d)];
  return need;
}

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const SampleSource>> datasets, std::vector<double> weights,
                               int64_t size)
    : datasets_(std::move(datasets)), weights_(normalised(weights)), size_(size) {
  MC_CHECK(datasets_.size() == weights_.size(), "blend has {} datasets but {} weights; give one weight per dataset",
           datasets_.size(), weights_.size());
  for (size_t i = 0; i < datasets_.size(); ++i) {
    MC_CHECK(datasets_[i] != nullptr, "dataset {} of the blend is null", i);
    MC_CHECK(datasets_[i]->seq_length() == datasets_[0]->seq_length(),
             "blended datasets must share seq_length: dataset {} has {}, dataset 0 has {}", i,
             datasets_[i]->seq_length(), datasets_[0]->seq_length());
  }
  idx_ = build_blending_indices(weights_, size_);
  std::vector<int64_t> need(datasets_.size(), 0);
  for (int16_t d : idx_.dataset_index) ++need[size_t(d)];
  for (size_t i = 0; i < datasets_.size(); ++i)
    MC_CHECK(need[i] <= datasets_[i]->size(),
             "blend of {} samples needs {} samples from dataset {} (weight {:.4f}) but it has only {}; build that "
             "dataset with num_samples >= {} (blend_samples_needed gives the exact counts)",
             size_, need[i], i, weights_[i], datasets_[i]->size(), need[i]);
}

std::pair<int, int64_t> BlendedDataset::locate(int64_t i) const {
  MC_CHECK(i >= 0 && i < size_, "sample {} out of range [0, {}) of the blended dataset", i, size_);
  return {idx_.dataset_index[size_t(i)], idx_.dataset_sample_index[size_t(i)]};
}

void BlendedDataset::get(int64_t i, const RowView& out) const {
  auto [d, j] = locate(i);
  datasets_[size_t(d)]->get(j, out);
}

std::array<double, 3> parse_split(const std::string& split) {
  std::array<double, 3> f{0, 0, 0};
  size_t k = 0, pos = 0;
  while (pos <= split.size()) {
    size_t end = split.find_first_of(",/", pos);
    if (end == std::string::npos) end = split.size();
    std::string part = split.substr(pos, end - pos);
    MC_CHECK(k < 3, "split '{}' has more than three parts; use train,valid,test such as \"969,30,1\"", split);
    try {
      size_t used = 0;
      f[k] = std::stod(part, &used);
      MC_CHECK(used == part.size(), "bad number");
    } catch (const std::exception&) {
      raise<ValueError>("split '{}': '{}' is not a number; use train,valid,test such as \"969,30,1\"", split, part);
    }
    MC_CHECK(std::isfinite(f[k]) && f[k] >= 0, "split '{}': part {} must be >= 0", split, part);
    ++k;
    pos = end + 1;
  }
  double sum = f[0] + f[1] + f[2];
  MC_CHECK(sum > 0, "split '{}' sums to zero; give at least one positive part, e.g. \"969,30,1\"", split);
  for (double& x : f) x /= sum;
  return f;
}

std::array<std::pair<int64_t, int64_t>, 3> split_document_ranges(int64_t n, const std::array<double, 3>& fr) {
  MC_CHECK(n >= 0, "number of documents must be >= 0, got {}", n);
  std::array<int64_t, 4> b{0, 0, 0, 0};
  for (int i = 0; i < 3; ++i) b[i + 1] = b[i] + int64_t(std::llround(fr[size_t(i)] * double(n)));
  // Rounding may overshoot or undershoot by a document or two; shift the boundaries so the end is exactly n.
  int64_t diff = b[3] - n;
  for (int i = 1; i < 4; ++i) b[i] = std::clamp<int64_t>(b[i] - diff, 0, n);
  return {{{b[0], b[1]}, {b[1], b[2]}, {b[2], b[3]}}};
}

std::array<std::shared_ptr<SampleSource>, 3> build_pretrain_datasets(const PretrainDatasetsConfig& cfg) {
  MC_CHECK(!cfg.blend.empty(), "no datasets given; pass at least one dataset prefix (with a weight when blending)");
  std::vector<double> weights;
  for (const auto& e : cfg.blend) weights.push_back(e.weight);
  weights = normalised(weights);
  std::array<double, 3> fractions = parse_split(cfg.split);
  std::vector<std::shared_ptr<const IndexedDataset>> data;
  for (const auto& e : cfg.blend) data.push_back(std::make_shared<IndexedDataset>(e.prefix));

  std::array<std::shared_ptr<SampleSource>, 3> out;
  static const char* kNames[3] = {"train", "valid", "test"};
  for (int s = 0; s < 3; ++s) {
    int64_t n = cfg.num_samples[size_t(s)];
    MC_CHECK(n >= 0, "num_samples for the {} split must be >= 0, got {}", kNames[s], n);
    if (n == 0) continue;
    MC_CHECK(fractions[size_t(s)] > 0, "{} samples requested for the {} split, but split '{}' gives it no documents; "
             "change the split or request 0 samples", n, kNames[s], cfg.split);
    std::vector<int64_t> need = data.size() == 1 ? std::vector<int64_t>{n} : blend_samples_needed(weights, n);
    std::vector<std::shared_ptr<const SampleSource>> parts;
    for (size_t i = 0; i < data.size(); ++i) {
      auto ranges = split_document_ranges(data[i]->num_documents(), fractions);
      GPTDatasetConfig g;
      g.seq_length = cfg.seq_length;
      g.num_samples = std::max<int64_t>(need[i], 1);
      g.seed = cfg.seed;
      g.doc_begin = ranges[size_t(s)].first;
      g.doc_end = ranges[size_t(s)].second;
      g.cache_dir = cfg.cache_dir;
      g.use_cache = cfg.use_cache;
      MC_CHECK(g.doc_end > g.doc_begin, "the {} split of '{}' is empty ({} documents, split '{}'); use more data or a "
               "larger share for this split", kNames[s], data[i]->prefix(), data[i]->num_documents(), cfg.split);
      parts.push_back(std::make_shared<GPTDataset>(data[i], g));
    }
    if (parts.size() == 1)
      out[size_t(s)] = std::const_pointer_cast<SampleSource>(parts[0]);
    else
      out[size_t(s)] = std::make_shared<BlendedDataset>(parts, weights, n);
  }
  return out;
}

}  // namespace megacore::data
