#include "kernels/device.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_format.h"
#include "kernels/cuda_status.h"

namespace morse::kernels {
namespace {

// cudaMemcpy from pageable memory to the device returns once the bytes are
// staged, and cudaMemset once it is queued, both on the legacy default
// stream, which the engines' non-blocking streams do not wait for: wait
// here, so that a kernel enqueued next anywhere reads what was written.
absl::Status Landed() {
  MORSE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(nullptr));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> DeviceDescription() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrFormat("no CUDA device: %s", cudaGetErrorString(error)));
  }
  if (count == 0)
    return absl::FailedPreconditionError("no CUDA device: none found");
  int device = 0;
  MORSE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  cudaDeviceProp prop;
  MORSE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  return absl::StrFormat("%s (sm_%d%d, %d GiB)", prop.name, prop.major,
                         prop.minor,
                         static_cast<int>(prop.totalGlobalMem >> 30));
}

absl::StatusOr<int> CurrentDevice() {
  int device = 0;
  MORSE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  return device;
}

absl::Status SetDevice(int device) {
  MORSE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  return absl::OkStatus();
}

void CudaFree::operator()(void* p) const { cudaFree(p); }
void CudaFreeHost::operator()(void* p) const { cudaFreeHost(p); }

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  DeviceBuffer buffer;
  if (bytes > 0) {
    void* data = nullptr;
    MORSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&data, bytes));
    buffer.data_.reset(data);
  }
  buffer.bytes_ = bytes;
  return buffer;
}

absl::Status DeviceBuffer::Upload(const void* host, size_t bytes,
                                  size_t offset) {
  if (offset + bytes > bytes_)
    return absl::OutOfRangeError("upload past the device buffer");
  if (bytes == 0) return absl::OkStatus();
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(static_cast<char*>(data_.get()) + offset, host, bytes,
                 cudaMemcpyHostToDevice));
  return Landed();
}

absl::Status DeviceBuffer::Download(void* host, size_t bytes,
                                    size_t offset) const {
  if (offset + bytes > bytes_)
    return absl::OutOfRangeError("download past the device buffer");
  if (bytes == 0) return absl::OkStatus();
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(host, static_cast<const char*>(data_.get()) + offset, bytes,
                 cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status DeviceBuffer::Fill(uint8_t value) {
  if (bytes_ == 0) return absl::OkStatus();
  MORSE_CUDA_RETURN_IF_ERROR(cudaMemset(data_.get(), value, bytes_));
  return Landed();
}

absl::Status CopyToDevice(void* device, const void* host, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
  return Landed();
}

absl::Status CopyToHost(void* host, const void* device, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Context>> Context::Create(bool high_priority) {
  std::unique_ptr<Context> ctx(new Context());
  int least = 0, greatest = 0;  // numerically, greatest < least
  if (high_priority) {
    MORSE_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetStreamPriorityRange(&least, &greatest));
  }
  cudaStream_t stream;
  MORSE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(
      &stream, cudaStreamNonBlocking, high_priority ? greatest : least));
  ctx->stream_ = stream;
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&ctx->flag_), sizeof(int)));
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMallocHost(reinterpret_cast<void**>(&ctx->host_flag_), sizeof(int)));
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&ctx->sum_), sizeof(double)));
  cudaEvent_t event;
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  ctx->event_ = event;
  return ctx;
}

Context::~Context() {
  if (flag_ != nullptr) cudaFree(flag_);
  if (sum_ != nullptr) cudaFree(sum_);
  if (host_flag_ != nullptr) cudaFreeHost(host_flag_);
  if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status Context::WaitFor(void* stream) {
  MORSE_CUDA_RETURN_IF_ERROR(cudaEventRecord(
      static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)));
  MORSE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(
      static_cast<cudaStream_t>(stream_), static_cast<cudaEvent_t>(event_), 0));
  return absl::OkStatus();
}

absl::Status Context::Fill(void* device, uint8_t value, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  MORSE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      device, value, bytes, static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::Status Context::Copy(void* dst, const void* src, size_t bytes) {
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                      static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::Status Context::CopyToHost(void* host, const void* device, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost,
                      static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::Status Context::CopyToDevice(void* device, const void* host,
                                   size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice,
                      static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::StatusOr<PinnedBuffer> PinnedBuffer::Allocate(size_t bytes) {
  PinnedBuffer buffer;
  if (bytes > 0) {
    void* data = nullptr;
    MORSE_CUDA_RETURN_IF_ERROR(cudaMallocHost(&data, bytes));
    buffer.data_.reset(data);
  }
  buffer.bytes_ = bytes;
  return buffer;
}

absl::Status Context::Synchronize() {
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

absl::StatusOr<Event> Event::Create() {
  cudaEvent_t event;
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  Event out;
  out.event_.reset(event);
  return out;
}

void Event::Destroy::operator()(void* event) const {
  cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

absl::Status Event::Record(const Context& ctx) {
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaEventRecord(static_cast<cudaEvent_t>(event_.get()),
                      static_cast<cudaStream_t>(ctx.stream())));
  return absl::OkStatus();
}

absl::Status Event::Synchronize() const {
  MORSE_CUDA_RETURN_IF_ERROR(
      cudaEventSynchronize(static_cast<cudaEvent_t>(event_.get())));
  return absl::OkStatus();
}

}  // namespace morse::kernels
