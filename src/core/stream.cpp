#include "megacore/core/stream.hpp"

#include <map>

#include "core/cuda_backend.hpp"
#include "megacore/core/error.hpp"
#include "megacore/core/host_sync.hpp"

namespace megacore {

Stream Stream::default_stream(Device d) {
  Stream s;
  s.device_ = d;
  return s;
}

Stream Stream::create(Device d, bool non_blocking, int priority) {
  Stream s;
  s.device_ = d;
  if (d.is_cuda()) {
    check_device(d);
    s.handle_ = cuda_impl::stream_create(d.index, non_blocking, priority);
    s.owner_ = std::shared_ptr<void>(s.handle_, [](void* h) { cuda_impl::stream_destroy(h); });
  }
  return s;
}

Stream Stream::from_native(Device d, void* cuda_stream) {
  Stream s;
  s.device_ = d;
  s.handle_ = cuda_stream;
  return s;
}

void Stream::synchronize() const {
  note_host_sync(HostSyncReason::current("stream_synchronize"));
  if (device_.is_cuda()) cuda_impl::stream_synchronize(handle_, device_.index);
}
bool Stream::query() const { return device_.is_cpu() || cuda_impl::stream_query(handle_, device_.index); }
void Stream::wait(const Event& e) const {
  if (device_.is_cpu() || !e.native()) return;
  cuda_impl::stream_wait_event(handle_, e.native(), device_.index);
}
void Stream::wait(const Stream& other) const {
  if (device_.is_cpu() || other.device().is_cpu() || other == *this) return;
  // cudaStreamWaitEvent waits for the event's record at the time of the call, so one event per thread and
  // device can be recorded again right away: no event is created and destroyed per hand-off.
  thread_local std::map<int, Event> handoff;
  Event& e = handoff[other.device().index];
  e.record(other);
  wait(e);
}

void Event::record(const Stream& s) {
  if (s.device().is_cpu()) return;
  if (!handle_ || device_ != s.device()) {
    device_ = s.device();
    void* h = cuda_impl::event_create(device_.index, timing_);
    handle_ = std::shared_ptr<void>(h, [](void* p) { cuda_impl::event_destroy(p); });
  }
  cuda_impl::event_record(handle_.get(), s.native(), device_.index);
}
void Event::synchronize() const {
  note_host_sync(HostSyncReason::current("event_synchronize"));
  if (handle_) cuda_impl::event_synchronize(handle_.get());
}
bool Event::query() const { return !handle_ || cuda_impl::event_query(handle_.get()); }
float Event::elapsed_ms(const Event& end) const {
  MC_CHECK(timing_ && end.timing_, "elapsed_ms needs two events created with enable_timing=true");
  MC_CHECK(handle_ && end.handle_, "elapsed_ms needs two recorded events");
  return cuda_impl::event_elapsed_ms(handle_.get(), end.handle_.get());
}

void synchronize_device(Device d) {
  note_host_sync(HostSyncReason::current("device_synchronize"));
  if (d.is_cuda()) {
    check_device(d);
    cuda_impl::device_synchronize(d.index);
  }
}

}  // namespace megacore
