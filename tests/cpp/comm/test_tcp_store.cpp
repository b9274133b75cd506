// The rendezvous store under hostile and careless clients: token, set-once keys, caps, deadlines,
// descriptor exhaustion, where it listens, and the bootstrap's use of it. Raw sockets speak the wire
// protocol of src/comm/tcp_store.cpp directly, to send what a megacore client never would.
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include "megacore/comm/bootstrap.hpp"
#include "comm/clean_env.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::comm;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint32_t kMagic = 0x4d435332;
constexpr uint8_t kSet = 1, kGet = 2, kHello = 3;
constexpr uint8_t kOk = 0, kTooLarge = 3, kDenied = 5;

std::string u32(uint32_t v) {
  uint32_t n = htonl(v);
  return std::string(reinterpret_cast<const char*>(&n), 4);
}
std::string head(uint8_t cmd, uint32_t len) { return u32(kMagic) + char(cmd) + u32(len); }
std::string hello(const std::string& token) { return head(kHello, uint32_t(token.size())) + token; }
std::string set_frame(const std::string& k, const std::string& v) {
  return head(kSet, uint32_t(k.size())) + k + u32(uint32_t(v.size())) + v;
}
std::string get_frame(const std::string& k) { return head(kGet, uint32_t(k.size())) + k; }

// A blocking TCP connection to addr:port, or -1 with errno set.
int raw_connect(const std::string& addr, int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  ::inet_pton(AF_INET, addr.c_str(), &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

void raw_send(int fd, const std::string& s) { (void)!::send(fd, s.data(), s.size(), MSG_NOSIGNAL); }

struct ReadResult {
  std::string bytes;
  bool closed = false;  // the server closed (EOF or reset) within the time given
};
// Reads what the server sends until it closes the connection or `within` passes (at least one look,
// so a connection closed long ago is seen even when the time is up).
ReadResult read_until_closed(int fd, std::chrono::milliseconds within) {
  ReadResult r;
  auto end = Clock::now() + within;
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    int left = int(std::max<long long>(0, std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count()));
    if (::poll(&p, 1, left) > 0) {
      char buf[4096];
      ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n > 0) {
        r.bytes.append(buf, size_t(n));
        continue;
      }
      if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        r.closed = true;
        return r;
      }
    }
    if (Clock::now() >= end) return r;
  }
}

// Waits up to `within` for pred() (the server thread counts an event just after the client sees it).
template <class P>
bool eventually(P&& pred, std::chrono::milliseconds within = 2s) {
  auto end = Clock::now() + within;
  while (!pred() && Clock::now() < end) std::this_thread::sleep_for(5ms);
  return pred();
}

// Reads exactly n bytes or fails the test (the server must answer within `within`).
std::string read_n(int fd, size_t n, std::chrono::milliseconds within = 3s) {
  std::string s;
  auto end = Clock::now() + within;
  while (s.size() < n && Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char buf[4096];
    ssize_t r = ::recv(fd, buf, std::min(sizeof(buf), n - s.size()), MSG_DONTWAIT);
    if (r <= 0) break;
    s.append(buf, size_t(r));
  }
  return s;
}

// The process's resident memory in bytes.
size_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * size_t(::sysconf(_SC_PAGESIZE));
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

using mctest::CleanEnv;

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// An IPv4 address of this machine other than loopback, or "" when it has none.
std::string non_loopback_ipv4() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string out;
  for (ifaddrs* i = list; i && out.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK))
      continue;
    char buf[INET_ADDRSTRLEN];
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
    if (std::string(buf).rfind("127.", 0) != 0) out = buf;
  }
  ::freeifaddrs(list);
  return out;
}

TcpStoreOptions fuzz_options() {
  TcpStoreOptions o;
  o.token = "fuzz-token-0123456789";
  o.timeout = 5s;
  o.limits.max_value_bytes = 4096;
  o.limits.max_keys = 256;
  o.limits.max_total_bytes = 64 * 1024;
  o.limits.max_unread_bytes = 16 * 1024;
  o.limits.max_clients = 400;
  o.limits.frame_deadline = 300ms;
  return o;
}

}  // namespace

TEST_CASE("tcp store: the token, set-once keys and the caps are typed errors that say why", "[comm][store]") {
  TcpStoreOptions o;
  o.token = "job-secret";
  o.timeout = 3s;
  o.limits.max_keys = 4;
  o.limits.max_total_bytes = 300;
  o.limits.max_value_bytes = 100;
  TcpStore server("127.0.0.1", 0, true, o);
  TcpStore client("127.0.0.1", server.port(), false, o);

  SECTION("a wrong or missing token is refused at connect") {
    TcpStoreOptions wrong = o;
    wrong.token = "job-secreT";
    std::string msg = error_of([&] { TcpStore c("127.0.0.1", server.port(), false, wrong); });
    CHECK(has(msg, "wrong token"));
    CHECK(has(msg, "MEGACORE_STORE_TOKEN"));
    CHECK_THROWS_AS(TcpStore("127.0.0.1", server.port(), false, wrong), CommError);
    wrong.token = "";
    CHECK(has(error_of([&] { TcpStore c("127.0.0.1", server.port(), false, wrong); }), "none was sent"));
    // ... and a server without a token refuses a client that has one (it belongs to another job).
    TcpStore open("127.0.0.1", 0, true, 3s);
    CHECK_THROWS_AS(TcpStore("127.0.0.1", open.port(), false, o), CommError);
    CHECK(eventually([&] { return server.stats().dropped >= 3; }));
  }
  SECTION("keys are set once, on the server and through a client") {
    client.set("id", "first");
    std::string msg = error_of([&] { client.set("id", "second"); });
    CHECK(has(msg, "key 'id' is already set"));
    CHECK_THROWS_AS(client.set("id", "second"), CommError);
    CHECK_THROWS_AS(server.set("id", "third"), CommError);
    server.set("own", "x");
    CHECK_THROWS_AS(client.set("own", "y"), CommError);
    CHECK(client.get("id") == "first");  // the connection stays usable after a refusal
    CHECK(server.get("own") == "x");
  }
  SECTION("sizes, key count and total bytes are bounded") {
    CHECK_THROWS_AS(client.set(std::string(1025, 'k'), "v"), ValueError);
    CHECK_THROWS_AS(client.set("k", std::string(101, 'v')), ValueError);
    // A client with looser limits than the server is refused by the server.
    TcpStoreOptions loose = o;
    loose.limits.max_value_bytes = 1 << 20;
    TcpStore big("127.0.0.1", server.port(), false, loose);
    std::string msg = error_of([&] { big.set("k", std::string(5000, 'v')); });
    CHECK(has(msg, "over the store's limit of 100 bytes"));
    CHECK(has(error_of([&] { big.set("k", "v"); }), "closed"));  // that connection is gone
    client.set("a", std::string(100, 'a'));
    client.set("b", std::string(100, 'b'));
    msg = error_of([&] { client.set("c", std::string(100, 'c')); });  // 3 × 101 > 300 bytes
    CHECK(has(msg, "the store is full"));
    client.set("c", "c");
    client.set("d", "d");
    CHECK(has(error_of([&] { client.set("e", "e"); }), "4 keys"));
    TcpStoreStats s = server.stats();
    CHECK(s.keys == 4);
    CHECK(s.stored_bytes <= 300);
    CHECK(s.refused >= 3);
  }
}

TEST_CASE("tcp store: fuzz - hostile, slow and idle clients while a rank's set/get sequence completes", "[comm][store]") {
  const TcpStoreOptions opts = fuzz_options();
  const size_t rss0 = rss_bytes();
  TcpStore server("127.0.0.1", 0, true, opts);
  const int port = server.port();
  server.set("nccl_id", std::string(128, '\x42'));

  // The legitimate rank: sets and reads its keys throughout, and no request may wait on the others.
  std::atomic<bool> attack_done{false};
  std::string legit_error;
  double legit_worst_s = 0;
  int legit_rounds = 0;
  std::thread legit([&] {
    try {
      TcpStore c("127.0.0.1", port, false, opts);
      auto value_of = [](int i) { return std::string(size_t(i % 64), char('a' + i % 26)); };
      for (int i = 0; !attack_done.load() || i < 50; ++i) {
        auto t0 = Clock::now();
        // Keys are set once and the store is bounded: new keys for a while, then reads of them.
        const int k = i % 100;
        std::string key = "legit/" + std::to_string(k);
        if (i < 100) c.set(key, value_of(k));
        if (c.get(key) != value_of(k)) legit_error = "wrong value for " + key;
        if (c.get("nccl_id") != std::string(128, '\x42')) legit_error = "the NCCL id changed";
        legit_worst_s = std::max(legit_worst_s, std::chrono::duration<double>(Clock::now() - t0).count());
        legit_rounds = i + 1;
        std::this_thread::sleep_for(2ms);
      }
    } catch (const std::exception& e) {
      legit_error = e.what();
    }
  });

  // Whatever fails below, the threads are stopped and joined (a joinable std::thread's destructor
  // would end the whole test run).
  std::unique_ptr<std::thread> slow;
  struct Join {
    std::function<void()> f;
    ~Join() { f(); }
  } join_all{[&] {
    attack_done = true;
    if (slow && slow->joinable()) slow->join();
    if (legit.joinable()) legit.join();
  }};

  const std::string& token = opts.token;
  std::vector<int> idle, idle_authed;
  std::vector<std::string> failures;
  std::atomic<bool> slow_failed{false};
  auto expect_closed = [&](int fd, const std::string& what, const std::string& want_prefix = "") {
    ReadResult r = read_until_closed(fd, 3s);
    if (!r.closed) failures.push_back(what + ": not closed by the server");
    if (r.bytes.compare(0, want_prefix.size(), want_prefix) != 0) failures.push_back(what + ": unexpected reply");
    ::close(fd);
  };

  // Idle connections that never send a token, and authenticated ones that go quiet: neither may
  // block anybody; the first kind is dropped at the deadline.
  for (int i = 0; i < 20; ++i) idle.push_back(raw_connect("127.0.0.1", port));
  for (int i = 0; i < 5; ++i) {
    int fd = raw_connect("127.0.0.1", port);
    raw_send(fd, hello(token));
    if (read_n(fd, 5) != std::string(1, char(kOk)) + u32(0)) failures.push_back("authed idle: no ok");
    idle_authed.push_back(fd);
  }
  // A foreign client with the wrong token, and one with none, learn nothing and are dropped.
  {
    int fd = raw_connect("127.0.0.1", port);
    raw_send(fd, hello("fuzz-token-0123456788") + get_frame("nccl_id"));
    ReadResult r = read_until_closed(fd, 3s);
    CHECK(r.closed);
    CHECK(!r.bytes.empty());
    if (!r.bytes.empty()) CHECK(uint8_t(r.bytes[0]) == kDenied);
    CHECK(!has(r.bytes, std::string(128, '\x42')));
    ::close(fd);
    fd = raw_connect("127.0.0.1", port);
    raw_send(fd, get_frame("nccl_id"));  // a request instead of the token
    expect_closed(fd, "request before token");
    fd = raw_connect("127.0.0.1", port);
    raw_send(fd, set_frame("nccl_id", "planted"));
    expect_closed(fd, "set before token");
  }
  // Huge declared lengths, before and after the token, and bad magic/commands.
  {
    int fd = raw_connect("127.0.0.1", port);
    raw_send(fd, head(kHello, 0xFFFFFFFFu));
    expect_closed(fd, "huge token length");
    fd = raw_connect("127.0.0.1", port);
    raw_send(fd, hello(token) + head(kGet, 0xFFFFFFF0u));
    expect_closed(fd, "huge key length", std::string(1, char(kOk)) + u32(0) + char(kTooLarge));
    fd = raw_connect("127.0.0.1", port);
    raw_send(fd, hello(token) + head(kSet, 3) + "big" + u32(0xFFFFFFFFu));
    expect_closed(fd, "huge value length", std::string(1, char(kOk)) + u32(0) + char(kTooLarge));
    fd = raw_connect("127.0.0.1", port);
    raw_send(fd, hello(token) + u32(0xdeadbeef) + char(kGet) + u32(1) + "k");
    expect_closed(fd, "bad magic after token");
    fd = raw_connect("127.0.0.1", port);
    raw_send(fd, hello(token) + head(77, 1) + "k");
    expect_closed(fd, "unknown command");
  }
  // A SET of an existing key (the NCCL id) by an authenticated client is refused; the id is unchanged.
  {
    TcpStore c("127.0.0.1", port, false, opts);
    std::string msg = error_of([&] { c.set("nccl_id", std::string(128, '\x13')); });
    CHECK(has(msg, "already set"));
  }
  // Slow clients: a byte every 40 ms cannot finish a frame within the 300 ms deadline, with or
  // without the token, and what they were setting is not stored.
  slow = std::make_unique<std::thread>([&] {
    for (bool authed : {false, true}) {
      int fd = raw_connect("127.0.0.1", port);
      std::string frame = set_frame("slow-key", "slow-value");
      if (authed) {
        raw_send(fd, hello(token));
        read_n(fd, 5);
      } else {
        frame = hello(token) + frame;
      }
      bool cut = false;
      for (char ch : frame) {
        if (::send(fd, &ch, 1, MSG_NOSIGNAL) != 1) {
          cut = true;
          break;
        }
        std::this_thread::sleep_for(40ms);
      }
      ReadResult r = read_until_closed(fd, 1s);
      if (!cut && !r.closed) slow_failed = true;
      ::close(fd);
    }
  });
  // Random bytes and mutated frames, reproducible from the seed, on 120 connections at once.
  std::mt19937 rng(20261127);
  std::vector<int> fuzz;
  for (int i = 0; i < 120; ++i) {
    int fd = raw_connect("127.0.0.1", port);
    std::string msg;
    const int kind = i % 3;
    if (kind == 0) {  // noise
      msg.resize(1 + rng() % 2000);
      for (auto& ch : msg) ch = char(rng());
    } else {  // a valid conversation with a few bytes flipped, maybe cut short
      msg = (kind == 1 ? hello(token) : hello("not-the-token")) + set_frame("fz/" + std::to_string(i), "v") +
            get_frame("nccl_id") + set_frame("nccl_id", "X");
      for (int f = 0; f < 3; ++f) msg[rng() % msg.size()] = char(rng());
      if (rng() % 2) msg.resize(rng() % msg.size());
    }
    raw_send(fd, msg);
    fuzz.push_back(fd);
  }
  // Each must end: closed by the server (a bad frame, a wrong token, a deadline) or, when what
  // arrived was served whole, closed by the server right after we close our side.
  {
    auto end = Clock::now() + 1s;
    for (size_t i = 0; i < fuzz.size(); ++i) {
      int fd = fuzz[i];
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
      ReadResult r = read_until_closed(fd, std::max(left, std::chrono::milliseconds(0)));
      if (!r.closed) {
        ::shutdown(fd, SHUT_WR);
        r = read_until_closed(fd, 2s);
      }
      if (!r.closed) failures.push_back("fuzz connection " + std::to_string(i) + " left open by the server");
      ::close(fd);
    }
  }
  // A client that pipelines GETs of a large value and never reads the replies.
  server.set("big", std::string(4096, 'B'));
  int hog = raw_connect("127.0.0.1", port);
  {
    std::string many = hello(token);
    for (int i = 0; i < 2000; ++i) many += get_frame("big");
    pollfd p{hog, POLLOUT, 0};
    size_t off = 0;
    auto end = Clock::now() + 1s;
    while (off < many.size() && Clock::now() < end) {
      if (::poll(&p, 1, 20) <= 0) continue;
      ssize_t n = ::send(hog, many.data() + off, many.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) off += size_t(n);
      else if (n < 0 && errno != EAGAIN) break;
    }
  }
  slow->join();
  std::this_thread::sleep_for(opts.limits.frame_deadline * 2);
  attack_done = true;
  legit.join();

  for (const auto& f : failures) FAIL_CHECK(f);
  CHECK_FALSE(slow_failed);  // a byte-at-a-time client was not dropped at the deadline
  CHECK(legit_error == "");
  CHECK(legit_rounds >= 50);
  CHECK(legit_worst_s < 1.0);  // nobody's deadline or buffer held the rank up
  for (int fd : idle) {
    CHECK(read_until_closed(fd, 1s).closed);  // dropped: no token within the deadline
    ::close(fd);
  }
  CHECK(read_until_closed(hog, 2s).closed);  // dropped: it does not read its replies
  ::close(hog);
  TcpStoreStats s = server.stats();
  CHECK(s.clients == idle_authed.size());  // only the quiet authenticated clients remain
  CHECK(s.keys <= opts.limits.max_keys);
  CHECK(s.stored_bytes <= opts.limits.max_total_bytes);
  // Every client's buffers together stay far below one megabyte per client: the non-reader is held
  // at its unread limit plus a request chunk; a stranger gets no more than a token's worth.
  CHECK(s.peak_buffered_bytes < 2u * 1024 * 1024);
  CHECK(s.dropped >= 20 + 8 + 1);
  std::string v;
  CHECK(server.try_get("nccl_id", v));
  CHECK(v == std::string(128, '\x42'));
  CHECK_FALSE(server.try_get("slow-key", v));
  for (int fd : idle_authed) ::close(fd);
  CHECK(rss_bytes() < rss0 + (64u << 20));
}

TEST_CASE("tcp store: out of file descriptors, the server backs off instead of spinning, then serves", "[comm][store]") {
  TcpStoreOptions o;
  o.token = "fd-token";
  o.timeout = 5s;
  TcpStore server("127.0.0.1", 0, true, o);
  // Sockets made while descriptors remain; they connect once the process has none left.
  std::vector<int> socks;
  for (int i = 0; i < 4; ++i) socks.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  int max_fd = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    max_fd = std::max(max_fd, std::stoi(e.path().filename().string()));
  }
  rlimit old{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &old) == 0);
  rlimit low = old;
  low.rlim_cur = rlim_t(max_fd + 16);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  std::vector<int> fill;
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  REQUIRE(null_fd >= 0);
  fill.push_back(null_fd);
  for (int fd; (fd = ::dup(null_fd)) >= 0;) fill.push_back(fd);
  REQUIRE(errno == EMFILE);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(server.port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int fd : socks) {
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);  // lands in the backlog
    raw_send(fd, hello(o.token));
  }
  rusage r0{}, r1{};
  ::getrusage(RUSAGE_SELF, &r0);
  std::this_thread::sleep_for(600ms);
  ::getrusage(RUSAGE_SELF, &r1);
  auto cpu = [](const rusage& r) {
    return double(r.ru_utime.tv_sec + r.ru_stime.tv_sec) + double(r.ru_utime.tv_usec + r.ru_stime.tv_usec) * 1e-6;
  };
  const double busy = cpu(r1) - cpu(r0);
  for (int fd : fill) ::close(fd);
  ::setrlimit(RLIMIT_NOFILE, &old);
  // A server retrying accept() at once burns the whole 0.6 s of a core (still over 0.1 s on a machine
  // loaded ten to a core); backing off costs a few milliseconds.
  CHECK(busy < 0.05);
  for (int fd : socks) {
    CHECK(read_n(fd, 5) == std::string(1, char(kOk)) + u32(0));  // served once descriptors are back
    ::close(fd);
  }
  TcpStore c("127.0.0.1", server.port(), false, o);
  c.set("after", "ok");
  CHECK(server.get("after") == "ok");
}

TEST_CASE("tcp store: a one-node job's store is not reachable on a non-loopback address", "[comm][store]") {
  const std::string ip = non_loopback_ipv4();
  if (ip.empty()) {
    WARN("skipped: this machine has no non-loopback IPv4 address to try");  // Catch2 v2 has no SKIP
    return;
  }
  CleanEnv env;
  const int port = free_port();
  env.set("WORLD_SIZE", "2");
  env.set("LOCAL_WORLD_SIZE", "2");
  env.set("MASTER_ADDR", ip);
  env.set("MASTER_PORT", std::to_string(port));

  SECTION("one node: loopback only, ranks connect to loopback") {
    env.set("RANK", "0");
    env.set("LOCAL_RANK", "0");
    LaunchEnv e0 = detect_launch_env();
    StoreConfig c = store_config(e0);
    CHECK(c.single_node);
    CHECK(c.bind == "127.0.0.1");
    CHECK(c.connect_host == "127.0.0.1");
    auto server = open_store(e0, 5s);
    int fd = raw_connect(ip, port);
    const int err = errno;
    CHECK(fd < 0);
    CHECK(err == ECONNREFUSED);
    if (fd >= 0) ::close(fd);
    LaunchEnv e1 = e0;
    e1.rank = e1.local_rank = 1;
    auto client = open_store(e1, 5s);
    server->set("k", "v");
    CHECK(client->get("k") == "v");
  }
  SECTION("several nodes: MASTER_ADDR's interface, and only with a token") {
    env.set("RANK", "0");
    env.set("LOCAL_RANK", "0");
    env.set("LOCAL_WORLD_SIZE", "1");
    LaunchEnv e0 = detect_launch_env();
    CHECK_THROWS_AS(store_config(e0), ConfigError);
    CHECK(has(error_of([&] { store_config(e0); }), "MEGACORE_STORE_TOKEN="));
    env.set("MEGACORE_STORE_TOKEN", "multi-node-secret");
    StoreConfig c = store_config(e0);
    CHECK_FALSE(c.single_node);
    CHECK(c.bind == ip);
    auto server = open_store(e0, 5s);
    int fd = raw_connect("127.0.0.1", port);
    CHECK(fd < 0);  // not on loopback: only where MASTER_ADDR says
    if (fd >= 0) ::close(fd);
    LaunchEnv e1 = e0;
    e1.rank = 1;
    auto client = open_store(e1, 5s);
    server->set("k", "v");
    CHECK(client->get("k") == "v");
    TcpStoreOptions none;
    none.timeout = 2s;
    CHECK_THROWS_AS(TcpStore(ip, port, false, none), CommError);
  }
  SECTION("MEGACORE_STORE_BIND overrides where it listens, and a wildcard needs a token") {
    env.set("RANK", "0");
    env.set("LOCAL_RANK", "0");
    env.set("MEGACORE_STORE_BIND", "0.0.0.0");
    LaunchEnv e0 = detect_launch_env();
    CHECK(has(error_of([&] { store_config(e0); }), "MEGACORE_STORE_BIND"));
    env.set("MEGACORE_STORE_TOKEN", "t");
    CHECK(store_config(e0).bind == "0.0.0.0");
    CHECK(store_config(e0).connect_host == ip);
    env.set("MEGACORE_STORE_BIND", "");
    CHECK_THROWS_AS(store_config(e0), ConfigError);
  }
}

TEST_CASE("tcp store: the bootstrap's id exchange, ranks as threads", "[comm][store]") {
  CleanEnv env;
  env.set("MEGACORE_STORE_TOKEN", "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef");
  constexpr int kWorld = 4;
  const int port = free_port();
  auto launch = [&](int rank) {
    LaunchEnv e;
    e.launcher = Launcher::Torchrun;
    e.rank = e.local_rank = rank;
    e.world_size = e.local_world_size = kWorld;
    e.master_addr = "127.0.0.1";
    e.master_port = port;
    return e;
  };
  const std::string id(128, '\x5a');
  std::vector<std::string> got(kWorld), errors(kWorld);
  std::atomic<int> read{0};
  std::vector<std::thread> ranks;
  for (int r = kWorld - 1; r >= 0; --r) {  // clients first: they wait for rank 0's server
    ranks.emplace_back([&, r] {
      try {
        const std::string key = "megacore/nccl_unique_id/world";
        // As init_from_env does: rank 0's store holds the id before it accepts anyone.
        auto store = r == 0 ? open_store(launch(r), 10s, {{key, id}}) : open_store(launch(r), 10s);
        if (r == 0) {
          // The id's readers are done before the store closes (NCCL init waits for them in init_from_env).
          while (read.load() < kWorld - 1) std::this_thread::sleep_for(1ms);
          got[0] = id;
        } else {
          std::string v;
          // Present from the first moment, and nobody can replace it.
          if (!store->try_get(key, v)) errors[r] = "the id was not there at connect";
          if (!has(error_of([&] { store->set(key, "planted"); }), "already set")) errors[r] = "the id was replaced";
          got[r] = store->get(key);
          ++read;
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kWorld; ++r) {
    CHECK(errors[r] == "");
    CHECK(got[r] == id);
  }
}

TEST_CASE("tcp store: hostile frames under a tight address-space limit do not kill rank 0", "[comm][store]") {
  // In a child process, so the limit (and a crash, if there were one) stays there. The child is this
  // test's only thread when it forks: every earlier store has joined its server thread.
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int rc = 10;
    try {
      TcpStoreOptions o;
      o.token = "as-token";
      o.timeout = 3s;
      o.limits.frame_deadline = 500ms;
      TcpStore server("127.0.0.1", 0, true, o);
      server.set("nccl_id", std::string(128, 'i'));
      server.set("big", std::string(o.limits.max_value_bytes, 'b'));
      // What the process maps now plus 96 MiB: a 64 MiB allocation per declared length, or replies
      // queued without bound (16 clients × 1000 GETs of 64 KiB = 1 GiB), would end it.
      std::ifstream status("/proc/self/status");
      size_t vm_kb = 0;
      for (std::string line; std::getline(status, line);) {
        if (line.rfind("VmSize:", 0) == 0) vm_kb = std::stoull(line.substr(7));
      }
      rlimit lim{rlim_t(vm_kb * 1024 + (96u << 20)), RLIM_INFINITY};
      if (vm_kb == 0 || ::setrlimit(RLIMIT_AS, &lim) != 0) ::_exit(11);
      std::vector<int> fds;
      for (int i = 0; i < 16; ++i) {
        int fd = raw_connect("127.0.0.1", server.port());
        std::string frame = hello(o.token) + head(kSet, 3) + "big" + u32(64u << 20) + std::string(64, 'x');
        if (i % 2) frame = hello(o.token) + head(kGet, 64u << 20) + std::string(64, 'x');
        raw_send(fd, frame);
        fds.push_back(fd);
      }
      for (int i = 0; i < 16; ++i) {
        int fd = raw_connect("127.0.0.1", server.port());
        std::string frame = hello(o.token);
        for (int j = 0; j < 1000; ++j) frame += get_frame("big");
        raw_send(fd, frame);  // never read
        fds.push_back(fd);
      }
      TcpStore c("127.0.0.1", server.port(), false, o);
      c.set("after", "ok");
      rc = c.get("nccl_id") == std::string(128, 'i') && server.get("after") == "ok" ? 0 : 12;
      for (int fd : fds) ::close(fd);
    } catch (...) {
      rc = 13;
    }
    ::_exit(rc);
  }
  int status = 0;
  auto end = Clock::now() + 20s;
  pid_t got = 0;
  while ((got = ::waitpid(pid, &status, WNOHANG)) == 0 && Clock::now() < end) std::this_thread::sleep_for(10ms);
  if (got == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL("the child store hung");
  }
  INFO("child status " << status << (WIFSIGNALED(status) ? " (killed by a signal)" : ""));
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("tcp store: without a token, only processes of rank 0's own user are served", "[comm][store]") {
  TcpStore server("127.0.0.1", 0, true, 3s);
  server.set("nccl_id", "secret-id");
  // Another process (not a thread of this one), speaking the protocol: 0 when served, 5 when refused.
  auto status_of = [&](const std::string& become) {
    // encodings.idna is imported before a change of user, which may lose access to Python's files.
    std::string cmd = "python3 -c \"import encodings.idna, os, socket, struct, sys\n" + become +
                      "s = socket.create_connection(('127.0.0.1', " + std::to_string(server.port()) +
                      "))\ns.sendall(struct.pack('!IBI', 0x4d435332, 3, 0))\nd = s.recv(5)\n"
                      "sys.exit(d[0] if d else 99)\"";
    int rc = std::system(cmd.c_str());
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  };
  if (std::system("python3 -c pass") != 0) {
    WARN("skipped: no python3 to run a second process");
    return;
  }
  CHECK(status_of("") == kOk);
  if (::geteuid() != 0) {
    WARN("the other-user half is skipped: changing user needs root");
    return;
  }
  CHECK(status_of("os.setgid(65534); os.setuid(65534)\n") == kDenied);
  TcpStoreStats s = server.stats();
  CHECK(s.dropped >= 1);
}
