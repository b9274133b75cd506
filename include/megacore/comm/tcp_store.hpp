// A small TCP key-value store for rendezvous when MPI is absent (the NCCL unique id travels through
// it). Rank 0 runs the server inside its TcpStore; every other rank connects as a client.
// Values are opaque bytes. Every blocking call ends within the store's timeout with a CommError that
// says what was awaited and where.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace megacore::comm {

class TcpStore {
 public:
  /// Server (is_server): listens on `port` on all interfaces (port 0 picks a free one, see port()).
  /// Client: connects to host:port, retrying until `timeout` (the server may start later).
  TcpStore(std::string host, int port, bool is_server, std::chrono::milliseconds timeout = std::chrono::minutes(5));
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  /// Stores (or replaces) a value.
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

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megacore::comm
