// TcpStore: one server thread multiplexes every client with non-blocking sockets and poll(), so an
// idle, slow or hostile client only ever costs its own bounded buffers. Frames:
//   hello:    u32 magic | u8 kHello | u32 token length | token          (a connection's first frame)
//   request:  u32 magic | u8 cmd | u32 key length | key | (SET: u32 value length | value)
//   response: u8 status | u32 length | value (kOk), or a one-line reason (the refusals)
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

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <new>
#include <sstream>
#include <system_error>
#include <thread>
#include <utility>

#include "megacore/core/error.hpp"

namespace megacore::comm {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
constexpr uint32_t kMagic = 0x4d435332;  // "MCS2"
constexpr uint8_t kSet = 1, kGet = 2, kHello = 3;
constexpr uint8_t kOk = 0, kMissing = 1, kExists = 2, kTooLarge = 3, kFull = 4, kDenied = 5;
constexpr size_t kHeader = 9;
constexpr size_t kMaxToken = 256;
// What a client accepts in one reply: any value the server's limits could allow, and no 4 GiB
// allocation because something else answered on the port.
constexpr uint32_t kMaxReply = 16u << 20;
// Log lines about dropped clients: enough to see what happened, not a flood a hostile client controls.
constexpr int kMaxDropLogs = 20;

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

// A key as it may appear in a log line or error: printable and short, whatever bytes it holds.
std::string printable(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < 64; ++i) out.push_back(s[i] >= 0x20 && s[i] < 0x7f ? s[i] : '?');
  if (s.size() > 64) out += "...";
  return out;
}

// Token comparison whose time does not depend on where the first difference is.
bool same_token(const std::string& a, const char* b, size_t n) {
  unsigned diff = a.size() == n ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) diff |= unsigned(uint8_t(b[i]) ^ uint8_t(i < a.size() ? a[i] : 0));
  return diff == 0;
}

std::string peer_name(const sockaddr_storage& sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&sa);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (sa.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&sa);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  }
  return fmt::format("{}:{}", host, port);
}

bool is_loopback(const sockaddr_storage& sa) {
  if (sa.ss_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(&sa)->sin_addr.s_addr) >> 24) == 127;
  }
  if (sa.ss_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(&sa)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
  }
  return false;
}

// The uid that owns the socket at `peer` connected to `self` (both ends on this machine), read from
// /proc/net/tcp{,6} as the kernel prints them; -1 when it is not found.
long socket_owner(const sockaddr_storage& peer, const sockaddr_storage& self) {
  auto endpoint = [](const sockaddr_storage& sa) {
    std::string s;
    uint16_t port = 0;
    const uint8_t* bytes = nullptr;
    int words = 0;
    if (sa.ss_family == AF_INET) {
      bytes = reinterpret_cast<const uint8_t*>(&reinterpret_cast<const sockaddr_in*>(&sa)->sin_addr);
      words = 1;
      port = ntohs(reinterpret_cast<const sockaddr_in*>(&sa)->sin_port);
    } else {
      bytes = reinterpret_cast<const sockaddr_in6*>(&sa)->sin6_addr.s6_addr;
      words = 4;
      port = ntohs(reinterpret_cast<const sockaddr_in6*>(&sa)->sin6_port);
    }
    // The kernel prints each 32-bit word of the address as the host reads it, then the port.
    for (int w = 0; w < words; ++w) {
      uint32_t v;
      std::memcpy(&v, bytes + 4 * w, 4);
      s += fmt::format("{:08X}", v);
    }
    return s + fmt::format(":{:04X}", port);
  };
  if (peer.ss_family != self.ss_family || (peer.ss_family != AF_INET && peer.ss_family != AF_INET6)) return -1;
  const std::string local = endpoint(peer), remote = endpoint(self);
  std::ifstream f(peer.ss_family == AF_INET ? "/proc/net/tcp" : "/proc/net/tcp6");
  std::string line;
  std::getline(f, line);  // the header
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string slot, l, r, state, queues, timer, retransmits;
    long uid = -1;
    if (in >> slot >> l >> r >> state >> queues >> timer >> retransmits >> uid && l == local && r == remote) return uid;
  }
  return -1;
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

double seconds(milliseconds d) { return double(d.count()) / 1000.0; }

}  // namespace

struct TcpStore::Impl {
  std::string host;
  int port = 0;
  bool server = false;
  TcpStoreOptions opt;

  // server side; `mu` guards data and stats (the server thread and rank 0's own calls share them)
  mutable std::mutex mu;
  std::map<std::string, std::string> data;
  TcpStoreStats st;
  Fd listen_fd, wake_rd, wake_wr;
  std::thread thread;
  std::atomic<bool> stop{false};
  int drop_logs = 0;  // server thread only

  // client side
  Fd conn;

  std::string where() const { return fmt::format("TCP store at {}:{}", host, port); }

  // ---- storage (both sides of rank 0 use it) --------------------------------------------------

  // Stores key once; kOk or a refusal with its reason in `why`.
  uint8_t put(const std::string& key, std::string_view value, std::string& why) {
    const TcpStoreLimits& L = opt.limits;
    if (key.size() > L.max_key_bytes || value.size() > L.max_value_bytes) {
      why = fmt::format("a key of {} bytes and value of {} bytes is over the store's limits ({} and {} bytes); the "
                        "store is for rendezvous, not data",
                        key.size(), value.size(), L.max_key_bytes, L.max_value_bytes);
      return kTooLarge;
    }
    std::lock_guard<std::mutex> lk(mu);
    if (data.count(key)) {
      why = fmt::format("key '{}' is already set; store keys are set once, so no client can replace a value that "
                        "ranks may have read (use a new key)",
                        printable(key));
      return kExists;
    }
    if (data.size() >= L.max_keys || st.stored_bytes + key.size() + value.size() > L.max_total_bytes) {
      why = fmt::format("the store is full ({} keys, {} bytes; limits {} keys, {} bytes); cannot set key '{}'",
                        data.size(), st.stored_bytes, L.max_keys, L.max_total_bytes, printable(key));
      return kFull;
    }
    data.emplace(key, value);
    st.keys = data.size();
    st.stored_bytes += key.size() + value.size();
    return kOk;
  }

  // ---- server ---------------------------------------------------------------------------------

  struct Client {
    Fd fd;
    std::string peer;
    bool authed = false;
    std::string foreign;   // why a token-less store refuses this peer ("" when it may be served)
    bool closing = false;  // a final reply is queued: close once it is sent
    std::string why;       // the reason logged when a closing client goes
    std::string in, out;
    Clock::time_point accepted, in_since, out_since;
  };

  void listen_on(int want_port) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int g = ::getaddrinfo(host.c_str(), std::to_string(want_port).c_str(), &hints, &res);
    MC_CHECK_AS(CommError, g == 0, "TCP store: cannot listen on '{}': {}; set MEGACORE_STORE_BIND to an address of "
                "this machine", host, gai_strerror(g));
    int err = 0;
    for (addrinfo* a = res; a && listen_fd.get() < 0; a = a->ai_next) {
      Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
      if (fd.get() < 0) {
        err = errno;
        continue;
      }
      int one = 1, zero = 0;
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      // "::" means every interface, IPv4 included; a specific IPv6 address means only itself.
      if (a->ai_family == AF_INET6) ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), 1024) != 0) {
        err = errno;
        continue;
      }
      listen_fd = std::move(fd);
    }
    ::freeaddrinfo(res);
    if (listen_fd.get() < 0) {
      if (err == EADDRNOTAVAIL) {
        raise<CommError>("TCP store: cannot listen on {}:{}: {}; '{}' is not an address of this machine (rank 0): set "
                         "MASTER_ADDR to rank 0's host, or MEGACORE_STORE_BIND to one of its addresses",
                         host, want_port, errno_str(err), host);
      }
      raise<CommError>("TCP store: cannot listen on {}:{}: {}; another process holds the port (set "
                       "MEGACORE_STORE_PORT or MASTER_PORT to a free port)",
                       host, want_port, errno_str(err));
    }
    sockaddr_storage got{};
    socklen_t len = sizeof(got);
    ::getsockname(listen_fd.get(), reinterpret_cast<sockaddr*>(&got), &len);
    port = ntohs(got.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&got)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&got)->sin_port);
    int p[2];
    MC_CHECK_AS(CommError, ::pipe2(p, O_CLOEXEC | O_NONBLOCK) == 0, "TCP store: pipe() failed: {}", errno_str(errno));
    wake_rd.reset(p[0]);
    wake_wr.reset(p[1]);
    thread = std::thread([this] { serve(); });
  }

  // One line per event, but a hostile client must not be able to flood rank 0's log.
  void note_drop(const std::string& peer, const std::string& why) {
    {
      std::lock_guard<std::mutex> lk(mu);
      ++st.dropped;
    }
    if (drop_logs > kMaxDropLogs) return;
    if (drop_logs++ == kMaxDropLogs) {
      fmt::print(stderr, "megacore: {} (rank 0): further dropped clients are counted, not logged\n", where());
      return;
    }
    fmt::print(stderr, "megacore: {} (rank 0): dropped client {}: {}\n", where(), peer, why);
  }

  static void reply(Client& c, uint8_t status, std::string_view body) {
    if (c.out.empty()) c.out_since = Clock::now();
    c.out.push_back(char(status));
    put_u32(c.out, uint32_t(body.size()));
    c.out.append(body);
  }
  void refuse(Client& c, uint8_t status, const std::string& why) {
    {
      std::lock_guard<std::mutex> lk(mu);
      ++st.refused;
    }
    reply(c, status, why);
  }
  // A final refusal: the rest of what this client sent cannot be trusted to be framed (a length over
  // the limits is never read past), so it is told why and closed.
  void refuse_and_close(Client& c, uint8_t status, const std::string& why) {
    refuse(c, status, why);
    c.closing = true;
    c.why = why;
    c.in.clear();
  }

  // Serves the complete frames in c.in. Returns a reason to drop the client now, or "".
  std::string handle(Client& c) {
    const TcpStoreLimits& L = opt.limits;
    while (!c.closing && c.out.size() < L.max_unread_bytes && c.in.size() >= kHeader) {
      if (get_u32(c.in.data()) != kMagic) return "does not speak megacore's store protocol";
      const uint8_t cmd = uint8_t(c.in[4]);
      const uint32_t len = get_u32(c.in.data() + 5);
      size_t need = kHeader + size_t(len);
      if (!c.authed) {
        if (cmd != kHello) return "sent a request before its token";
        if (len > kMaxToken) return fmt::format("sent a token of {} bytes (limit {})", len, kMaxToken);
        if (c.in.size() < need) return "";
        if (!same_token(opt.token, c.in.data() + kHeader, len)) {
          refuse_and_close(c, kDenied,
                           len == 0 ? "this store needs the job's token (MEGACORE_STORE_TOKEN) and none was sent"
                                    : "wrong token: MEGACORE_STORE_TOKEN differs from rank 0's");
          return "";
        }
        if (!c.foreign.empty()) {
          refuse_and_close(c, kDenied, c.foreign);
          return "";
        }
        c.authed = true;
        reply(c, kOk, {});
      } else if (cmd == kGet || cmd == kSet) {
        if (len > L.max_key_bytes) {
          refuse_and_close(c, kTooLarge, fmt::format("a key of {} bytes is over the store's limit of {} bytes", len,
                                                     L.max_key_bytes));
          return "";
        }
        if (c.in.size() < need) return "";
        std::string key = c.in.substr(kHeader, len);
        if (cmd == kGet) {
          std::lock_guard<std::mutex> lk(mu);
          auto it = data.find(key);
          if (it == data.end()) reply(c, kMissing, {});
          else reply(c, kOk, it->second);
        } else {
          if (c.in.size() < need + 4) return "";
          const uint32_t vlen = get_u32(c.in.data() + need);
          if (vlen > L.max_value_bytes) {
            refuse_and_close(c, kTooLarge, fmt::format("a value of {} bytes is over the store's limit of {} bytes",
                                                       vlen, L.max_value_bytes));
            return "";
          }
          if (c.in.size() < need + 4 + vlen) return "";
          std::string why;
          uint8_t s = put(key, std::string_view(c.in).substr(need + 4, vlen), why);
          if (s == kOk) reply(c, kOk, {});
          else refuse(c, s, why);
          need += 4 + vlen;
        }
      } else {
        return fmt::format("sent an unknown command {}", int(cmd));
      }
      c.in.erase(0, need);
      c.in_since = Clock::now();  // what is left is the start of the next frame
    }
    return "";
  }

  // Why this client must go now (a deadline passed), or "".
  std::string overdue(const Client& c, Clock::time_point now) const {
    const milliseconds d = opt.limits.frame_deadline;
    if (!c.out.empty() && now - c.out_since > d)
      return fmt::format("has not read its replies ({} bytes) for {:.1f} s", c.out.size(), seconds(d));
    if (!c.authed && now - c.accepted > d) return fmt::format("sent no token within {:.1f} s", seconds(d));
    if (!c.in.empty() && c.out.empty() && now - c.in_since > d)
      return fmt::format("left a partial frame ({} bytes) for {:.1f} s", c.in.size(), seconds(d));
    return "";
  }

  // Reads and writes what poll() reported for one client. Returns a reason to drop it now, or ""
  // (a client that closed cleanly between frames is closed here, without a reason).
  std::string service(Client& c, short ev, char* buf, size_t buf_size) {
    if (ev & (POLLERR | POLLNVAL)) return c.closing ? c.why : "connection error";
    // Over its unread-reply limit a client is not read (backpressure), so its input stays bounded too.
    if (!c.closing && c.out.size() < opt.limits.max_unread_bytes && (ev & (POLLIN | POLLHUP))) {
      // Before the token, read no more than a hello can be: nothing big is buffered for a stranger.
      size_t want = c.authed ? buf_size : kHeader + kMaxToken - std::min(c.in.size(), kHeader + kMaxToken);
      ssize_t n = want ? ::recv(c.fd.get(), buf, want, 0) : -1;
      if (n > 0) {
        if (c.in.empty()) c.in_since = Clock::now();
        c.in.append(buf, size_t(n));
      } else if (n == 0) {
        if (!c.authed) return "closed the connection before sending its token";
        if (!c.in.empty()) return "closed the connection mid-frame";
        c.fd.reset();
        return "";
      } else if (want && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return fmt::format("recv failed: {}", errno_str(errno));
      }
    }
    for (;;) {
      if (std::string why = handle(c); !why.empty()) return why;
      if (c.out.empty()) break;
      ssize_t n = ::send(c.fd.get(), c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return fmt::format("send failed: {}", errno_str(errno));
      }
      if (n <= 0) break;
      c.out.erase(0, size_t(n));
      c.out_since = Clock::now();
      // Sent everything: serve the requests that waited behind the replies (if any), then stop.
      if (!c.out.empty() || c.in.size() < kHeader || c.closing) break;
    }
    if (c.closing && c.out.empty()) return c.why;
    return "";
  }

  void accept_some(Clock::time_point now, Clock::time_point& paused_until, bool& warned,
                   std::vector<Client>& clients) {
    for (int k = 0; k < 64; ++k) {
      sockaddr_storage sa{};
      socklen_t sl = sizeof(sa);
      int fd = ::accept4(listen_fd.get(), reinterpret_cast<sockaddr*>(&sa), &sl, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        const int e = errno;
        if (e == EAGAIN || e == EWOULDBLOCK) return;
        if (e == EINTR || e == ECONNABORTED || e == EPROTO || e == EPERM) continue;
        // Out of descriptors or memory: the pending connection stays in the backlog and poll() keeps
        // reporting it, so retrying at once would spin. Wait, say so once, and try again.
        paused_until = now + milliseconds(100);
        if (!warned) {
          warned = true;
          fmt::print(stderr,
                     "megacore: {} (rank 0): cannot accept a connection: {}; retrying every 100 ms. Ranks that "
                     "cannot connect fail at their timeout: raise the open-file limit (ulimit -n) of rank 0\n",
                     where(), errno_str(e));
        }
        return;
      }
      Fd owned(fd);
      std::string peer = peer_name(sa);
      if (clients.size() >= opt.limits.max_clients) {
        note_drop(peer, fmt::format("the store has its limit of {} connections", opt.limits.max_clients));
        continue;
      }
      Client c;
      c.fd = std::move(owned);
      c.peer = std::move(peer);
      c.accepted = c.in_since = c.out_since = now;
      // Without a token, the store's only guard against other users of this machine is who owns the
      // connecting socket: serve processes of rank 0's own user only. (A peer on another machine cannot
      // be checked; comm::store_config never listens beyond loopback without a token.)
      if (opt.token.empty() && is_loopback(sa)) {
        sockaddr_storage self{};
        socklen_t len = sizeof(self);
        ::getsockname(c.fd.get(), reinterpret_cast<sockaddr*>(&self), &len);
        const long owner = socket_owner(sa, self), me = long(::geteuid());
        if (owner != me) {
          c.foreign = owner < 0 ? fmt::format("without a token this store serves only processes of its own user (uid "
                                              "{}), and the owner of this connection was not found; set "
                                              "MEGACORE_STORE_TOKEN on every rank",
                                              me)
                                : fmt::format("without a token this store serves only processes of its own user (uid "
                                              "{}), not uid {}; set MEGACORE_STORE_TOKEN on every rank",
                                              me, owner);
        }
      }
      clients.push_back(std::move(c));
    }
  }

  void serve() {
    std::vector<Client> clients;
    std::vector<pollfd> pfds;
    std::vector<char> buf;
    Clock::time_point accept_paused_until{};
    bool warned_accept = false, warned_loop = false;
    while (!stop.load()) {
      // Nothing may escape this thread (std::terminate would take rank 0 down): a failure serving one
      // client drops that client; anything else is logged once and the loop goes on after a pause.
      try {
        if (buf.empty()) buf.resize(64 * 1024);
        const auto now = Clock::now();
        const bool accepting = now >= accept_paused_until;
        pfds.clear();
        pfds.push_back({accepting ? listen_fd.get() : -1, POLLIN, 0});
        pfds.push_back({wake_rd.get(), POLLIN, 0});
        auto next = now + milliseconds(1000);
        if (!accepting) next = std::min(next, accept_paused_until);
        for (auto& c : clients) {
          short want = 0;
          if (!c.closing && c.out.size() < opt.limits.max_unread_bytes) want |= POLLIN;
          if (!c.out.empty()) want |= POLLOUT;
          pfds.push_back({c.fd.get(), want, 0});
          const auto d = opt.limits.frame_deadline;
          if (!c.authed) next = std::min(next, c.accepted + d);
          if (!c.in.empty()) next = std::min(next, c.in_since + d);
          if (!c.out.empty()) next = std::min(next, c.out_since + d);
        }
        const auto wait = std::chrono::duration_cast<milliseconds>(next - now).count() + 1;
        if (::poll(pfds.data(), nfds_t(pfds.size()), int(std::clamp<long long>(wait, 1, 1000))) < 0) {
          if (errno != EINTR) throw std::system_error(errno, std::generic_category(), "poll");
          continue;
        }
        if (pfds[1].revents & POLLIN) {
          char drain[64];
          while (::read(wake_rd.get(), drain, sizeof(drain)) > 0) {
          }
        }
        const auto t = Clock::now();
        for (size_t i = 0; i < clients.size(); ++i) {
          Client& c = clients[i];
          std::string why;
          try {
            // Only clients with news or pending work are serviced: with thousands of ranks polling, one
            // request must not cost a pass over every idle connection's buffers.
            const short ev = pfds[i + 2].revents;
            if (ev || !c.out.empty() || c.in.size() >= kHeader) why = service(c, ev, buf.data(), buf.size());
            if (why.empty() && c.fd.get() >= 0 && (!c.authed || !c.in.empty() || !c.out.empty())) why = overdue(c, t);
          } catch (const std::bad_alloc&) {
            why = "rank 0 ran out of memory serving it";
          } catch (const std::exception& e) {
            why = fmt::format("serving it failed: {}", e.what());
          }
          if (!why.empty()) {
            note_drop(c.peer, why);
            c.fd.reset();
          }
        }
        std::erase_if(clients, [](const Client& c) { return c.fd.get() < 0; });
        // Accept after serving, so the new ones are polled before their deadlines count.
        if (accepting && (pfds[0].revents & POLLIN)) accept_some(t, accept_paused_until, warned_accept, clients);
        size_t buffered = 0;
        for (const auto& c : clients) buffered += c.in.size() + c.out.size();
        std::lock_guard<std::mutex> lk(mu);
        st.clients = clients.size();
        st.buffered_bytes = buffered;
        st.peak_clients = std::max(st.peak_clients, st.clients);
        st.peak_buffered_bytes = std::max(st.peak_buffered_bytes, buffered);
      } catch (const std::exception& e) {
        if (!warned_loop) {
          warned_loop = true;
          fmt::print(stderr, "megacore: {} (rank 0): server loop error: {}; continuing\n", where(), e.what());
        }
        std::this_thread::sleep_for(milliseconds(50));
      } catch (...) {
        std::this_thread::sleep_for(milliseconds(50));
      }
    }
  }

  // ---- client ---------------------------------------------------------------------------------

  // Opens a connection and presents the token. Returns "" on success, else why this try failed (the
  // caller retries); a refused token is a CommError at once, since retrying cannot fix it.
  std::string try_connect(const std::string& h, int p) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    int g = ::getaddrinfo(h.c_str(), std::to_string(p).c_str(), &hints, &res);
    if (g != 0) return fmt::format("cannot resolve '{}': {}", h, gai_strerror(g));
    std::string last = "no address";
    for (addrinfo* a = res; a && conn.get() < 0; a = a->ai_next) {
      Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (fd.get() < 0) {
        last = fmt::format("socket() failed: {}", errno_str(errno));  // e.g. this process is out of descriptors
        continue;
      }
      if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0) conn = std::move(fd);
      else last = errno_str(errno);
    }
    ::freeaddrinfo(res);
    if (conn.get() < 0) return last;
    int one = 1;
    ::setsockopt(conn.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    // A server that accepts but never answers (some other service on the port) must not hang us.
    timeval tv{};
    tv.tv_sec = long(opt.timeout.count() / 1000);
    tv.tv_usec = long((opt.timeout.count() % 1000) * 1000);
    ::setsockopt(conn.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(conn.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    std::string hello;
    put_u32(hello, kMagic);
    hello.push_back(char(kHello));
    put_u32(hello, uint32_t(opt.token.size()));
    hello += opt.token;
    std::string body;
    uint8_t status = 0;
    try {
      send_all(hello);
      status = response(body);
    } catch (const CommError& e) {
      // The server may have been busy (at its connection limit, or out of descriptors) and closed us.
      conn.reset();
      return e.what();
    }
    if (status == kDenied) {
      conn.reset();
      raise<CommError>("{}: the store refused this rank: {}. Start every rank of a job from one launcher (python -m "
                       "megacore.launch sets the token), or export the same MEGACORE_STORE_TOKEN on every node",
                       where(), body);
    }
    if (status != kOk) {
      conn.reset();
      raise<CommError>("{}: the server does not speak megacore's store protocol; is another service (e.g. "
                       "torchrun's own store) on this port? set MEGACORE_STORE_PORT",
                       where());
    }
    return "";
  }

  void connect_to(const std::string& h, int p) {
    auto start = Clock::now();
    int attempts = 0;
    auto backoff = milliseconds(20);
    for (;;) {
      ++attempts;
      std::string last = try_connect(h, p);
      if (last.empty()) return;
      if (Clock::now() - start > opt.timeout) {
        raise<CommError>(
            "{}: could not connect after {} attempts in {:.1f} s (last error: {}); is rank 0 running, and do "
            "MASTER_ADDR/MASTER_PORT point at it?",
            where(), attempts, std::chrono::duration<double>(Clock::now() - start).count(), last);
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, milliseconds(1000));
    }
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
                         where(), seconds(opt.timeout));
      }
      MC_CHECK_AS(CommError, r > 0, "{}: connection lost: {} (did rank 0 exit?)", where(),
                  r == 0 ? "closed by the server" : errno_str(errno));
      p += r;
      n -= size_t(r);
    }
  }

  // Reads one response; returns its status and fills body.
  uint8_t response(std::string& body) {
    char head[5];
    recv_all(head, 5);
    uint8_t status = uint8_t(head[0]);
    uint32_t len = get_u32(head + 1);
    MC_CHECK_AS(CommError, status <= kDenied && len <= kMaxReply,
                "{}: the server does not speak megacore's store protocol; is another service (e.g. torchrun's own "
                "store) on this port? set MEGACORE_STORE_PORT",
                where());
    body.resize(len);
    if (len) recv_all(body.data(), len);
    return status;
  }

  // One request/response; returns kOk or kMissing and fills out, or throws the server's refusal.
  uint8_t request(uint8_t cmd, const std::string& key, const std::string* value, std::string& out) {
    MC_CHECK_AS(CommError, conn.get() >= 0, "{}: this client's connection was closed after an earlier refusal",
                where());
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
    uint8_t status = response(out);
    if (status == kOk || status == kMissing) return status;
    // The server closes the connection after a frame it could not read to its end.
    if (status == kTooLarge || status == kDenied) conn.reset();
    raise<CommError>("{}: {} '{}' refused: {}", where(), cmd == kSet ? "set" : "get", printable(key), out);
  }
};

TcpStore::TcpStore(std::string host, int port, bool is_server, TcpStoreOptions options)
    : impl_(std::make_unique<Impl>()) {
  MC_CHECK(port >= 0 && port <= 65535, "TCP store: port {} is out of range [0, 65535]", port);
  MC_CHECK(is_server || port > 0, "TCP store: a client needs the server's port, got 0");
  MC_CHECK(options.timeout.count() > 0, "TCP store: timeout must be positive");
  MC_CHECK(options.token.size() <= kMaxToken, "TCP store: the token has {} bytes, more than {}", options.token.size(),
           kMaxToken);
  MC_CHECK(options.limits.frame_deadline.count() > 0, "TCP store: frame_deadline must be positive");
  MC_CHECK(options.limits.max_unread_bytes > 0 && options.limits.max_clients > 0,
           "TCP store: max_unread_bytes and max_clients must be positive");
  impl_->host = std::move(host);
  impl_->port = port;
  impl_->server = is_server;
  impl_->opt = std::move(options);
  if (is_server) {
    for (const auto& [k, v] : impl_->opt.preset) set(k, v);
    impl_->opt.preset.clear();
    impl_->listen_on(port);
  }
  else impl_->connect_to(impl_->host, port);
}

TcpStore::TcpStore(std::string host, int port, bool is_server, std::chrono::milliseconds timeout)
    : TcpStore(std::move(host), port, is_server, TcpStoreOptions{.token = {}, .timeout = timeout, .limits = {}, .preset = {}}) {}

TcpStore::~TcpStore() {
  if (impl_->server && impl_->thread.joinable()) {
    impl_->stop = true;
    char c = 0;
    (void)!::write(impl_->wake_wr.get(), &c, 1);
    impl_->thread.join();
  }
}

void TcpStore::set(const std::string& key, const std::string& value) {
  const TcpStoreLimits& L = impl_->opt.limits;
  MC_CHECK(key.size() <= L.max_key_bytes && value.size() <= L.max_value_bytes,
           "TCP store: a key of {} bytes and value of {} bytes is over the limits ({} and {} bytes); the store is "
           "for rendezvous, not data",
           key.size(), value.size(), L.max_key_bytes, L.max_value_bytes);
  if (impl_->server) {
    std::string why;
    if (impl_->put(key, value, why) != kOk) raise<CommError>("{}: set '{}' refused: {}", impl_->where(), printable(key), why);
    return;
  }
  std::string ignored;
  impl_->request(kSet, key, &value, ignored);
}

bool TcpStore::try_get(const std::string& key, std::string& value) {
  MC_CHECK(key.size() <= impl_->opt.limits.max_key_bytes, "TCP store: a key of {} bytes is over the limit of {} bytes",
           key.size(), impl_->opt.limits.max_key_bytes);
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
  if (timeout.count() <= 0) timeout = impl_->opt.timeout;
  auto start = Clock::now();
  auto backoff = std::chrono::milliseconds(1);
  std::string v;
  for (const auto& k : keys) {
    while (!try_get(k, v)) {
      double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      if (elapsed * 1000.0 > double(timeout.count())) {
        raise<CommError>("{}: key '{}' was not set within {:.1f} s; the rank that should set it is late, failed or "
                         "was started with another MASTER_ADDR/MASTER_PORT",
                         impl_->where(), printable(k), elapsed);
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
    }
  }
}

int TcpStore::port() const { return impl_->port; }
bool TcpStore::is_server() const { return impl_->server; }

TcpStoreStats TcpStore::stats() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->st;
}

}  // namespace megacore::comm
