// GPU plumbing for the worker and the tests, in host-only C++ (no CUDA
// headers): whether a device exists, device arrays, and a context holding a
// stream and the small buffers the codec functions need.
#ifndef MORSE_KERNELS_DEVICE_H_
#define MORSE_KERNELS_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace morse::kernels {

// "NVIDIA H100 80GB HBM3 (sm_90, 79 GiB)" for the calling thread's current
// device (0 unless set), or FAILED_PRECONDITION saying why there is none (no
// driver, no device).
absl::StatusOr<std::string> DeviceDescription();

// The calling thread's current device, and setting it (a model created on
// one device runs its work on threads that must select that device too).
absl::StatusOr<int> CurrentDevice();
absl::Status SetDevice(int device);

// Frees what cudaMalloc / cudaMallocHost returned.
struct CudaFree {
  void operator()(void* p) const;
};
struct CudaFreeHost {
  void operator()(void* p) const;
};

// Synchronous copies between host memory and any device array (one of ours
// or a caller's, such as a PyTorch tensor's), complete when they return,
// whatever stream works on the array next.
absl::Status CopyToDevice(void* device, const void* host, size_t bytes);
absl::Status CopyToHost(void* host, const void* device, size_t bytes);

// Untyped device memory (cudaMalloc), freed on destruction; movable.
class DeviceBuffer {
 public:
  static absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);

  void* data() const { return data_.get(); }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_.get());
  }

  // Synchronous copies of `bytes` at byte `offset` (complete on return).
  absl::Status Upload(const void* host, size_t bytes, size_t offset = 0);
  absl::Status Download(void* host, size_t bytes, size_t offset = 0) const;
  // Every byte set to `value`, complete on return (tests poison outputs
  // with it).
  absl::Status Fill(uint8_t value);

 private:
  std::unique_ptr<void, CudaFree> data_;
  size_t bytes_ = 0;
};

// Page-locked host memory (cudaMallocHost), for asynchronous copies.
class PinnedBuffer {
 public:
  static absl::StatusOr<PinnedBuffer> Allocate(size_t bytes);
  uint8_t* data() const { return static_cast<uint8_t*>(data_.get()); }
  size_t bytes() const { return bytes_; }

 private:
  std::unique_ptr<void, CudaFreeHost> data_;
  size_t bytes_ = 0;
};

// A CUDA event (no timing): Record marks the work enqueued on a context so
// far; Synchronize blocks the calling thread, on any thread, until the
// device has done it. Movable.
class Event {
 public:
  static absl::StatusOr<Event> Create();
  absl::Status Record(const class Context& ctx);
  absl::Status Synchronize() const;

 private:
  struct Destroy {
    void operator()(void* event) const;
  };
  std::unique_ptr<void, Destroy> event_;
};

// A CUDA stream, a flag for kernels that report bad input and a double for
// kernels that sum (the synthetic loss). One thread uses a context at a time.
class Context {
 public:
  // `high_priority`: the stream at the device's highest priority, whose
  // kernels the GPU schedules ahead of queued work of lower priority (the
  // training's own, on PyTorch's streams) as it frees up.
  static absl::StatusOr<std::unique_ptr<Context>> Create(
      bool high_priority = false);
  ~Context();

  void* stream() const { return stream_; }  // a cudaStream_t
  int* device_flag() const { return flag_; }
  int* host_flag() const { return host_flag_; }  // pinned
  double* device_sum() const { return sum_; }
  absl::Status Synchronize();
  // Work enqueued on this context from now on waits for the work already
  // enqueued on `stream` (another cudaStream_t; nullptr is the legacy default
  // stream), without blocking the host: an event recorded there.
  absl::Status WaitFor(void* stream);
  // Enqueue copies on the stream: device to device (the bandwidth ceiling
  // of benchmarks), device to host and host to device (asynchronous with
  // pinned host memory).
  absl::Status Copy(void* dst, const void* src, size_t bytes);
  absl::Status CopyToHost(void* host, const void* device, size_t bytes);
  absl::Status CopyToDevice(void* device, const void* host, size_t bytes);
  // Enqueue setting `bytes` of device memory to `value`.
  absl::Status Fill(void* device, uint8_t value, size_t bytes);

 private:
  Context() = default;
  void* stream_ = nullptr;
  int* flag_ = nullptr;
  int* host_flag_ = nullptr;
  double* sum_ = nullptr;
  void* event_ = nullptr;  // a cudaEvent_t for WaitFor
};

}  // namespace morse::kernels

#endif  // MORSE_KERNELS_DEVICE_H_
