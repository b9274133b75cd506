#include "megacore/data/loader.hpp"

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "data/pinned_memory.hpp"
#include "megacore/core/error.hpp"
#include "megacore/data/gpt_dataset.hpp"

namespace megacore::data {

namespace {

// LoaderConfig::vocab_size: ids outside the vocabulary stop here, on the host, with the row named. A label of
// the loss's ignore_index (-100, ops::CrossEntropyOptions) counts nothing and passes.
constexpr int64_t kIgnoreIndex = -100;
void check_ids(const RowView& row, int64_t S, int64_t sample, int64_t vocab) {
  for (int64_t t = 0; t < S; ++t) {
    const int64_t id = row.tokens[t];
    MC_CHECK_AS(ValueError, id >= 0 && id < vocab,
                "sample {} has token id {} at position {}, outside the model's vocabulary [0, {}): the data was "
                "tokenized for another vocabulary; check model.vocab_size against the tokenizer that built it",
                sample, id, t, vocab);
    const int64_t label = row.labels[t];
    MC_CHECK_AS(ValueError, row.loss_mask[t] == 0.f || (label >= 0 && label < vocab) || label == kIgnoreIndex,
                "sample {} has label {} at position {} (counted in the loss), outside the model's vocabulary "
                "[0, {}): check model.vocab_size against the tokenizer that built the data",
                sample, label, t, vocab);
  }
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// One micro-batch worth of host memory: tokens, labels, position ids (i64) then the loss mask (f32).
struct Slot {
  uint8_t* mem = nullptr;
  bool pinned = false;
};

struct ReadyBatch {
  int slot;
  std::vector<int32_t> cu_seqlens;
  int64_t max_seqlen;
  std::vector<int64_t> samples;
  int64_t step, micro;
  double loss_tokens = 0;
};

// Loss tokens of one row of `len` positions, over this CP rank's chunks when cp > 1.
double count_row_tokens(const int64_t* labels, const float* mask, int64_t len, int cp, int cp_rank) {
  auto count = [&](int64_t from, int64_t to) {
    double n = 0;
    for (int64_t i = from; i < to; ++i)
      if (labels[i] != -100) n += mask[i];
    return n;
  };
  if (cp <= 1) return count(0, len);
  const int64_t c = len / (2 * cp), late = 2 * int64_t(cp) - 1 - cp_rank;
  return count(cp_rank * c, (cp_rank + 1) * c) + count(late * c, (late + 1) * c);
}

}  // namespace

struct SlotRef;

struct DataLoader::State {
  std::mutex mu;
  std::condition_variable cv_ready, cv_space;
  std::vector<Slot> slots;  // grows when the consumer keeps batches alive; never shrinks
  std::vector<int> free_slots;
  std::deque<ReadyBatch> ready;
  std::exception_ptr error;
  bool done = false, stop = false;
  LoaderStats stats;
  int64_t returned = 0;  // micro-batches handed out
  size_t slot_bytes = 0;
  bool use_pinned = false;
  std::vector<int64_t> permutation;  // empty unless shuffling
  std::thread worker;
  // Consumer-only (no lock): device copies in flight; their host slots stay busy until the copy ends.
  std::deque<std::pair<Event, std::shared_ptr<SlotRef>>> pending;

  ~State() {
    for (Slot& s : slots) {
      if (s.pinned)
        detail::pinned_free(s.mem);
      else
        std::free(s.mem);
    }
  }
};

// Returns its slot to the pool when the last tensor viewing it goes away.
struct SlotRef {
  std::shared_ptr<DataLoader::State> state;
  int slot;
  ~SlotRef() {
    {
      std::lock_guard<std::mutex> lk(state->mu);
      state->free_slots.push_back(slot);
    }
    state->cv_space.notify_one();
  }
};

DataLoader::DataLoader(std::shared_ptr<const SampleSource> source, LoaderConfig cfg)
    : source_(std::move(source)), cfg_(cfg), state_(std::make_shared<State>()) {
  MC_CHECK(source_ != nullptr, "DataLoader needs a dataset");
  MC_CHECK(cfg_.micro_batch_size >= 1, "micro_batch_size must be >= 1, got {}", cfg_.micro_batch_size);
  MC_CHECK(cfg_.dp_size >= 1 && cfg_.dp_rank >= 0 && cfg_.dp_rank < cfg_.dp_size,
           "dp_rank {} is not in [0, dp_size {})", cfg_.dp_rank, cfg_.dp_size);
  const int64_t chunk = cfg_.micro_batch_size * cfg_.dp_size;
  if (cfg_.global_batch_size == 0) cfg_.global_batch_size = chunk;
  MC_CHECK(cfg_.global_batch_size % chunk == 0,
           "global_batch_size {} is not divisible by micro_batch_size {} x dp_size {} = {}; pick a multiple of {}",
           cfg_.global_batch_size, cfg_.micro_batch_size, cfg_.dp_size, chunk, chunk);
  MC_CHECK(cfg_.consumed_samples >= 0 && cfg_.consumed_samples % chunk == 0,
           "consumed_samples {} is not a multiple of micro_batch_size x dp_size = {}; resume from the value the "
           "loader reported (consumed_samples()) when the checkpoint was saved",
           cfg_.consumed_samples, chunk);
  MC_CHECK(cfg_.prefetch >= 1, "prefetch must be >= 1, got {}", cfg_.prefetch);
  MC_CHECK(cfg_.epochs >= 1, "epochs must be >= 1, got {}", cfg_.epochs);
  if (cfg_.device.is_cuda()) check_device(cfg_.device);
  State& st = *state_;
  st.use_pinned = cfg_.pin_memory && cuda_available();
  st.stats.pinned = st.use_pinned;
  const int64_t cells = cfg_.micro_batch_size * source_->seq_length();
  st.slot_bytes = size_t(cells) * (3 * 8 + 4);
  // Pass e's order is stream 2^41 + e of the seed, made when the worker reaches that pass.
  auto permutation_of = [this](int64_t epoch) {
    return seeded_permutation(source_->size(), cfg_.seed, (uint64_t(1) << 41) + uint64_t(epoch));
  };

  st.worker = std::thread([this, permutation_of] {
    State& s = *state_;
    try {
      const int64_t mps = micro_batches_per_step(), spe = steps_per_epoch();
      int64_t perm_epoch = -1;
      const int64_t total = num_steps() * mps;
      const int64_t cells = cfg_.micro_batch_size * source_->seq_length();
      std::vector<int32_t> starts;
      for (int64_t m = cfg_.consumed_samples / (cfg_.micro_batch_size * cfg_.dp_size); m < total; ++m) {
        int slot = -1;
        {
          std::unique_lock<std::mutex> lk(s.mu);
          s.cv_space.wait(lk, [&] { return s.stop || int64_t(s.ready.size()) < cfg_.prefetch; });
          if (s.stop) break;
          if (!s.free_slots.empty()) {
            slot = s.free_slots.back();
            s.free_slots.pop_back();
          }
        }
        if (slot < 0) {
          Slot fresh;
          fresh.pinned = s.use_pinned;
          fresh.mem = static_cast<uint8_t*>(s.use_pinned ? detail::pinned_alloc(s.slot_bytes)
                                                         : std::aligned_alloc(64, (s.slot_bytes + 63) / 64 * 64));
          MC_CHECK_AS(OutOfMemoryError, fresh.mem != nullptr, "loader could not allocate {} bytes of host memory",
                      s.slot_bytes);
          std::lock_guard<std::mutex> lk(s.mu);
          slot = int(s.slots.size());
          s.slots.push_back(fresh);
        }
        uint8_t* mem;
        {
          std::lock_guard<std::mutex> lk(s.mu);
          mem = s.slots[size_t(slot)].mem;
        }
        auto t0 = Clock::now();
        auto* tokens = reinterpret_cast<int64_t*>(mem);
        int64_t* labels = tokens + cells;
        int64_t* pos = labels + cells;
        auto* mask = reinterpret_cast<float*>(pos + cells);
        ReadyBatch rb;
        rb.slot = slot;
        rb.step = m / mps;
        rb.micro = m % mps;
        rb.samples = sample_indices(rb.step, rb.micro, cfg_.dp_rank);
        if (cfg_.shuffle && rb.step / spe != perm_epoch) {
          perm_epoch = rb.step / spe;
          s.permutation = permutation_of(perm_epoch);
        }
        rb.cu_seqlens.push_back(0);
        rb.max_seqlen = 0;
        const int64_t S = source_->seq_length();
        for (int64_t j = 0; j < cfg_.micro_batch_size; ++j) {
          int64_t idx = rb.samples[size_t(j)];
          if (!s.permutation.empty()) idx = s.permutation[size_t(idx)];
          rb.samples[size_t(j)] = idx;
          RowView row{tokens + j * S, labels + j * S, mask + j * S, pos + j * S, &starts};
          source_->get(idx, row);
          if (cfg_.vocab_size > 0) check_ids(row, S, idx, cfg_.vocab_size);
          MC_CHECK(!starts.empty() && starts[0] == 0, "dataset row {} has no sequence start at 0", idx);
          for (size_t k = 0; k < starts.size(); ++k) {
            int64_t end = k + 1 < starts.size() ? starts[k + 1] : S;
            if (k > 0) rb.cu_seqlens.push_back(int32_t(j * S + starts[k]));
            rb.max_seqlen = std::max(rb.max_seqlen, end - starts[k]);
          }
          rb.cu_seqlens.push_back(int32_t((j + 1) * S));
          rb.loss_tokens += count_row_tokens(row.labels, row.loss_mask, S, cfg_.cp_size, cfg_.cp_rank);
        }
        double dt = seconds_since(t0);
        {
          std::lock_guard<std::mutex> lk(s.mu);
          s.stats.produce_seconds += dt;
          s.ready.push_back(std::move(rb));
        }
        s.cv_ready.notify_one();
      }
    } catch (...) {
      std::lock_guard<std::mutex> lk(s.mu);
      s.error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(s.mu);
      s.done = true;
    }
    s.cv_ready.notify_all();
  });
}

DataLoader::~DataLoader() {
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    state_->stop = true;
  }
  state_->cv_space.notify_all();
  if (state_->worker.joinable()) state_->worker.join();
  // Host slots may be freed once the last reference goes; copies reading them must have finished.
  for (auto& p : state_->pending) p.first.synchronize();
  state_->pending.clear();
}

int64_t DataLoader::micro_batches_per_step() const {
  return cfg_.global_batch_size / (cfg_.micro_batch_size * cfg_.dp_size);
}

int64_t DataLoader::steps_per_epoch() const { return source_->size() / cfg_.global_batch_size; }

int64_t DataLoader::num_steps() const { return cfg_.epochs * steps_per_epoch(); }

std::vector<int64_t> DataLoader::sample_indices(int64_t step, int64_t micro_step, int rank) const {
  MC_CHECK(rank >= 0 && rank < cfg_.dp_size, "rank {} not in [0, {})", rank, cfg_.dp_size);
  MC_CHECK(micro_step >= 0 && micro_step < micro_batches_per_step(), "micro_step {} not in [0, {})", micro_step,
           micro_batches_per_step());
  std::vector<int64_t> out(size_t(cfg_.micro_batch_size));
  const int64_t spe = steps_per_epoch();
  int64_t base = (spe > 0 ? step % spe : step) * cfg_.global_batch_size + micro_step * cfg_.micro_batch_size * cfg_.dp_size +
                 int64_t(rank) * cfg_.micro_batch_size;
  for (int64_t j = 0; j < cfg_.micro_batch_size; ++j) out[size_t(j)] = base + j;
  return out;
}

int64_t DataLoader::consumed_samples() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return cfg_.consumed_samples + state_->returned * cfg_.micro_batch_size * cfg_.dp_size;
}

LoaderStats DataLoader::stats() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->stats;
}

std::optional<Batch> DataLoader::next(const Stream& s) {
  State& st = *state_;
  while (!st.pending.empty() && st.pending.front().first.query()) st.pending.pop_front();
  ReadyBatch rb;
  auto t0 = Clock::now();
  bool waited = false;
  for (;;) {
    std::unique_lock<std::mutex> lk(st.mu);
    if (!st.ready.empty()) {
      rb = std::move(st.ready.front());
      st.ready.pop_front();
      break;
    }
    if (st.error) std::rethrow_exception(st.error);
    if (st.done) return std::nullopt;
    waited = true;
    if (!st.pending.empty()) {
      // The producer may be waiting for a slot that an in-flight copy still holds.
      lk.unlock();
      st.pending.front().first.synchronize();
      st.pending.pop_front();
      continue;
    }
    st.cv_ready.wait(lk, [&] { return !st.ready.empty() || st.done; });
  }
  double wait = waited ? seconds_since(t0) : 0.0;
  uint8_t* mem;
  {
    std::lock_guard<std::mutex> lk(st.mu);
    st.stats.batches += 1;
    st.stats.wait_seconds += wait;
    st.stats.max_wait_seconds = std::max(st.stats.max_wait_seconds, wait);
    st.returned += 1;
    mem = st.slots[size_t(rb.slot)].mem;
  }
  st.cv_space.notify_one();

  // Built in place: a temporary SlotRef would hand the slot back when it died.
  std::shared_ptr<SlotRef> ref(new SlotRef{state_, rb.slot});
  const int64_t B = cfg_.micro_batch_size, S = source_->seq_length(), cells = B * S;
  auto view = [&](void* p, DType dt) {
    return Tensor::from_blob(p, {B, S}, {S, 1}, dt, Device::cpu(), [ref] {});
  };
  auto* tokens = reinterpret_cast<int64_t*>(mem);
  Batch b;
  b.tokens = view(tokens, DType::I64);
  b.labels = view(tokens + cells, DType::I64);
  b.position_ids = view(tokens + 2 * cells, DType::I64);
  b.loss_mask = view(tokens + 3 * cells, DType::F32);
  b.cu_seqlens = Tensor::from_vector(rb.cu_seqlens, {int64_t(rb.cu_seqlens.size())});
  b.max_seqlen = rb.max_seqlen;
  b.sample_indices = std::move(rb.samples);
  b.step = rb.step;
  b.micro_step = rb.micro;
  b.loss_tokens = rb.loss_tokens;
  if (cfg_.device.is_cuda()) {
    b.tokens = b.tokens.to(cfg_.device, s);
    b.labels = b.labels.to(cfg_.device, s);
    b.position_ids = b.position_ids.to(cfg_.device, s);
    b.loss_mask = b.loss_mask.to(cfg_.device, s);
    b.cu_seqlens = b.cu_seqlens.to(cfg_.device, s);
    Event e;
    e.record(s);
    st.pending.emplace_back(std::move(e), ref);
  }
  return b;
}

}  // namespace megacore::data
