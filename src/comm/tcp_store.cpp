// TcpStore: one server thread multiplexes every client with poll(); requests are tiny frames
//   request:  u32 magic | u8 cmd | u32 key length | key | (SET: u32 value length | value)
//   response: u8 status | u32 value length | value
// A waiting get() is a client-side retry loop, so the server never blocks on one client.
#include "megacore/comm/tcp_store.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "megacore/core/error.hpp"

namespace megacore::comm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kMagic = 0x4d435331;  // "MCS1"
constexpr uint8_t kSet = 1, kGet = 2;
constexpr uint8_t kOk = 0, kMissing = 1;
constexpr uint32_t kMaxLen = 64u << 20;  // a rendezvous value is bytes, not gigabytes

std::string errno_str(int e) { return std::strerror(e); }

void put_u32(std::string& s, uint32_t v) {
  uint32_t n = htonl(v);
  s.append(reinterpret_cast<const char*>(&n), 4);
}
uint32_t get_u32(const char* p) {
  uint32_t n;
  std::memcpy(&n, p, 4);
  return ntohl(n);
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    reset(std::exchange(o.fd_, -1));
    return *this;
  }
  ~Fd() { reset(); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

struct TcpStore::Impl {
  std::string host;
  int port = 0;
  bool server = false;
  std::chrono::milliseconds timeout;

  // server side
  std::mutex mu;
  std::map<std::string, std::string> data;
  Fd listen_fd, wake_rd, wake_wr;
  std::thread thread;
  std::atomic<bool> stop{false};

  // client side
  Fd conn;

  std::string where() const { return fmt::format("TCP store at {}:{}", host, port); }

  // ---- server ---------------------------------------------------------------------------------

  void listen_on(int want_port) {
    // Dual-stack IPv6 first so IPv4 and IPv6 clients both reach it; plain IPv4 where IPv6 is off.
    int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    bool v6 = fd >= 0;
    if (!v6) fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    MC_CHECK_AS(CommError, fd >= 0, "TCP store: socket() failed: {}", errno_str(errno));
    listen_fd.reset(fd);
    int one = 1, zero = 0;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int rc;
    if (v6) {
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(uint16_t(want_port));
      rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(uint16_t(want_port));
      rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    }
    MC_CHECK_AS(CommError, rc == 0,
                "TCP store: cannot listen on port {}: {}; another process holds it (set MEGACORE_STORE_PORT or "
                "MASTER_PORT to a free port)",
                want_port, errno_str(errno));
    MC_CHECK_AS(CommError, ::listen(fd, 1024) == 0, "TCP store: listen() failed: {}", errno_str(errno));
    sockaddr_storage got{};
    socklen_t len = sizeof(got);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&got), &len);
    port = ntohs(got.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&got)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&got)->sin_port);
    int p[2];
    MC_CHECK_AS(CommError, ::pipe2(p, O_CLOEXEC) == 0, "TCP store: pipe() failed: {}", errno_str(errno));
    wake_rd.reset(p[0]);
    wake_wr.reset(p[1]);
    thread = std::thread([this] { serve(); });
  }

  // Parses complete requests from `in`; appends responses to `out`. False on a protocol violation.
  bool handle(std::string& in, std::string& out) {
    for (;;) {
      if (in.size() < 9) return true;
      if (get_u32(in.data()) != kMagic) return false;
      uint8_t cmd = uint8_t(in[4]);
      uint32_t klen = get_u32(in.data() + 5);
      if (klen > kMaxLen || (cmd != kSet && cmd != kGet)) return false;
      size_t need = 9 + size_t(klen);
      if (in.size() < need) return true;
      std::string key = in.substr(9, klen);
      std::string reply;
      if (cmd == kSet) {
        if (in.size() < need + 4) return true;
        uint32_t vlen = get_u32(in.data() + need);
        if (vlen > kMaxLen) return false;
        if (in.size() < need + 4 + vlen) return true;
        {
          std::lock_guard<std::mutex> lk(mu);
          data[key] = in.substr(need + 4, vlen);
        }
        need += 4 + vlen;
        reply.push_back(char(kOk));
        put_u32(reply, 0);
      } else {
        std::lock_guard<std::mutex> lk(mu);
        auto it = data.find(key);
        reply.push_back(char(it == data.end() ? kMissing : kOk));
        put_u32(reply, it == data.end() ? 0 : uint32_t(it->second.size()));
        if (it != data.end()) reply += it->second;
      }
      out += reply;
      in.erase(0, need);
    }
  }

  void serve() {
    struct Client {
      Fd fd;
      std::string in, out;
    };
    std::vector<Client> clients;
    std::vector<pollfd> pfds;
    while (!stop.load()) {
      pfds.clear();
      pfds.push_back({listen_fd.get(), POLLIN, 0});
      pfds.push_back({wake_rd.get(), POLLIN, 0});
      for (auto& c : clients) pfds.push_back({c.fd.get(), short(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
      if (::poll(pfds.data(), nfds_t(pfds.size()), 1000) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (pfds[0].revents & POLLIN) {
        int fd = ::accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd >= 0) clients.push_back({Fd(fd), {}, {}});
      }
      for (size_t i = 0; i + 2 < pfds.size(); ++i) {
        Client& c = clients[i];
        short ev = pfds[i + 2].revents;
        bool drop = ev & (POLLERR | POLLNVAL);
        if (!drop && (ev & (POLLIN | POLLHUP))) {
          char buf[65536];
          ssize_t n = ::recv(c.fd.get(), buf, sizeof(buf), 0);
          if (n > 0) {
            c.in.append(buf, size_t(n));
            drop = !handle(c.in, c.out);
          } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
            drop = true;
          }
        }
        if (!drop && !c.out.empty()) {
          ssize_t n = ::send(c.fd.get(), c.out.data(), c.out.size(), MSG_NOSIGNAL);
          if (n > 0) c.out.erase(0, size_t(n));
          else if (n < 0 && errno != EAGAIN && errno != EINTR) drop = true;
        }
        if (drop) c.fd.reset(-1);
      }
      std::erase_if(clients, [](const Client& c) { return c.fd.get() < 0; });
    }
  }

  // ---- client ---------------------------------------------------------------------------------

  void connect_to(const std::string& h, int p) {
    auto start = Clock::now();
    std::string last = "no address";
    int attempts = 0;
    auto backoff = std::chrono::milliseconds(20);
    for (;;) {
      ++attempts;
      addrinfo hints{}, *res = nullptr;
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      int g = ::getaddrinfo(h.c_str(), std::to_string(p).c_str(), &hints, &res);
      if (g != 0) {
        last = fmt::format("cannot resolve '{}': {}", h, gai_strerror(g));
      } else {
        for (addrinfo* a = res; a; a = a->ai_next) {
          Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
          if (fd.get() < 0) continue;
          if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0) {
            conn = std::move(fd);
            break;
          }
          last = errno_str(errno);
        }
        ::freeaddrinfo(res);
      }
      if (conn.get() >= 0) break;
      if (Clock::now() - start > timeout) {
        raise<CommError>(
            "{}: could not connect after {} attempts in {:.1f} s (last error: {}); is rank 0 running, and do "
            "MASTER_ADDR/MASTER_PORT point at it?",
            where(), attempts, std::chrono::duration<double>(Clock::now() - start).count(), last);
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
    int one = 1;
    ::setsockopt(conn.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    // A server that accepts but never answers (some other service on the port) must not hang us.
    timeval tv{};
    tv.tv_sec = long(timeout.count() / 1000);
    tv.tv_usec = long((timeout.count() % 1000) * 1000);
    ::setsockopt(conn.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(conn.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  }

  void send_all(const std::string& s) {
    size_t off = 0;
    while (off < s.size()) {
      ssize_t n = ::send(conn.get(), s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      MC_CHECK_AS(CommError, n > 0, "{}: send failed: {} (did rank 0 exit?)", where(), errno_str(errno));
      off += size_t(n);
    }
  }

  void recv_all(char* p, size_t n) {
    while (n > 0) {
      ssize_t r = ::recv(conn.get(), p, n, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        raise<CommError>("{}: no answer within {:.1f} s; is another service (e.g. torchrun's own store) on this "
                         "port? set MEGACORE_STORE_PORT",
                         where(), timeout.count() / 1000.0);
      }
      MC_CHECK_AS(CommError, r > 0, "{}: connection lost: {} (did rank 0 exit?)", where(),
                  r == 0 ? "closed by the server" : errno_str(errno));
      p += r;
      n -= size_t(r);
    }
  }

  // One request/response; returns the status byte and fills value.
  uint8_t request(uint8_t cmd, const std::string& key, const std::string* value, std::string& out) {
    std::string req;
    put_u32(req, kMagic);
    req.push_back(char(cmd));
    put_u32(req, uint32_t(key.size()));
    req += key;
    if (value) {
      put_u32(req, uint32_t(value->size()));
      req += *value;
    }
    send_all(req);
    char head[5];
    recv_all(head, 5);
    uint8_t status = uint8_t(head[0]);
    uint32_t len = get_u32(head + 1);
    MC_CHECK_AS(CommError, (status == kOk || status == kMissing) && len <= kMaxLen,
                "{}: the server does not speak megacore's store protocol; is another service (e.g. torchrun's own "
                "store) on this port? set MEGACORE_STORE_PORT",
                where());
    out.resize(len);
    if (len) recv_all(out.data(), len);
    return status;
  }
};

TcpStore::TcpStore(std::string host, int port, bool is_server, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>()) {
  MC_CHECK(port >= 0 && port <= 65535, "TCP store: port {} is out of range [0, 65535]", port);
  MC_CHECK(is_server || port > 0, "TCP store: a client needs the server's port, got 0");
  MC_CHECK(timeout.count() > 0, "TCP store: timeout must be positive");
  impl_->host = std::move(host);
  impl_->port = port;
  impl_->server = is_server;
  impl_->timeout = timeout;
  if (is_server) impl_->listen_on(port);
  else impl_->connect_to(impl_->host, port);
}

TcpStore::~TcpStore() {
  if (impl_->server && impl_->thread.joinable()) {
    impl_->stop = true;
    char c = 0;
    (void)!::write(impl_->wake_wr.get(), &c, 1);
    impl_->thread.join();
  }
}

void TcpStore::set(const std::string& key, const std::string& value) {
  MC_CHECK(key.size() <= kMaxLen && value.size() <= kMaxLen, "TCP store: key or value longer than {} bytes", kMaxLen);
  if (impl_->server) {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->data[key] = value;
    return;
  }
  std::string ignored;
  impl_->request(kSet, key, &value, ignored);
}

bool TcpStore::try_get(const std::string& key, std::string& value) {
  if (impl_->server) {
    std::lock_guard<std::mutex> lk(impl_->mu);
    auto it = impl_->data.find(key);
    if (it == impl_->data.end()) return false;
    value = it->second;
    return true;
  }
  return impl_->request(kGet, key, nullptr, value) == kOk;
}

std::string TcpStore::get(const std::string& key) {
  wait({key});
  std::string v;
  try_get(key, v);
  return v;
}

void TcpStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) timeout = impl_->timeout;
  auto start = Clock::now();
  auto backoff = std::chrono::milliseconds(1);
  std::string v;
  for (const auto& k : keys) {
    while (!try_get(k, v)) {
      double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      if (elapsed * 1000.0 > double(timeout.count())) {
        raise<CommError>("{}: key '{}' was not set within {:.1f} s; the rank that should set it is late, failed or "
                         "was started with another MASTER_ADDR/MASTER_PORT",
                         impl_->where(), k, elapsed);
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
    }
  }
}

int TcpStore::port() const { return impl_->port; }
bool TcpStore::is_server() const { return impl_->server; }

}  // namespace megacore::comm
