// Distributed checkpoints on one process: CRC-32 and CRC-32C against bitwise references, the sharding of
// parameters (partition_chunks, vocabulary padding), save/load round trips of every dtype with JSON
// blobs and extra tensors, crash safety (a forked writer SIGKILLed at every point of the protocol:
// the previous checkpoint still loads, the partial one is ignored and cleaned up by the next save),
// corrupt / truncated / mismatched checkpoints (IOError naming the problem), async saves (including a
// background failure surfacing on wait(), a training step during an async save, the equality of async
// and synchronous files, the host-memory fallback), format-1 checkpoints and the CheckpointManager's
// retention policies.
// Resharding across layouts is tested under mpirun (mpi_test_dist_checkpoint.cpp).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>

#include <nlohmann/json.hpp>

#include "megacore/checkpoint/checkpoint_manager.hpp"
#include "megacore/checkpoint/dist_checkpoint.hpp"
#include "megacore/checkpoint/safetensors.hpp"
#include "megacore/core/error.hpp"
#include "megacore/core/random.hpp"
#include "megacore/optim/optimizer.hpp"
#include "ops/ops_test_util.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::checkpoint;
namespace fs = std::filesystem;

namespace {

// A one-rank world: every collective is the identity.
struct SoloWorld : mctest::SoloCommunicator {
  SoloWorld() : mctest::SoloCommunicator(1, "world") {}
};

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/mc_ckpt_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

Tensor randn(const Shape& shape, uint64_t offset, DType dt = DType::F32) {
  Tensor t = Tensor::empty(shape);
  Generator g(4242, offset);
  t.normal_(g);
  return dt == DType::F32 ? t : t.to(dt);
}

uint32_t crc32_bitwise(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
  }
  return ~c;
}

uint32_t crc32c_bitwise(const uint8_t* p, size_t n, uint32_t crc = 0) {
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Every file of two checkpoint directories, byte for byte.
void require_same_files(const std::string& a, const std::string& b) {
  std::vector<std::string> na, nb;
  for (const auto& de : fs::directory_iterator(a)) na.push_back(de.path().filename().string());
  for (const auto& de : fs::directory_iterator(b)) nb.push_back(de.path().filename().string());
  std::sort(na.begin(), na.end());
  std::sort(nb.begin(), nb.end());
  REQUIRE(na == nb);
  for (const std::string& n : na) {
    INFO(n);
    REQUIRE(file_bytes(a + "/" + n) == file_bytes(b + "/" + n));
  }
}

void require_same(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  REQUIRE(a.dtype() == b.dtype());
  REQUIRE(a.contiguous().to_double_vector() == b.contiguous().to_double_vector());
}

// A small "model": a replicated f32 tensor, a bf16 one and an i64 one.
CheckpointState sample_state(int64_t step, uint64_t seed_offset) {
  CheckpointState st;
  st.step = step;
  st.tensors.push_back(replicated_tensor("w", randn({6, 5}, seed_offset)));
  st.tensors.push_back(replicated_tensor("h", randn({7}, seed_offset + 1, DType::BF16)));
  st.tensors.push_back(replicated_tensor("ids", Tensor::from_vector<int64_t>({1, -2, 3, 1LL << 40}, {2, 2})));
  // Compact with sorted keys: the form the reader hands back (it re-serialises the parsed JSON).
  st.json["scheduler"] = R"({"last_lr":0.001,"warmup":10})";
  st.json["config"] = R"({"hidden":64,"name":"tiny"})";
  st.extra_tensors["rng.rank0"] = Tensor::from_vector<int64_t>({1234, int64_t(seed_offset)}, {2});
  return st;
}

std::vector<ShardedTensor> fresh_targets(const CheckpointState& like) {
  std::vector<ShardedTensor> out;
  for (const ShardedTensor& t : like.tensors) {
    ShardedTensor c = t;
    c.local = Tensor::zeros(t.local.shape(), t.dtype);
    out.push_back(c);
  }
  return out;
}

void check_loads_as(const std::string& root, const CheckpointState& want) {
  std::vector<ShardedTensor> targets = fresh_targets(want);
  SoloWorld w;
  CheckpointReader r = load_checkpoint(&w, root, targets);
  REQUIRE(r.step() == want.step);
  for (size_t i = 0; i < targets.size(); ++i) require_same(targets[i].local, want.tensors[i].local);
  for (const auto& [k, v] : want.extra_tensors) require_same(r.load_full(k), v);
  for (const auto& [k, v] : want.json) REQUIRE(r.json(k) == v);
}

}  // namespace

TEST_CASE("crc32 matches a bitwise CRC-32 at every length and alignment", "[checkpoint]") {
  const char* check = "123456789";
  REQUIRE(crc32(check, 9) == 0xCBF43926u);  // the standard CRC-32 check value
  std::vector<uint8_t> buf(300);
  uint32_t x = 12345;
  for (auto& b : buf) b = uint8_t((x = x * 1103515245u + 12345u) >> 16);
  for (size_t off : {0, 1, 3, 7})
    for (size_t n : {0, 1, 7, 8, 9, 63, 64, 200}) REQUIRE(crc32(buf.data() + off, n) == crc32_bitwise(buf.data() + off, n));
  // Incremental use continues the same CRC.
  REQUIRE(crc32(buf.data() + 100, 50, crc32(buf.data(), 100)) == crc32_bitwise(buf.data(), 150));
}

TEST_CASE("crc32c matches a bitwise CRC-32C on both paths, at every length and alignment, and combines", "[checkpoint]") {
  const char* check = "123456789";
  REQUIRE(crc32c(check, 9) == 0xE3069283u);  // the standard CRC-32C check value
  REQUIRE(checkpoint::detail::crc32c_software(check, 9) == 0xE3069283u);
  // Longer than three 8 KiB streams, so the interleaved hardware path and its join are exercised.
  std::vector<uint8_t> buf(100000);
  uint32_t x = 777;
  for (auto& b : buf) b = uint8_t((x = x * 1103515245u + 12345u) >> 16);
  for (size_t off : {0, 1, 3, 7})
    for (size_t n : {0, 1, 7, 8, 9, 63, 64, 200, 24575, 24576, 24577, 49160, 99000}) {
      INFO("offset " << off << " length " << n);
      const uint32_t want = crc32c_bitwise(buf.data() + off, n);
      REQUIRE(crc32c(buf.data() + off, n) == want);
      REQUIRE(checkpoint::detail::crc32c_software(buf.data() + off, n) == want);
    }
  REQUIRE(crc32c(buf.data() + 100, 50000, crc32c(buf.data(), 100)) == crc32c_bitwise(buf.data(), 50100));
  for (size_t split : {0, 1, 5, 8, 4096, 30001, 100000}) {
    INFO("split at " << split);
    REQUIRE(crc32c_combine(crc32c(buf.data(), split), crc32c(buf.data() + split, buf.size() - split),
                           buf.size() - split) == crc32c_bitwise(buf.data(), buf.size()));
  }
}

TEST_CASE("flat_range_boxes covers a flat range in order with contiguous boxes", "[checkpoint]") {
  std::mt19937 rng(7);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int trial = 0; trial < 300; ++trial) {
    const int nd = int(pick(1, 4));
    Shape shape;
    int64_t total = 1;
    for (int d = 0; d < nd; ++d) shape.push_back(pick(1, 5)), total *= shape.back();
    int64_t a = pick(0, total), b = pick(0, total);
    if (a > b) std::swap(a, b);
    INFO("shape " << shape_str(shape) << " range [" << a << ", " << b << ")");
    const auto boxes = flat_range_boxes(shape, a, b);
    CHECK(int64_t(boxes.size()) <= std::max<int64_t>(0, 2 * nd - 1));
    int64_t next = a;
    for (const auto& [off, sz] : boxes) {
      // Flat index of the box's first element must continue the range, and its elements must be the next
      // volume(sz) flat indices (contiguous): walk the box in row-major order.
      int64_t vol = 1;
      for (int64_t s : sz) vol *= s;
      REQUIRE(vol > 0);
      Shape idx(off.size(), 0);
      for (int64_t e = 0; e < vol; ++e) {
        int64_t flat = 0;
        for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + off[d] + idx[d];
        REQUIRE(flat == next);
        ++next;
        for (int64_t d = int64_t(sz.size()) - 1; d >= 0; --d) {
          if (++idx[size_t(d)] < sz[size_t(d)]) break;
          idx[size_t(d)] = 0;
        }
      }
    }
    CHECK(next == b);
  }
  CHECK_THROWS_AS(flat_range_boxes({2, 3}, 4, 7), ValueError);
}

TEST_CASE("shard_parameter places fused (SwiGLU) and vocabulary-padded shards in the global tensor", "[checkpoint]") {
  const int T = 4;
  // fc1 full [gate; up] 2f × h with f = 8: rank r holds [gate rows r·2..r·2+2 ; up rows the same].
  for (int r = 0; r < T; ++r) {
    layers::Parameter p;
    p.name = "fc1";
    p.data = Tensor::zeros({4, 3});
    p.partition_dim = 0;
    p.partition_chunks = 2;
    ShardedTensor st = shard_parameter(p, {r, T, true});
    REQUIRE(st.global_shape == Shape{16, 3});
    REQUIRE(st.pieces.size() == 2);
    CHECK(st.pieces[0].local_offsets == Shape{0, 0});
    CHECK(st.pieces[0].global_offsets == Shape{2 * r, 0});
    CHECK(st.pieces[1].local_offsets == Shape{2, 0});
    CHECK(st.pieces[1].global_offsets == Shape{8 + 2 * r, 0});
    CHECK(st.pieces[1].shape == Shape{2, 3});
    CHECK(st.write);
  }
  // Embedding padded to 12 rows over 4 ranks (3 each), vocabulary 7: rank 2 keeps 1 row, rank 3 none.
  std::vector<int64_t> rows;
  for (int r = 0; r < T; ++r) {
    layers::Parameter p;
    p.name = "embedding.weight";
    p.data = Tensor::zeros({3, 2});
    p.partition_dim = 0;
    ShardedTensor st = shard_parameter(p, {r, T, true}, {7, 2});
    int64_t n = 0;
    for (const auto& pc : st.pieces) n += pc.shape[0];
    rows.push_back(n);
  }
  REQUIRE(rows == std::vector<int64_t>{3, 3, 1, 0});
  // Replicated: only TP rank 0 of the writing replica writes; a non-writing replica never does.
  layers::Parameter norm;
  norm.name = "norm";
  norm.data = Tensor::zeros({5});
  CHECK(shard_parameter(norm, {0, 2, true}).write);
  CHECK_FALSE(shard_parameter(norm, {1, 2, true}).write);
  layers::Parameter col = norm;
  col.partition_dim = 0;
  CHECK_FALSE(shard_parameter(col, {0, 2, false}).write);
  // Shapes that cannot correspond are a ValueError.
  CHECK_THROWS_AS(shard_parameter(col, {0, 2, true}, {11}), ValueError);
  CHECK_THROWS_AS(shard_parameter(norm, {0, 2, true}, {4}), ValueError);
}

TEST_CASE("save_checkpoint / load round-trips every dtype, JSON blobs, extra tensors and val_loss", "[checkpoint]") {
  TempDir tmp;
  SoloWorld w;
  CheckpointState st = sample_state(7, 10);
  st.val_loss = 2.5;
  const std::string dir = save_checkpoint(w, tmp.path, st);
  REQUIRE(dir == checkpoint_dir(tmp.path, 7));
  REQUIRE(resolve_checkpoint(tmp.path) == dir);
  check_loads_as(tmp.path, st);
  CheckpointReader r(dir);
  REQUIRE(r.val_loss() == 2.5);
  // The files are plain safetensors: another reader sees the entries with their global offsets in the key.
  SafetensorsFile f(dir + "/shard_00000.safetensors");
  REQUIRE(f.contains("w[0,0]"));
  require_same(f.load("w[0,0]"), st.tensors[0].local);
  // Nothing but the checkpoint and the pointer is left behind.
  std::vector<std::string> names;
  for (const auto& de : fs::directory_iterator(tmp.path)) names.push_back(de.path().filename().string());
  std::sort(names.begin(), names.end());
  REQUIRE(names == std::vector<std::string>{"latest", "step_7"});
  // Invalid JSON blobs are refused before anything is written.
  CheckpointState bad = sample_state(8, 1);
  bad.json["x"] = "{not json";
  CHECK_THROWS_AS(save_checkpoint(w, tmp.path, bad), ValueError);
  REQUIRE(resolve_checkpoint(tmp.path) == dir);
}

TEST_CASE("a writer SIGKILLed at any point of a save leaves the previous checkpoint loadable", "[checkpoint]") {
  for (const char* point : {"prepared", "shard_written", "fragment_written", "metadata_written", "renamed"}) {
    INFO("killed at " << point);
    TempDir tmp;
    SoloWorld w;
    const CheckpointState first = sample_state(1, 100);
    save_checkpoint(w, tmp.path, first);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {  // the child saves step 2 and dies at `point`
      try {
        SoloWorld cw;
        SaveOptions o;
        o.fault_hook = [point](const std::string& p) {
          if (p == point) ::kill(::getpid(), SIGKILL);
        };
        save_checkpoint(cw, tmp.path, sample_state(2, 200), o);
      } catch (...) {
      }
      ::_exit(3);  // not killed: the test fails below
    }
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    REQUIRE(WIFSIGNALED(status));
    REQUIRE(WTERMSIG(status) == SIGKILL);
    // `latest` still names step 1 (even when step 2 was renamed into place but `latest` not updated).
    REQUIRE(resolve_checkpoint(tmp.path) == checkpoint_dir(tmp.path, 1));
    check_loads_as(tmp.path, first);
    // A partial save is never listed; the next save removes its leftovers.
    for (const auto& c : list_checkpoints(tmp.path)) REQUIRE((c.step == 1 || std::string(point) == "renamed"));
    const CheckpointState third = sample_state(3, 300);
    save_checkpoint(w, tmp.path, third);
    for (const auto& de : fs::directory_iterator(tmp.path))
      REQUIRE(de.path().filename().string().rfind(".tmp", 0) != 0);
    check_loads_as(tmp.path, third);
  }
}

namespace {

// A state with entries of several read blocks (the loader reads 16 MiB blocks): 42 MB f32, 2.4 MB bf16, a small one.
CheckpointState multiblock_state(uint64_t seed) {
  CheckpointState st;
  st.step = 9;
  st.tensors.push_back(replicated_tensor("big", randn({5, 2'100'001}, seed)));
  st.tensors.push_back(replicated_tensor("mid", randn({1200, 1000}, seed + 1, DType::BF16)));
  st.tensors.push_back(replicated_tensor("w", randn({6, 5}, seed + 2)));
  return st;
}

}  // namespace

TEST_CASE("entries of several read blocks load whole on 1 to 3 readers; a flipped byte in a late block fails its CRC",
          "[checkpoint]") {
  TempDir tmp;
  SoloWorld w;
  const CheckpointState st = multiblock_state(mctest::fresh_seed());
  const std::string dir = save_checkpoint(w, tmp.path, st);
  for (int threads : {1, 2, 3}) {
    INFO("threads " << threads);
    LoadOptions o;
    o.threads = threads;
    std::vector<ShardedTensor> t = fresh_targets(st);
    CheckpointReader r = load_checkpoint(&w, tmp.path, t, o);
    for (size_t i = 0; i < t.size(); ++i) require_same(t[i].local, st.tensors[i].local);
    int64_t want = 0;
    for (const ShardedTensor& x : st.tensors) want += x.local.nbytes();
    CHECK(r.bytes_read() == want);
  }
  // A byte 35 MB into "big" (its third block) flipped: the combined CRC of the blocks catches it.
  const std::string shard = dir + "/shard_00000.safetensors";
  const int64_t pos = [&] {
    SafetensorsFile f(shard);
    std::string bytes = file_bytes(shard);
    uint64_t header = 0;
    for (int i = 0; i < 8; ++i) header |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
    return int64_t(8 + header) + f.info("big[0,0]").data_begin + 35'000'000;
  }();
  {
    std::fstream io(shard, std::ios::binary | std::ios::in | std::ios::out);
    io.seekg(pos);
    char c = 0;
    io.read(&c, 1);
    c = char(c ^ 0x04);
    io.seekp(pos);
    io.write(&c, 1);
  }
  for (int threads : {1, 3}) {
    LoadOptions o;
    o.threads = threads;
    std::vector<ShardedTensor> t = fresh_targets(st);
    CHECK_THROWS_WITH(load_checkpoint(&w, tmp.path, t, o), Catch::Contains("'big[0,0]'") && Catch::Contains("CRC-32C"));
  }
}

TEST_CASE("checkpoint gpu: entries of several read blocks load into GPU tensors through the staging buffers",
          "[checkpoint][gpu]") {
  MC_REQUIRE_GPU();
  TempDir tmp;
  SoloWorld w;
  const CheckpointState st = multiblock_state(mctest::fresh_seed());
  save_checkpoint(w, tmp.path, st);
  for (int threads : {0, 1, 3}) {
    INFO("threads " << threads);
    LoadOptions o;
    o.threads = threads;
    std::vector<ShardedTensor> t = fresh_targets(st);
    for (ShardedTensor& x : t) x.local = Tensor::zeros(x.local.shape(), x.dtype, Device::cuda(0));
    load_checkpoint(&w, tmp.path, t, o);
    for (size_t i = 0; i < t.size(); ++i) require_same(t[i].local.to(Device::cpu()), st.tensors[i].local);
  }
}

TEST_CASE("corrupt, truncated, incomplete and mismatched checkpoints are IOErrors naming the problem", "[checkpoint]") {
  TempDir tmp;
  SoloWorld w;
  const CheckpointState st = sample_state(4, 7);
  const std::string dir = save_checkpoint(w, tmp.path, st);
  const std::string shard = dir + "/shard_00000.safetensors";
  auto load_all = [&](const LoadOptions& o = {}) {
    std::vector<ShardedTensor> t = fresh_targets(st);
    load_checkpoint(&w, tmp.path, t, o);
  };
  auto expect_io = [&](const std::string& needle, const LoadOptions& o = {}) {
    try {
      load_all(o);
      FAIL("expected an IOError mentioning " << needle);
    } catch (const IOError& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  load_all();
  const std::string good = [&] {
    std::ifstream in(shard, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  auto write = [&](const std::string& bytes) {
    std::ofstream out(shard, std::ios::binary | std::ios::trunc);
    out << bytes;
  };
  SECTION("a flipped data byte fails its CRC") {
    std::string bad = good;
    uint64_t header = 0;
    for (int i = 0; i < 8; ++i) header |= uint64_t(uint8_t(bad[size_t(i)])) << (8 * i);
    bad[8 + header + 5] ^= 0x10;  // inside the first entry ("w")
    write(bad);
    expect_io("CRC");
    LoadOptions no_verify;
    no_verify.verify_checksums = false;
    load_all(no_verify);  // the checks can be turned off, and only then does it load
  }
  SECTION("a truncated shard file") {
    write(good.substr(0, good.size() - 16));
    expect_io("shard_00000.safetensors");
  }
  SECTION("a missing shard file") {
    fs::remove(shard);
    expect_io("shard_00000.safetensors");
  }
  SECTION("wrong global shape, names the tensor and both shapes") {
    std::vector<ShardedTensor> t = fresh_targets(st);
    t[0].local = Tensor::zeros({6, 4});
    t[0].global_shape = {6, 4};
    t[0].pieces[0].shape = {6, 4};
    try {
      load_checkpoint(&w, tmp.path, t);
      FAIL("expected IOError");
    } catch (const IOError& e) {
      const std::string m = e.what();
      CHECK(m.find("'w'") != std::string::npos);
      CHECK(m.find("[6, 5]") != std::string::npos);
      CHECK(m.find("[6, 4]") != std::string::npos);
    }
  }
  SECTION("wrong dtype") {
    std::vector<ShardedTensor> t = fresh_targets(st);
    t[0].local = Tensor::zeros({6, 5}, DType::BF16);
    t[0].dtype = DType::BF16;
    CHECK_THROWS_AS(load_checkpoint(&w, tmp.path, t), IOError);
  }
  SECTION("a tensor the checkpoint lacks; allow_missing skips it") {
    std::vector<ShardedTensor> t = fresh_targets(st);
    t.push_back(replicated_tensor("not_there", Tensor::zeros({2})));
    CHECK_THROWS_WITH(load_checkpoint(&w, tmp.path, t), Catch::Contains("not_there"));
    LoadOptions o;
    o.allow_missing = true;
    load_checkpoint(&w, tmp.path, t, o);
  }
  SECTION("garbage metadata: the directory is not a checkpoint, and resolving its root says it is damaged") {
    std::ofstream(dir + "/metadata.json") << "{\"format\": 1";
    CHECK_THROWS_AS(CheckpointReader(tmp.path), IOError);
    CHECK_THROWS_WITH(resolve_checkpoint(tmp.path), Catch::Contains("is damaged: metadata.json cannot be read or is "
                                                                    "not valid JSON"));
  }
}

TEST_CASE("async saves copy first, write in the background and surface background errors on wait", "[checkpoint]") {
  TempDir tmp;
  SoloWorld w;
  CheckpointState st = sample_state(5, 50);
  const Tensor original = st.tensors[0].local.clone();
  {
    AsyncCheckpointSaver saver(w);
    saver.save(tmp.path, st);
    REQUIRE(saver.pending());
    st.tensors[0].local.fill_(-1.0);  // training goes on: the saved copy must not change
    REQUIRE(saver.wait() == checkpoint_dir(tmp.path, 5));
    REQUIRE_FALSE(saver.pending());
  }
  st.tensors[0].local.copy_(original);
  check_loads_as(tmp.path, st);

  SaveOptions o;
  o.fault_hook = [](const std::string& p) {
    if (p == "shard_written") throw IOError("injected disk failure");
  };
  AsyncCheckpointSaver saver(w, o);
  saver.save(tmp.path, sample_state(6, 60));
  CHECK_THROWS_WITH(saver.wait(), Catch::Contains("injected disk failure"));
  REQUIRE(resolve_checkpoint(tmp.path) == checkpoint_dir(tmp.path, 5));
  // The error was reported once; the saver is usable again.
  REQUIRE(saver.wait().empty());
}

namespace {

// A model's training state that an AdamW step changes in place: two parameters and their moments.
struct TinyTraining {
  layers::Parameter w, b;
  std::unique_ptr<optim::AdamW> opt;
  std::vector<ShardedTensor> params;
  TinyTraining() {
    w.name = "w";
    w.data = randn({300, 70}, 1);
    w.main_grad = randn({300, 70}, 2);
    b.name = "b";
    b.data = randn({70}, 3);
    b.main_grad = randn({70}, 4);
    opt = std::make_unique<optim::AdamW>(std::vector<layers::Parameter*>{&w, &b});
    params = {replicated_tensor("w", w.data), replicated_tensor("b", b.data)};
    opt->step(1e-3f);  // non-zero moments
  }
  int64_t state_bytes() const {
    int64_t n = 0;
    for (const ShardedTensor& t : state(0).tensors)
      for (const ShardPiece& p : t.pieces) {
        int64_t v = dtype_size(t.dtype);
        for (int64_t d : p.shape) v *= d;
        n += v;
      }
    return n;
  }
  CheckpointState state(int64_t step) const {
    CheckpointState st;
    st.step = step;
    st.tensors = params;
    add_optimizer_state(st, *opt, params);
    st.json["data"] = R"({"position":17})";
    return st;
  }
};

}  // namespace

TEST_CASE("an async save blocks only for its snapshot: training steps run while it is written, and its files equal "
          "the synchronous save's bit for bit", "[checkpoint]") {
  TempDir sync_root, async_root;
  SoloWorld w;
  TinyTraining tr;
  save_checkpoint(w, sync_root.path, tr.state(1));

  // The background writer stops after writing the shard until the training step below is done, so the
  // step provably runs while the save is in flight.
  std::promise<void> step_done;
  std::shared_future<void> step_done_f = step_done.get_future().share();
  SaveOptions o;
  o.fault_hook = [step_done_f](const std::string& point) {
    // Bounded, so a failing check below cannot leave the writer (and the test) waiting forever.
    if (point == "shard_written") step_done_f.wait_for(std::chrono::seconds(60));
  };
  AsyncCheckpointSaver saver(w, o);
  saver.save(async_root.path, tr.state(1));
  REQUIRE(saver.pending());
  REQUIRE_FALSE(saver.last_save_was_synchronous());
  const int64_t snapshot = saver.snapshot_bytes();
  REQUIRE(snapshot == tr.state_bytes());  // one copy of everything saved
  const Tensor before = tr.w.data.clone();
  tr.opt->step(1e-3f);  // a training step changes the live state in place
  REQUIRE(tr.w.data.to_double_vector() != before.to_double_vector());

  // A second save waits for the first: it cannot return while the first's writer is held.
  auto second = std::async(std::launch::async, [&] { saver.save(async_root.path, tr.state(2)); });
  REQUIRE(second.wait_for(std::chrono::milliseconds(200)) == std::future_status::timeout);
  REQUIRE_FALSE(resolve_checkpoint(async_root.path).has_value());
  step_done.set_value();
  second.get();
  // The first was committed before the second started; the second reused the first's buffers.
  REQUIRE(list_checkpoints(async_root.path).size() == 1);
  REQUIRE(saver.snapshot_bytes() == snapshot);
  REQUIRE(saver.wait() == checkpoint_dir(async_root.path, 2));
  require_same_files(checkpoint_dir(sync_root.path, 1), checkpoint_dir(async_root.path, 1));

  // The second save holds the state after the step.
  TempDir sync2;
  save_checkpoint(w, sync2.path, tr.state(2));
  require_same_files(checkpoint_dir(sync2.path, 2), checkpoint_dir(async_root.path, 2));
}

TEST_CASE("reserve allocates the async snapshot buffers up front; saves reuse them in place", "[checkpoint]") {
  TempDir sync_root, root;
  SoloWorld w;
  TinyTraining tr;
  save_checkpoint(w, sync_root.path, tr.state(1));
  const int64_t bytes = tr.state_bytes();
  SaveOptions o;
  o.async_host_memory_limit = bytes;  // exactly one copy
  AsyncCheckpointSaver saver(w, o);
  REQUIRE(saver.reserve(tr.state(1)) == bytes);
  const std::map<std::string, const void*> held = saver.snapshot_buffers();
  REQUIRE(held.size() == tr.state(1).tensors.size());  // one piece of each tensor on a single rank
  REQUIRE(saver.reserve(tr.state(1)) == bytes);  // idempotent: the same buffers
  REQUIRE(saver.snapshot_buffers() == held);

  saver.save(root.path, tr.state(1));
  REQUIRE_FALSE(saver.last_save_was_synchronous());
  REQUIRE(saver.snapshot_buffers() == held);  // the first save copied into the reserved buffers
  REQUIRE_THROWS_AS(saver.reserve(tr.state(1)), ConfigError);  // not while a save is pending
  REQUIRE(saver.wait() == checkpoint_dir(root.path, 1));
  require_same_files(checkpoint_dir(sync_root.path, 1), checkpoint_dir(root.path, 1));
  tr.opt->step(1e-3f);
  saver.save(root.path, tr.state(2));
  REQUIRE(saver.snapshot_buffers() == held);
  saver.wait();

  // Buffers that would not fit are not reserved; the save then falls back to writing synchronously, as without.
  o.async_host_memory_limit = bytes - 1;
  AsyncCheckpointSaver small(w, o);
  REQUIRE(small.reserve(tr.state(3)) == 0);
  REQUIRE(small.snapshot_buffers().empty());
  small.save(root.path, tr.state(3));
  REQUIRE(small.last_save_was_synchronous());
  small.wait();
}

TEST_CASE("an async save whose snapshot does not fit the host memory limit is written synchronously", "[checkpoint]") {
  TempDir sync_root, root;
  SoloWorld w;
  TinyTraining tr;
  save_checkpoint(w, sync_root.path, tr.state(3));
  const int64_t bytes = tr.state_bytes();
  SaveOptions o;
  o.async_host_memory_limit = bytes - 1;
  AsyncCheckpointSaver small(w, o);
  small.save(root.path, tr.state(3));
  REQUIRE(small.last_save_was_synchronous());
  REQUIRE(small.snapshot_bytes() == 0);
  REQUIRE(small.wait() == checkpoint_dir(root.path, 3));
  require_same_files(checkpoint_dir(sync_root.path, 3), checkpoint_dir(root.path, 3));

  o.async_host_memory_limit = bytes;  // just fits
  AsyncCheckpointSaver fits(w, o);
  fits.save(root.path, tr.state(4));
  REQUIRE_FALSE(fits.last_save_was_synchronous());
  REQUIRE(fits.snapshot_bytes() == bytes);
  fits.wait();
}

TEST_CASE("format-1 checkpoints (CRC-32 per entry) still load and are checked; newer formats are refused",
          "[checkpoint]") {
  TempDir tmp;
  SoloWorld w;
  CheckpointState st = sample_state(4, 30);
  const std::string dir = save_checkpoint(w, tmp.path, st);
  const std::string mp = dir + "/metadata.json";
  nlohmann::json meta = nlohmann::json::parse(file_bytes(mp));
  REQUIRE(meta["version"] == 2);
  // Rewrite it as format 1 wrote it: a CRC-32 instead of the CRC-32C.
  SafetensorsFile f(dir + "/shard_00000.safetensors");
  meta["version"] = 1;
  for (auto& [name, t] : meta["tensors"].items())
    for (auto& sh : t["shards"]) {
      Tensor bytes = f.tensor(sh["key"].get<std::string>());
      sh["crc32"] = crc32(bytes.data_ptr(), size_t(bytes.nbytes()));
      sh.erase("crc32c");
    }
  std::ofstream(mp, std::ios::trunc) << meta.dump(1);
  check_loads_as(tmp.path, st);

  meta["tensors"]["w"]["shards"][0]["crc32"] = meta["tensors"]["w"]["shards"][0]["crc32"].get<uint32_t>() ^ 1u;
  std::ofstream(mp, std::ios::trunc) << meta.dump(1);
  std::vector<ShardedTensor> targets = fresh_targets(st);
  CHECK_THROWS_WITH(load_checkpoint(&w, tmp.path, targets), Catch::Contains("CRC-32 check"));

  meta["version"] = 3;
  std::ofstream(mp, std::ios::trunc) << meta.dump(1);
  CHECK_THROWS_WITH(CheckpointReader(dir), Catch::Contains("format version 3 is newer"));
}

TEST_CASE("CheckpointManager: save every N, keep last k and top-k by validation loss, resume", "[checkpoint]") {
  TempDir tmp;
  SoloWorld w;
  CheckpointPolicy pol;
  pol.save_every = 2;
  pol.keep_last = 2;
  pol.keep_top_k = 1;
  pol.async = true;
  CheckpointManager mgr(w, tmp.path, pol);
  REQUIRE_FALSE(mgr.latest().has_value());
  std::vector<ShardedTensor> none;
  REQUIRE_FALSE(mgr.resume(none).has_value());
  const std::vector<double> loss = {3.0, 1.0, 2.0, 2.5, 2.2};  // step 4 is the best
  for (int64_t step = 1; step <= 10; ++step) {
    if (!mgr.should_save(step)) continue;
    CheckpointState st = sample_state(step, uint64_t(step));
    st.val_loss = loss[size_t(step / 2 - 1)];
    mgr.save(st);
  }
  mgr.wait();
  std::vector<int64_t> kept;
  for (const auto& c : list_checkpoints(tmp.path)) kept.push_back(c.step);
  REQUIRE(kept == std::vector<int64_t>{4, 8, 10});
  const CheckpointState last = sample_state(10, 10);
  std::vector<ShardedTensor> targets = fresh_targets(last);
  auto r = mgr.resume(targets);
  REQUIRE(r.has_value());
  REQUIRE(r->step() == 10);
  for (size_t i = 0; i < targets.size(); ++i) require_same(targets[i].local, last.tensors[i].local);
  CHECK_THROWS_AS(CheckpointManager(w, tmp.path, CheckpointPolicy{.keep_last = -1}), ValueError);
}

TEST_CASE("CheckpointManager: keep_last 0 keeps every checkpoint, with keep_top_k too", "[checkpoint]") {
  TempDir tmp;
  SoloWorld w;
  CheckpointManager mgr(w, tmp.path, CheckpointPolicy{.save_every = 2, .keep_last = 0, .keep_top_k = 1});
  for (int64_t step = 2; step <= 8; step += 2) {
    CheckpointState st = sample_state(step, uint64_t(step));
    st.val_loss = 10.0 - double(step);
    mgr.save(st);
  }
  std::vector<int64_t> kept;
  for (const auto& c : list_checkpoints(tmp.path)) kept.push_back(c.step);
  REQUIRE(kept == std::vector<int64_t>{2, 4, 6, 8});
}

TEST_CASE("a damaged newest checkpoint is an IOError naming the newest intact one, not skipped", "[checkpoint]") {
  SoloWorld w;
  TempDir tmp;
  const std::string s2 = save_checkpoint(w, tmp.path, sample_state(2, 20));
  const std::string s4 = save_checkpoint(w, tmp.path, sample_state(4, 40));
  const fs::path meta4 = fs::path(s4) / "metadata.json";
  const std::string good = [&] {
    std::ifstream in(meta4);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  auto resolve_error = [&](const std::string& path) {
    try {
      (void)resolve_checkpoint(path);
    } catch (const IOError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  SECTION("latest names a step whose metadata is not valid JSON") {
    std::ofstream(meta4) << good.substr(0, good.size() / 2);
    const std::string e = resolve_error(tmp.path);
    CHECK(e.find("checkpoint '" + s4 + "' is damaged: metadata.json cannot be read or is not valid JSON") == 0);
    CHECK(e.find("It is the newest under '" + tmp.path + "', where a resume starts: resume from the newest intact "
                 "one with checkpoint.resume = '" + s2 + "', or move '" + s4 + "' out of '" + tmp.path + "'") !=
          std::string::npos);
    // Named directly, it is damaged too; the intact one still resolves by name.
    CHECK(resolve_error(s4).find("It cannot be loaded: resume from the newest intact one with checkpoint.resume = '" +
                                 s2 + "'") != std::string::npos);
    CHECK(resolve_error(s4 + "/").find("It cannot be loaded") != std::string::npos);
    CHECK(resolve_checkpoint(s2) == s2);
  }
  SECTION("its metadata is missing, and latest is gone") {
    fs::remove(meta4);
    fs::remove(fs::path(tmp.path) / "latest");
    CHECK(resolve_error(tmp.path).find("' is damaged: metadata.json is missing. It is the newest") != std::string::npos);
  }
  SECTION("moved out of the root, the intact one resolves") {
    std::ofstream(meta4) << "{";
    fs::rename(s4, fs::path(tmp.path).parent_path() / (fs::path(tmp.path).filename().string() + "_step_4_damaged"));
    CHECK(resolve_checkpoint(tmp.path) == s2);
    fs::remove_all(fs::path(tmp.path).parent_path() / (fs::path(tmp.path).filename().string() + "_step_4_damaged"));
  }
  SECTION("every checkpoint damaged") {
    std::ofstream(meta4) << "[]";
    std::ofstream(fs::path(s2) / "metadata.json") << "";
    CHECK(resolve_error(tmp.path).find("is damaged: metadata.json is not a megacore checkpoint's (no \"format\": "
                                       "\"megacore-distributed-checkpoint\"), and '" + tmp.path + "' holds no intact "
                                       "checkpoint: start without one "
                                       "(checkpoint.resume = '')") != std::string::npos);
  }
  SECTION("a checkpoint root that happens to be named step_<N> is a root, not a damaged checkpoint") {
    const fs::path root = fs::path(tmp.path) / "step_1";
    fs::create_directories(root / ".tmp.step_2");  // a first save that crashed before its rename
    CHECK_FALSE(resolve_checkpoint(root.string()).has_value());
    const std::string s3 = save_checkpoint(w, root.string(), sample_state(3, 30));
    CHECK(resolve_checkpoint(root.string()) == s3);
  }
  SECTION("latest pointed back at an older intact step is honoured, a damaged newer one notwithstanding") {
    std::ofstream(meta4) << "{";
    std::ofstream(fs::path(tmp.path) / "latest") << "step_2\n";
    CHECK(resolve_checkpoint(tmp.path) == s2);
  }
}
