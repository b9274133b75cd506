// Copy-engine all-gather, reduce-scatter and send/receive batches (see peer_copy.hpp for the protocol).
#include "comm/nccl/peer_copy.hpp"

#include <cuda.h>  // CUstream, CUdeviceptr and the stream memory operation flags; the functions come through
                   // cudaGetDriverEntryPointByVersion (the library does not link the driver library)
#include <fcntl.h>
#include <signal.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <fstream>
#include <thread>

#include "core/cuda/cuda_check.hpp"
#include "megacore/core/allocator.hpp"

namespace megacore::comm::detail {
namespace {

using cuda_impl::QuietDeviceGuard;

using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

constexpr uint64_t kReleased = uint64_t(1) << 62;  // larger than any sequence number a job reaches

// The host: its name and the kernel's boot id (two containers or machines may share a host name).
int64_t host_id() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return 0;
  std::string id(name);
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string b;
  if (boot >> b) id += "/" + b;
  return int64_t(std::hash<std::string>{}(id) & 0x7fffffffffffffffULL);
}

// This process's PID namespace (the inode of /proc/self/ns/pid; -1 when unknown).
int64_t pid_namespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? int64_t(st.st_ino) : -1;
}

void* driver_fn(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess)
    return nullptr;
  return f;
}

// The local half of create(): this rank's buffer and its IPC handle; an empty string on success.
std::string prepare(int device, size_t bytes, char** buf, cudaIpcMemHandle_t* handle, void** wait_fn,
                    void** write_fn) {
  *wait_fn = driver_fn("cuStreamWaitValue64");
  *write_fn = driver_fn("cuStreamWriteValue64");
  if (!*wait_fn || !*write_fn) return "the driver has no cuStreamWaitValue64 / cuStreamWriteValue64";
  int attr = 0;
  CUdevice dev = device;
  auto get_attr = reinterpret_cast<CUresult (*)(int*, CUdevice_attribute, CUdevice)>(driver_fn("cuDeviceGetAttribute"));
  if (!get_attr || get_attr(&attr, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev) != CUDA_SUCCESS || !attr)
    return fmt::format("cuda:{} does not support 64-bit stream memory operations", device);
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(buf), bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    *buf = nullptr;
    return fmt::format("allocating its {} MiB staging buffer failed ({})", bytes >> 20, cudaGetErrorString(e));
  }
  e = cudaMemset(*buf, 0, bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaIpcGetMemHandle(handle, *buf);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    cudaFree(*buf);
    *buf = nullptr;
    return fmt::format("cudaIpcGetMemHandle failed ({})", cudaGetErrorString(e));
  }
  return {};
}

}  // namespace

// The host mailbox of a send/receive batch's addresses (peer_copy.hpp): per directed pair (from, to), the
// sequence number of the latest send `from` posted and of the latest one `to` read, and a ring of entries.
namespace {
constexpr uint64_t kMailboxDepth = 64;
struct MailboxEntry {
  cudaIpcMemHandle_t handle;
  uint64_t base, offset, bytes;
  uint64_t by_nccl;  // 1: the tensor is not the caching allocator's; both sides move it with NCCL
};
struct MailboxHeader {
  std::atomic<uint64_t> closed[kPeerCopyMaxRanks];  // 1 once rank r closed its mappings at teardown
  std::atomic<int64_t> pid[kPeerCopyMaxRanks];      // rank r's process (a dead one maps nothing)
  std::atomic<int64_t> pid_ns[kPeerCopyMaxRanks];   // and its PID namespace (pid_namespace())
};
struct MailboxPair {
  std::atomic<uint64_t> posted{0};
  std::atomic<uint64_t> read{0};
  char pad[48];
  MailboxEntry entry[kMailboxDepth];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the mailbox needs lock-free 64-bit atomics across processes");
}  // namespace

struct PeerCopyMailbox {
  void* base = nullptr;
  size_t bytes = 0;
  int size = 0;
  MailboxHeader* header() const { return static_cast<MailboxHeader*>(base); }
  MailboxPair* pair(int from, int to) const {
    return reinterpret_cast<MailboxPair*>(static_cast<char*>(base) + sizeof(MailboxHeader)) +
           (size_t(from) * size_t(size) + size_t(to));
  }
  ~PeerCopyMailbox() {
    if (base) munmap(base, bytes);
  }
};

std::shared_ptr<PeerCopy> PeerCopy::create(int rank, int size, int device, size_t buffer_bytes,
                                           std::chrono::milliseconds timeout, const GatherFn& gather,
                                           std::string* why) {
  static_assert(sizeof(cudaIpcMemHandle_t) == 64, "an IPC handle travels as 8 int64 values");
  std::shared_ptr<PeerCopy> pc(new PeerCopy());
  pc->rank_ = rank;
  pc->size_ = size;
  pc->device_ = device;
  pc->timeout_ = timeout;
  const size_t flags_bytes = (size_t(2) * size * kSlots + size_t(2) * size + kSlots) * sizeof(uint64_t);
  pc->slot_bytes_ = (buffer_bytes / kSlots) & ~size_t(255);
  pc->chunk_bytes_ = (pc->slot_bytes_ / size) & ~size_t(255);
  pc->flags_offset_ = pc->slot_bytes_ * kSlots;
  pc->sent_.assign(size_t(size), 0);
  pc->received_.assign(size_t(size), 0);
  const size_t total = pc->flags_offset_ + flags_bytes;
  QuietDeviceGuard current(device);

  std::string mine;
  cudaIpcMemHandle_t handle{};
  if (size > 16) mine = fmt::format("{} ranks are more than the 16 it sums", size);
  else if (pc->chunk_bytes_ < 4096) mine = fmt::format("its buffer of {} bytes is too small", buffer_bytes);
  else mine = prepare(device, total, &pc->own_, &handle, &pc->wait_fn_, &pc->write_fn_);
  std::vector<int64_t> v(11, 0);
  v[0] = mine.empty() ? 1 : 0;
  v[1] = host_id();
  std::memcpy(&v[2], &handle, sizeof(handle));
  v[10] = int64_t(std::random_device{}() & 0x7fffffff) ^ (int64_t(getpid()) << 31);  // rank 0's names the mailbox
  std::vector<int64_t> all0 = gather(v), all;
  for (int r = 0; r < size; ++r) all.insert(all.end(), all0.begin() + 11 * r, all0.begin() + 11 * r + 10);
  auto give_up = [&](std::string reason) -> std::shared_ptr<PeerCopy> {
    *why = std::move(reason);
    return nullptr;  // ~PeerCopy frees what this rank allocated or opened
  };
  for (int r = 0; r < size; ++r) {
    if (all[10 * r] != 1) return give_up(r == rank ? mine : fmt::format("rank {} of the group could not set up", r));
    if (all[10 * r + 1] != v[1]) return give_up(fmt::format("rank {} runs on another host", r));
  }
  pc->base_.assign(size_t(size), nullptr);
  pc->base_[size_t(rank)] = pc->own_;
  std::string opened;
  for (int r = 0; r < size && opened.empty(); ++r) {
    if (r == rank) continue;
    cudaIpcMemHandle_t h;
    std::memcpy(&h, &all[10 * r + 2], sizeof(h));
    void* p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      opened = fmt::format("opening rank {}'s buffer failed ({})", r, cudaGetErrorString(e));
    } else {
      pc->base_[size_t(r)] = static_cast<char*>(p);
    }
  }
  if (opened.empty()) {
    if (cudaStreamCreateWithPriority(&pc->push_, cudaStreamNonBlocking, 0) != cudaSuccess ||
        cudaStreamCreateWithPriority(&pc->recv_, cudaStreamNonBlocking, 0) != cudaSuccess ||
        cudaEventCreateWithFlags(&pc->fork_, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&pc->join_, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&pc->join_recv_, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      opened = "creating its push stream failed";
    }
  }
  std::vector<int64_t> ok = gather({opened.empty() ? 1 : 0});
  for (int r = 0; r < size; ++r)
    if (ok[size_t(r)] != 1) return give_up(r == rank ? opened : fmt::format("rank {} could not open its peers' buffers", r));
  // The mailbox: rank 0 creates the shared memory, the others map it once it exists, then rank 0 unlinks
  // the name (the mappings stay; nothing is left behind when a process dies).
  const std::string name = fmt::format("/megacore_pc_{:x}", uint64_t(all0[10]));
  auto mb = std::make_shared<PeerCopyMailbox>();
  mb->size = size;
  mb->bytes = sizeof(MailboxHeader) + sizeof(MailboxPair) * size_t(size) * size_t(size);
  auto map_it = [&](int flags) -> std::string {
    const int fd = shm_open(name.c_str(), flags, 0600);
    if (fd < 0) return fmt::format("shm_open({}) failed: {}", name, std::strerror(errno));
    if ((flags & O_CREAT) && ftruncate(fd, off_t(mb->bytes)) != 0) {
      close(fd);
      return fmt::format("sizing the shared memory {} failed: {}", name, std::strerror(errno));
    }
    void* p = mmap(nullptr, mb->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return fmt::format("mapping the shared memory {} failed: {}", name, std::strerror(errno));
    mb->base = p;
    return {};
  };
  std::string made = rank == 0 ? map_it(O_CREAT | O_EXCL | O_RDWR) : std::string();
  std::vector<int64_t> created = gather({made.empty() ? 1 : 0});
  if (created[0] != 1) {
    if (rank == 0 && mb->base) shm_unlink(name.c_str());
    return give_up(rank == 0 ? made : "rank 0 could not create the host mailbox");
  }
  if (rank != 0) made = map_it(O_RDWR);
  std::vector<int64_t> mapped_ok = gather({made.empty() ? 1 : 0});
  if (rank == 0) shm_unlink(name.c_str());
  for (int r = 0; r < size; ++r)
    if (mapped_ok[size_t(r)] != 1) return give_up(r == rank ? made : fmt::format("rank {} could not map the host mailbox", r));
  mb->header()->pid[rank].store(int64_t(getpid()), std::memory_order_relaxed);
  mb->header()->pid_ns[rank].store(pid_namespace(), std::memory_order_relaxed);
  pc->mailbox_ = std::move(mb);
  pc->range_fn_ = driver_fn("cuMemGetAddressRange");
  if (!pc->range_fn_) return give_up("the driver has no cuMemGetAddressRange");  // same driver on every rank
  return pc;
}

PeerCopy::~PeerCopy() {
  if (!own_) return;
  QuietDeviceGuard current(device_);
  if (!drain_device()) {
    // Something on this device never ended (not a wait of ours: those were released): leave the mappings and
    // the buffer as they are rather than free memory a running copy may still touch.
    fmt::print(stderr, "[megacore] comm: copy-engine teardown on cuda:{}: the device did not finish within the "
               "timeout even with every flag released; its mappings and buffer are left in place\n", device_);
    return;
  }
  for (int r = 0; r < int(base_.size()); ++r)
    if (r != rank_ && base_[size_t(r)]) cudaIpcCloseMemHandle(base_[size_t(r)]);
  for (const auto& [key, p] : opened_) cudaIpcCloseMemHandle(p);
  (void)cudaGetLastError();
  if (mailbox_) {
    MailboxHeader* h = mailbox_->header();
    h->closed[rank_].store(1, std::memory_order_seq_cst);  // seq_cst with the loads below: of two ranks tearing
                                                           // down at once, at least one sees the other's flag
    if (!pinned_.empty() && !released_.load()) {
      // This rank's pinned allocations go back to the caching allocator's rules only if no peer maps them any
      // more: every rank has closed its mappings, or its process is gone. No waiting for that (ranks destroy
      // their communicators in their own order, and one that waited here could hold up a peer waiting for it
      // elsewhere): otherwise they stay pinned, cached and reusable, for the rest of the process. After an
      // abort they stay pinned too.
      bool all = true;
      for (int r = 0; r < size_ && all; ++r) {
        if (h->closed[r].load(std::memory_order_seq_cst)) continue;
        // A process ID means something only within this rank's PID namespace (containers can share a host name
        // and boot id): a rank in another one counts as alive.
        const int64_t pid = h->pid[r].load(std::memory_order_relaxed);
        all = pid > 0 && h->pid_ns[r].load(std::memory_order_relaxed) == pid_namespace() &&
              kill(pid_t(pid), 0) != 0 && errno == ESRCH;
      }
      if (all) {
        Allocator& a = Allocator::get(Device::cuda(device_));
        for (void* p : pinned_) a.unpin(p);
      }
    }
  }
  cudaFree(own_);
  if (push_) cudaStreamDestroy(push_);
  if (recv_) cudaStreamDestroy(recv_);
  if (fork_) cudaEventDestroy(fork_);
  if (join_) cudaEventDestroy(join_);
  if (join_recv_) cudaEventDestroy(join_recv_);
  (void)cudaGetLastError();
}

bool PeerCopy::drain_device() {
  // cudaDeviceSynchronize on a helper thread, so that this one can bound the wait: up to the timeout for the
  // group's transfers to end by themselves (a live peer finishes its side), then with every flag of this rank
  // written to its largest value, again and again (a slower peer's late write can lower one), for as long
  // once more. After an abort the flags are released from the start.
  auto done = std::make_shared<std::atomic<bool>>(false);
  const int device = device_;
  std::thread sync([done, device] {
    cudaSetDevice(device);
    cudaDeviceSynchronize();
    (void)cudaGetLastError();
    done->store(true, std::memory_order_release);
  });
  const auto start = std::chrono::steady_clock::now();
  auto last_release = start - std::chrono::hours(1);
  while (!done->load(std::memory_order_acquire)) {
    const auto now = std::chrono::steady_clock::now();
    if (now - start > 2 * timeout_ + std::chrono::seconds(1)) {
      sync.detach();  // it holds nothing of this object
      return false;
    }
    if ((released_.load() || now - start > timeout_) && now - last_release > std::chrono::milliseconds(10)) {
      release();
      last_release = now;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  sync.join();
  return true;
}

bool PeerCopy::pin_allocation(void* base) {
  if (std::find(pinned_.begin(), pinned_.end(), base) != pinned_.end()) return true;
  if (!Allocator::get(Device::cuda(device_)).pin(base)) return false;
  pinned_.push_back(base);
  return true;
}

uint64_t* PeerCopy::ready_flag(int base_rank, int from, int slot) const {
  return reinterpret_cast<uint64_t*>(base_[size_t(base_rank)] + flags_offset_) + (from * kSlots + slot);
}
uint64_t* PeerCopy::consumed_flag(int base_rank, int from, int slot) const {
  return reinterpret_cast<uint64_t*>(base_[size_t(base_rank)] + flags_offset_) + size_ * kSlots +
         (from * kSlots + slot);
}
uint64_t* PeerCopy::p2p_ready_flag(int base_rank, int from) const {
  return reinterpret_cast<uint64_t*>(base_[size_t(base_rank)] + flags_offset_) + 2 * size_ * kSlots + from;
}
uint64_t* PeerCopy::p2p_consumed_flag(int base_rank, int to) const {
  return reinterpret_cast<uint64_t*>(base_[size_t(base_rank)] + flags_offset_) + 2 * size_ * kSlots + size_ + to;
}
unsigned long long* PeerCopy::counter(int slot) const {
  return reinterpret_cast<unsigned long long*>(own_ + flags_offset_) + flag_count() + slot;
}
char* PeerCopy::slot_piece(int owner, int slot, int from) const {
  return base_[size_t(owner)] + size_t(slot) * slot_bytes_ + size_t(from) * chunk_bytes_;
}

cudaError_t PeerCopy::wait_flag(cudaStream_t s, uint64_t* flag, uint64_t value) const {
  CUresult r = reinterpret_cast<WaitValue64>(wait_fn_)(reinterpret_cast<CUstream>(s),
                                                       reinterpret_cast<CUdeviceptr>(flag), value,
                                                       CU_STREAM_WAIT_VALUE_GEQ);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorUnknown;
}
cudaError_t PeerCopy::write_flag(cudaStream_t s, uint64_t* flag, uint64_t value) const {
  CUresult r = reinterpret_cast<WriteValue64>(write_fn_)(reinterpret_cast<CUstream>(s),
                                                         reinterpret_cast<CUdeviceptr>(flag), value,
                                                         CU_STREAM_WRITE_VALUE_DEFAULT);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorUnknown;
}

cudaError_t PeerCopy::begin_chunk(cudaStream_t s, uint64_t q) const {
  if (q <= uint64_t(kSlots)) return cudaSuccess;  // first use of the slot
  const int slot = int(q % kSlots);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    if (cudaError_t e = wait_flag(s, consumed_flag(rank_, p, slot), q - kSlots); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

#define MC_PC_TRY(x)                       \
  do {                                     \
    if (cudaError_t e_ = (x); e_ != cudaSuccess) return e_; \
  } while (0)

cudaError_t PeerCopy::fork(cudaStream_t s) {
  MC_PC_TRY(cudaEventRecord(fork_, s));
  return cudaStreamWaitEvent(push_, fork_, 0);
}
cudaError_t PeerCopy::join(cudaStream_t s) {
  MC_PC_TRY(cudaEventRecord(join_, push_));
  return cudaStreamWaitEvent(s, join_, 0);
}

FinishArgs PeerCopy::finish_args(uint64_t q, int slot) const {
  FinishArgs a{};
  a.q = q;
  a.counter = counter(slot);
  a.rank = rank_;
  a.size = size_;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    a.ready[p] = ready_flag(rank_, p, slot);
    a.consumed[p] = consumed_flag(p, rank_, slot);
    a.piece[p] = slot_piece(rank_, slot, p);
  }
  return a;
}

cudaError_t PeerCopy::all_gather(const void* in, void* out, size_t bytes_per_rank, cudaStream_t s) {
  QuietDeviceGuard current(device_);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  MC_PC_TRY(fork(s));
  for (size_t off = 0; off < bytes_per_rank; off += chunk_bytes_) {
    const size_t len = std::min(chunk_bytes_, bytes_per_rank - off);
    const uint64_t q = ++seq_;
    const int slot = int(q % kSlots);
    MC_PC_TRY(begin_chunk(push_, q));
    for (int i = 1; i < size_; ++i) {  // to the next ranks first, so that the links fill evenly
      const int p = (rank_ + i) % size_;
      MC_PC_TRY(cudaMemcpyAsync(slot_piece(p, slot, rank_), src + off, len, cudaMemcpyDeviceToDevice, push_));
      MC_PC_TRY(write_flag(push_, ready_flag(p, rank_, slot), q));
    }
    FinishArgs a = finish_args(q, slot);
    a.bytes = int64_t(len);
    for (int p = 0; p < size_; ++p) a.dst[p] = dst + size_t(p) * bytes_per_rank + off;
    a.piece[rank_] = src + off;  // this rank's own piece, copied from `in`
    MC_PC_TRY(peer_copy_finish_gather(a, s));
  }
  return join(s);
}

cudaError_t PeerCopy::reduce_scatter_sum(const void* in, void* out, int64_t count, DType dtype, cudaStream_t s) {
  QuietDeviceGuard current(device_);
  const size_t es = dtype_size(dtype);
  const size_t bytes = size_t(count) * es;
  const size_t step = chunk_bytes_ / es * es;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  MC_PC_TRY(fork(s));
  for (size_t off = 0; off < bytes; off += step) {
    const size_t len = std::min(step, bytes - off);
    const uint64_t q = ++seq_;
    const int slot = int(q % kSlots);
    MC_PC_TRY(begin_chunk(push_, q));
    for (int i = 1; i < size_; ++i) {
      const int p = (rank_ + i) % size_;
      MC_PC_TRY(cudaMemcpyAsync(slot_piece(p, slot, rank_), src + size_t(p) * bytes + off, len,
                                cudaMemcpyDeviceToDevice, push_));
      MC_PC_TRY(write_flag(push_, ready_flag(p, rank_, slot), q));
    }
    FinishArgs a = finish_args(q, slot);
    a.bytes = int64_t(len);
    a.piece[rank_] = src + size_t(rank_) * bytes + off;
    a.dst[0] = dst + off;
    MC_PC_TRY(peer_copy_finish_sum(a, dtype, s));
  }
  return join(s);
}

char* PeerCopy::mapped(const void* handle, std::string* why) {
  const std::string key(static_cast<const char*>(handle), sizeof(cudaIpcMemHandle_t));
  for (const auto& [k, p] : opened_)
    if (k == key) return p;
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  void* p = nullptr;
  cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    *why = fmt::format("opening a peer's tensor through CUDA IPC failed ({})", cudaGetErrorString(e));
    return nullptr;
  }
  opened_.emplace_back(key, static_cast<char*>(p));
  return static_cast<char*>(p);
}

std::string PeerCopy::post_and_match(std::vector<PeerCopyTransfer>& transfers, std::chrono::milliseconds timeout,
                                     const std::function<bool()>& aborted) {
  QuietDeviceGuard current(device_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  struct Post {
    size_t t;  // index into transfers
    MailboxEntry e;
  };
  std::vector<Post> sends;
  std::vector<size_t> recvs;
  std::vector<std::pair<const void*, size_t>> self_sends;  // sends to this rank itself: (data, bytes)
  // Sequence numbers in issue order per pair; the sends' entries are made up front.
  for (size_t i = 0; i < transfers.size(); ++i) {
    PeerCopyTransfer& t = transfers[i];
    if (t.bytes == 0) continue;
    if (t.peer < 0 || t.peer >= size_) return fmt::format("peer {} is out of range [0, {})", t.peer, size_);
    if (!t.send) {
      if (t.peer != rank_) t.seq = ++received_[size_t(t.peer)], recvs.push_back(i);
      continue;
    }
    if (t.peer == rank_) {
      self_sends.emplace_back(t.data, t.bytes);
      continue;
    }
    Post post{i, {}};
    CUdeviceptr base = 0;
    size_t len = 0;
    const bool ours =
        reinterpret_cast<GetAddressRange>(range_fn_)(&base, &len, reinterpret_cast<CUdeviceptr>(t.data)) ==
            CUDA_SUCCESS &&
        pin_allocation(reinterpret_cast<void*>(base));
    if (ours) {
      if (cudaError_t e = cudaIpcGetMemHandle(&post.e.handle, reinterpret_cast<void*>(base)); e != cudaSuccess) {
        (void)cudaGetLastError();
        return fmt::format("cudaIpcGetMemHandle failed on a send tensor's allocation ({})", cudaGetErrorString(e));
      }
      post.e.base = uint64_t(base);
      post.e.offset = uint64_t(reinterpret_cast<CUdeviceptr>(t.data) - base);
    } else {
      (void)cudaGetLastError();
      post.e.by_nccl = 1;
      t.nccl = true;
    }
    post.e.bytes = t.bytes;
    t.seq = ++sent_[size_t(t.peer)];
    sends.push_back(post);
  }
  size_t self_next = 0;
  for (PeerCopyTransfer& t : transfers) {
    if (t.send || t.bytes == 0 || t.peer != rank_) continue;
    if (self_next >= self_sends.size())
      return "a receive from this rank itself has no matching send to itself in the same batch";
    const auto [data, bytes] = self_sends[self_next++];
    if (bytes != t.bytes)
      return fmt::format("receive #{} from this rank itself is {} bytes but its send to itself is {}; a send and its "
                         "receive must have the same size",
                         self_next, t.bytes, bytes);
    t.source = data;
  }
  if (self_next != self_sends.size())
    return fmt::format("{} send(s) from this rank to itself have no matching receive in the same batch",
                       self_sends.size() - self_next);
  // One progress loop: post each send once the pair's ring has room (the peer has read the entry that used its
  // place), read each receive once its sender posted it; per pair strictly in sequence order. Reading while
  // waiting to post is what lets any number of transfers per pair through a ring of kMailboxDepth entries.
  size_t next_send = 0, next_recv = 0;
  std::vector<bool> posted(sends.size(), false), read(recvs.size(), false);
  for (int spins = 0; next_send < sends.size() || next_recv < recvs.size(); ++spins) {
    bool progress = false;
    for (size_t j = next_send; j < sends.size(); ++j) {
      if (posted[j]) continue;
      const PeerCopyTransfer& t = transfers[sends[j].t];
      MailboxPair* mp = mailbox_->pair(rank_, t.peer);
      if (mp->posted.load(std::memory_order_relaxed) + 1 != t.seq) continue;  // an earlier send to that peer first
      if (mp->read.load(std::memory_order_acquire) + kMailboxDepth < t.seq) continue;  // no room yet
      mp->entry[t.seq % kMailboxDepth] = sends[j].e;
      mp->posted.store(t.seq, std::memory_order_release);
      posted[j] = true, progress = true;
    }
    while (next_send < sends.size() && posted[next_send]) ++next_send;
    for (size_t j = next_recv; j < recvs.size(); ++j) {
      if (read[j]) continue;
      PeerCopyTransfer& t = transfers[recvs[j]];
      MailboxPair* mp = mailbox_->pair(t.peer, rank_);
      if (mp->read.load(std::memory_order_relaxed) + 1 != t.seq) continue;  // an earlier receive from that peer first
      if (mp->posted.load(std::memory_order_acquire) < t.seq) continue;
      const MailboxEntry e = mp->entry[t.seq % kMailboxDepth];
      mp->read.store(t.seq, std::memory_order_release);
      read[j] = true, progress = true;
      if (e.bytes != t.bytes)
        return fmt::format("receive #{} from rank {} is {} bytes but that rank sent {}; a send and its receive must "
                           "have the same size",
                           t.seq, t.peer, t.bytes, e.bytes);
      if (e.by_nccl) {
        t.nccl = true;
        continue;
      }
      std::string why;
      char* p = mapped(&e.handle, &why);
      if (!p) return why;
      t.source = p + e.offset;
    }
    while (next_recv < recvs.size() && read[next_recv]) ++next_recv;
    if (progress) {
      spins = 0;
      continue;
    }
    if (aborted()) return "the communicator was aborted meanwhile";
    if (std::chrono::steady_clock::now() > deadline) {
      if (next_recv < recvs.size()) {
        const PeerCopyTransfer& t = transfers[recvs[next_recv]];
        return fmt::format("no send #{} from rank {} arrived within the timeout ({} ms): that rank did not post the "
                           "matching send (it skipped this batch, posted another, or died)",
                           t.seq, t.peer, timeout.count());
      }
      const PeerCopyTransfer& t = transfers[sends[next_send].t];
      return fmt::format("rank {} did not read this rank's send #{} within the timeout ({} ms) (it skipped this "
                         "batch, posted another, or died)",
                         t.peer, t.seq - kMailboxDepth, timeout.count());
    }
    if (spins > 2000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    else std::this_thread::yield();
  }
  return {};
}

cudaError_t PeerCopy::send_recv(const std::vector<PeerCopyTransfer>& transfers, cudaStream_t s) {
  QuietDeviceGuard current(device_);
  bool sends = false, recvs = false;
  for (const PeerCopyTransfer& t : transfers) {
    if (t.bytes == 0 || t.nccl) continue;
    if (t.send) sends = sends || t.peer != rank_;
    else recvs = true;
  }
  if (!sends && !recvs) return cudaSuccess;
  MC_PC_TRY(cudaEventRecord(fork_, s));
  if (sends) MC_PC_TRY(cudaStreamWaitEvent(push_, fork_, 0));
  if (recvs) MC_PC_TRY(cudaStreamWaitEvent(recv_, fork_, 0));
  // Sender: every tensor may be read now (its producers are ahead on `s`); then keep it until it was read.
  for (const PeerCopyTransfer& t : transfers)
    if (t.send && t.bytes && !t.nccl && t.peer != rank_)
      MC_PC_TRY(write_flag(push_, p2p_ready_flag(t.peer, rank_), t.seq));
  for (const PeerCopyTransfer& t : transfers)
    if (t.send && t.bytes && !t.nccl && t.peer != rank_)
      MC_PC_TRY(wait_flag(push_, p2p_consumed_flag(rank_, t.peer), t.seq));
  // Receiver: wait for the sender's word, read its tensor (a peer copy: the copy engines), say so.
  for (const PeerCopyTransfer& t : transfers) {
    if (t.send || t.bytes == 0 || t.nccl) continue;
    if (t.peer != rank_) MC_PC_TRY(wait_flag(recv_, p2p_ready_flag(rank_, t.peer), t.seq));
    MC_PC_TRY(cudaMemcpyAsync(t.data, t.source, t.bytes, cudaMemcpyDeviceToDevice, recv_));
    if (t.peer != rank_) MC_PC_TRY(write_flag(recv_, p2p_consumed_flag(t.peer, rank_), t.seq));
  }
  if (sends) {
    MC_PC_TRY(cudaEventRecord(join_, push_));
    MC_PC_TRY(cudaStreamWaitEvent(s, join_, 0));
  }
  if (recvs) {
    MC_PC_TRY(cudaEventRecord(join_recv_, recv_));
    MC_PC_TRY(cudaStreamWaitEvent(s, join_recv_, 0));
  }
  return cudaSuccess;
}

#undef MC_PC_TRY

void PeerCopy::release() noexcept {
  if (!own_) return;
  released_.store(true);
  QuietDeviceGuard current(device_);
  const size_t n = flag_count();
  std::vector<uint64_t> high(n, kReleased);
  // A non-blocking stream of its own: the legacy default stream would queue behind the waiting streams.
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess) {
    cudaMemcpyAsync(own_ + flags_offset_, high.data(), n * sizeof(uint64_t), cudaMemcpyHostToDevice, s);
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  (void)cudaGetLastError();
}

}  // namespace megacore::comm::detail
