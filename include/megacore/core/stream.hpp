// Streams and events. On the CPU both are no-ops: host work is synchronous.
#pragma once

#include <memory>

#include "megacore/core/device.hpp"

namespace megacore {

class Event;

/// A CUDA stream (or the host "stream"). Copies share the underlying stream; the last copy of a
/// stream made with create() destroys it. A default-constructed Stream is the host stream; use
/// Stream::default_stream(dev) for a device's legacy default stream.
class Stream {
 public:
  Stream() = default;
  /// The legacy default stream of a device (synchronises with other blocking streams).
  static Stream default_stream(Device d);
  /// A new stream; non_blocking streams do not synchronise with the legacy default stream.
  static Stream create(Device d, bool non_blocking = true, int priority = 0);
  /// Wraps an existing cudaStream_t owned by someone else (a framework's stream).
  static Stream from_native(Device d, void* cuda_stream);

  Device device() const { return device_; }
  /// The cudaStream_t as an opaque pointer (nullptr is the legacy default stream).
  void* native() const { return handle_; }
  bool is_default() const { return handle_ == nullptr; }
  /// Blocks the host until all work queued so far has finished.
  void synchronize() const;
  /// True when all work queued so far has finished.
  bool query() const;
  /// Makes later work on this stream wait for the event.
  void wait(const Event& e) const;
  /// Makes later work on this stream wait for everything queued so far on another stream.
  void wait(const Stream& other) const;
  bool operator==(const Stream& o) const { return device_ == o.device_ && handle_ == o.handle_; }

 private:
  Device device_ = Device::cpu();
  void* handle_ = nullptr;
  std::shared_ptr<void> owner_;  // destroys the stream when it was created by us
};

/// A CUDA event. Created lazily on first record.
class Event {
 public:
  explicit Event(bool enable_timing = false) : timing_(enable_timing) {}
  /// Records the event on the stream.
  void record(const Stream& s);
  void synchronize() const;
  bool query() const;
  /// Milliseconds between this (earlier) event and end; both need enable_timing.
  float elapsed_ms(const Event& end) const;
  void* native() const { return handle_.get(); }
  Device device() const { return device_; }

 private:
  bool timing_;
  Device device_ = Device::cpu();
  std::shared_ptr<void> handle_;
};

/// Blocks until all work on the device has finished.
void synchronize_device(Device d);

}  // namespace megacore
