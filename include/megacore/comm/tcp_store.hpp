// A small TCP key-value store for rendezvous when MPI is absent (the NCCL unique id travels through
// it). Rank 0 runs the server inside its TcpStore; every other rank connects as a client.
// Values are opaque bytes, each key is set once. Every blocking call ends within the store's timeout
// with a CommError that says what was awaited and where.
//
// The server is a door into rank 0, so it is built to be safe to leave open: it listens only on the
// address it is given (loopback for a one-node job, see comm::store_config), serves nothing to a
// connection until its first frame carries the job's token, holds every client to a deadline per
// frame and to bounded buffers, bounds what it stores, and never lets an error escape its thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace megacore::comm {

/// The server's bounds. The defaults leave ample margin for a rendezvous (the NCCL id is 128 bytes;
/// one small key per rank of a 16k-rank job fits) while keeping rank 0's memory for the store within
/// tens of MiB whatever clients send.
struct TcpStoreLimits {
  size_t max_key_bytes = 1024;
  size_t max_value_bytes = 64 * 1024;
  size_t max_keys = 16384;
  size_t max_total_bytes = 16u << 20;  ///< keys + values stored
  size_t max_clients = 20000;          ///< connections at once, with or without a token yet
  /// Replies queued for one client that it has not read; beyond this the server stops reading its
  /// requests until it reads (and drops it after frame_deadline without progress).
  size_t max_unread_bytes = 256 * 1024;
  /// A frame (the token, or a request) must arrive whole within this long of its first byte, and a
  /// queued reply must make progress within it; a connection must send its token within it.
  std::chrono::milliseconds frame_deadline = std::chrono::seconds(10);
};

/// How a TcpStore serves (server) or connects (client).
struct TcpStoreOptions {
  /// The job's shared secret. The server serves a connection only if its first frame carries exactly
  /// this token; with an empty one it admits only clients without a token whose loopback socket is
  /// owned by the server's own user. A client sends it on connect.
  std::string token;
  /// Every blocking call (connect, get, wait) ends within this with a CommError.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  TcpStoreLimits limits;
  /// Server: keys stored before it accepts its first connection, so no client can race to set them
  /// first (rank 0 presets the NCCL id this way).
  std::vector<std::pair<std::string, std::string>> preset;
};

/// What the server holds now, for logs and tests (server only; zeros on a client).
struct TcpStoreStats {
  size_t keys = 0;
  size_t stored_bytes = 0;    ///< keys + values
  size_t clients = 0;         ///< open connections
  size_t buffered_bytes = 0;  ///< request and reply bytes held for all clients
  size_t peak_clients = 0;
  size_t peak_buffered_bytes = 0;
  size_t dropped = 0;  ///< connections closed for breaking a rule (wrong token, bad frame, deadline, cap)
  size_t refused = 0;  ///< requests answered with an error (key already set, too large, store full)
};

class TcpStore {
 public:
  /// Server (is_server): listens on `host` ("127.0.0.1", "::1", an address or name of this machine;
  /// "0.0.0.0" or "::" for every interface) at `port` (port 0 picks a free one, see port()).
  /// Client: connects to host:port, retrying until options.timeout (the server may start later), and
  /// presents options.token; a wrong token is a CommError.
  TcpStore(std::string host, int port, bool is_server, TcpStoreOptions options = {});
  /// A server or client without a token.
  TcpStore(std::string host, int port, bool is_server, std::chrono::milliseconds timeout);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  /// Stores a value. Keys are set once: setting a key that exists is a CommError (so nobody can
  /// replace a value that ranks may already have read), as is a store that is full. A key or value
  /// over the limits is a ValueError.
  void set(const std::string& key, const std::string& value);
  /// The value of key, waiting for it to be set up to the store's timeout.
  std::string get(const std::string& key);
  /// The value of key if it is set now; no waiting.
  bool try_get(const std::string& key, std::string& value);
  /// Waits until every key is set, up to `timeout` (the store's timeout when zero).
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

  /// The port the server listens on (or the client connected to).
  int port() const;
  bool is_server() const;
  /// The server's counters (see TcpStoreStats).
  TcpStoreStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megacore::comm
