// DeviceModel on a GPU, through kernels/ (see device_model.h).
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "compress/update_rules.h"
#include "kernels/codecs.h"
#include "kernels/device.h"
#include "kernels/mlp.h"
#include "worker/device_model.h"
#include "worker/mlp_backprop.h"
#include "worker/workload.h"

namespace morse::worker {
namespace {

bool OnGpu(compress::CodecKind kind) {
  return kind != compress::CodecKind::kTopK;
}

// MlpOps (worker/mlp_backprop.h) through kernels/mlp.h, on one context.
class DeviceMlpOps final : public MlpOps {
 public:
  DeviceMlpOps(kernels::Context& ctx, kernels::Blas& blas, double* row_loss)
      : ctx_(ctx), blas_(blas), row_loss_(row_loss) {}

  absl::Status Gemm(bool trans_a, bool trans_b, int m, int n, int k,
                    const float* a, int lda, const float* b, int ldb,
                    float beta, float* c, int ldc) override {
    return blas_.Gemm(trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc);
  }
  absl::Status BroadcastRows(const float* bias, int rows, int cols,
                             float* out) override {
    return kernels::BroadcastRows(ctx_, bias, rows, cols, out);
  }
  absl::Status Relu(float* z, size_t n) override {
    return kernels::Relu(ctx_, z, n);
  }
  absl::Status ReluBackward(const float* a, float* da, size_t n) override {
    return kernels::ReluBackward(ctx_, a, da, n);
  }
  absl::StatusOr<double> SoftmaxCrossEntropy(const float* logits,
                                             const uint32_t* labels, int rows,
                                             int classes, float* dz) override {
    return kernels::SoftmaxCrossEntropy(ctx_, logits, labels, rows, classes, dz,
                                        row_loss_);
  }
  absl::Status ColumnSums(const float* in, int rows, int cols,
                          float* out) override {
    return kernels::ColumnSums(ctx_, in, rows, cols, out);
  }

 private:
  kernels::Context& ctx_;
  kernels::Blas& blas_;
  double* row_loss_;  // device, one double per batch row
};

}  // namespace

class DeviceModel::Impl {
 public:
  Impl(const compress::SimulatorConfig& config, const compress::Layout& layout,
       std::string description, DeviceArrays external)
      : config_(config),
        layout_(layout),
        description_(std::move(description)),
        external_(external) {}

  absl::Status Init() {
    auto device = kernels::CurrentDevice();
    if (!device.ok()) return device.status();
    device_ = *device;
    const size_t dim = config_.layout.dim;
    size_t max_payload = 0;
    for (const compress::Partition& p : layout_.partitions()) {
      for (const compress::CodecSpec* spec :
           {&config_.warmup_codec, &config_.up_codec, &config_.down_codec}) {
        max_payload = std::max(max_payload,
                               compress::PayloadBytes(*spec, p.range.size()));
      }
    }
    for (kernels::DeviceBuffer* b :
         {&x_, &m_, &v_, &e_, &grad_, &scratch_, &apply_scratch_}) {
      const bool external = (b == &x_ && external_.x != nullptr) ||
                            (b == &grad_ && external_.grad != nullptr);
      if (external) continue;
      auto allocated = kernels::DeviceBuffer::Allocate(4 * dim);
      if (!allocated.ok()) return allocated.status();
      *b = *std::move(allocated);
    }
    x_ptr_ = external_.x != nullptr ? external_.x : x_.as<float>();
    grad_ptr_ = external_.grad != nullptr ? external_.grad : grad_.as<float>();
    for (kernels::DeviceBuffer* b : {&send_payload_, &reply_payload_}) {
      auto allocated = kernels::DeviceBuffer::Allocate(max_payload);
      if (!allocated.ok()) return allocated.status();
      *b = *std::move(allocated);
    }
    for (kernels::PinnedBuffer* b : {&send_host_, &reply_host_}) {
      auto allocated = kernels::PinnedBuffer::Allocate(max_payload);
      if (!allocated.ok()) return allocated.status();
      *b = *std::move(allocated);
    }
    if (absl::Status s = e_.Fill(0); !s.ok()) return s;
    auto send = kernels::Context::Create();
    if (!send.ok()) return send.status();
    send_ = *std::move(send);
    auto apply = kernels::Context::Create();
    if (!apply.ok()) return apply.status();
    apply_ = *std::move(apply);
    return absl::OkStatus();
  }

  const std::string& description() const { return description_; }

  // Every entry point runs on the device the model was created on, whatever
  // the calling thread (gRPC threads apply replies).
  absl::Status OnDevice() const { return kernels::SetDevice(device_); }

  absl::Status Upload(const compress::Replica& replica,
                      absl::Span<const float> error) {
    const size_t bytes = 4 * config_.layout.dim;
    if (absl::Status s = kernels::CopyToDevice(x_ptr_, replica.x().data(), bytes);
        !s.ok())
      return s;
    if (absl::Status s = m_.Upload(replica.m().data(), bytes); !s.ok())
      return s;
    if (absl::Status s = v_.Upload(replica.v().data(), bytes); !s.ok())
      return s;
    return e_.Upload(error.data(), bytes);
  }

  absl::Status Download(compress::Replica& replica, absl::Span<float> error) {
    const size_t bytes = 4 * config_.layout.dim;
    if (absl::Status s = kernels::CopyToHost(replica.x().data(), x_ptr_, bytes);
        !s.ok())
      return s;
    if (absl::Status s = m_.Download(replica.mutable_m().data(), bytes);
        !s.ok())
      return s;
    if (absl::Status s = v_.Download(replica.mutable_v().data(), bytes);
        !s.ok())
      return s;
    return e_.Download(error.data(), bytes);
  }

  absl::Status SetWorkload(Workload& workload) {
    if (workload.dim() != config_.layout.dim) {
      return absl::InvalidArgumentError(
          "the workload's size differs from the model's");
    }
    if (auto* w = dynamic_cast<SyntheticWorkload*>(&workload)) {
      return SetSynthetic(*w);
    }
    if (auto* w = dynamic_cast<MlpWorkload*>(&workload)) return SetMlp(*w);
    return absl::UnimplementedError("this workload has no GPU gradient");
  }

  absl::StatusOr<double> Gradient(int64_t step) {
    if (mlp_ != nullptr) return MlpGradient(step);
    if (!synthetic_) {
      return absl::FailedPreconditionError("no workload was set");
    }
    return kernels::SyntheticGradient(*send_, seed_, step, rank_, noise_,
                                      curvature_.as<float>(),
                                      target_.as<float>(), x_ptr_,
                                      grad_ptr_, config_.layout.dim);
  }

  absl::Status DownloadGradient(absl::Span<float> grad) {
    if (grad.size() != config_.layout.dim) {
      return absl::InvalidArgumentError("the gradient has dim floats");
    }
    if (absl::Status s = send_->Synchronize(); !s.ok()) return s;
    return kernels::CopyToHost(grad.data(), grad_ptr_, 4 * grad.size());
  }

  absl::Status WaitFor(void* stream) { return send_->WaitFor(stream); }

  // Session::Encode, on the device.
  absl::Status Encode(int64_t step, uint32_t rank,
                      const compress::StepPlan& plan,
                      const compress::Partition& p, std::string* payload) {
    const uint64_t begin = p.range.begin, n = p.range.size();
    const size_t bytes = compress::PayloadBytes(plan.up, n);
    const float* input = grad_ptr_ + begin;
    if (plan.compressing) {
      float* local = scratch_.as<float>() + begin;
      if (absl::Status s =
              kernels::Momentum(*send_, config_.adam.beta1,
                                m_.as<float>() + begin, input, local, n);
          !s.ok()) {
        return s;
      }
      input = local;
    }
    const compress::RoundingKey key =
        compress::SenderKey(config_, step, rank, begin);
    compress::FeedbackArgs fb;
    float* error = nullptr;
    if (plan.feedback &&
        config_.worker_feedback.kind != compress::FeedbackKind::kNone) {
      fb = {config_.worker_feedback.kind, config_.worker_feedback.beta};
      error = e_.as<float>() + begin;
    }
    if (absl::Status s =
            kernels::EncodeWithError(*send_, plan.up, input, error, n, fb, key,
                                     send_payload_.as<uint8_t>());
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            send_->CopyToHost(send_host_.data(), send_payload_.data(), bytes);
        !s.ok())
      return s;
    if (absl::Status s = send_->Synchronize(); !s.ok()) return s;
    payload->assign(reinterpret_cast<const char*>(send_host_.data()), bytes);
    return absl::OkStatus();
  }

  // Replica::ApplyReply, on the device.
  absl::Status ApplyReply(int64_t step, const compress::Partition& p,
                          absl::Span<const uint8_t> reply) {
    const compress::StepPlan plan = compress::PlanStep(config_, step);
    const uint64_t begin = p.range.begin, n = p.range.size();
    if (absl::Status s = compress::ValidatePayload(plan.down, reply, n);
        !s.ok())
      return s;
    absl::MutexLock lock(&apply_mu_);
    std::copy(reply.begin(), reply.end(), reply_host_.data());
    if (absl::Status s = apply_->CopyToDevice(reply_payload_.data(),
                                              reply_host_.data(), reply.size());
        !s.ok()) {
      return s;
    }
    const float lr = compress::LearningRate(config_.lr, step);
    float* x = x_ptr_ + begin;
    float* m = m_.as<float>() + begin;
    float* v = v_.as<float>() + begin;
    const uint8_t* payload = reply_payload_.as<uint8_t>();
    absl::Status s;
    if (plan.compressing) {
      const compress::AdamScalars scalars =
          compress::MakeAdamScalars(config_.adam, lr, step + 1, false);
      if (plan.down.kind == compress::CodecKind::kSign1) {
        s = kernels::DecodeFrozenUpdate(*apply_, plan.down, payload, n, scalars,
                                        x, m, v);
      } else {
        float* decoded = apply_scratch_.as<float>() + begin;
        s = kernels::Decode(*apply_, plan.down, payload, n, decoded);
        if (s.ok())
          s = kernels::FrozenUpdate(*apply_, scalars, decoded, x, m, v, n);
      }
    } else {
      const bool correct =
          config_.optimizer == compress::OptimizerKind::kAdam &&
          config_.bias_correction;
      const compress::AdamScalars scalars =
          compress::MakeAdamScalars(config_.adam, lr, step + 1, correct);
      float* decoded = apply_scratch_.as<float>() + begin;
      s = kernels::Decode(*apply_, plan.down, payload, n, decoded);
      if (s.ok())
        s = kernels::AdamUpdate(*apply_, scalars, decoded, x, m, v, n);
    }
    if (!s.ok()) return s;
    // The pinned and device staging buffers are reused by the next reply.
    return apply_->Synchronize();
  }

 private:
  absl::Status SetSynthetic(const SyntheticWorkload& w) {
    for (kernels::DeviceBuffer* b : {&curvature_, &target_}) {
      auto allocated = kernels::DeviceBuffer::Allocate(4 * w.dim());
      if (!allocated.ok()) return allocated.status();
      *b = *std::move(allocated);
    }
    if (absl::Status s = curvature_.Upload(w.curvature().data(), 4 * w.dim());
        !s.ok())
      return s;
    if (absl::Status s = target_.Upload(w.target().data(), 4 * w.dim());
        !s.ok())
      return s;
    seed_ = w.seed();
    rank_ = w.rank();
    noise_ = w.noise();
    synthetic_ = true;
    return absl::OkStatus();
  }

  absl::Status SetMlp(MlpWorkload& w) {
    const std::vector<uint32_t>& widths = w.widths();
    const uint32_t rows = w.batch_size();
    const size_t input_bytes = 4 * static_cast<size_t>(rows) * widths[0];
    mlp_storage_.clear();
    std::vector<float*> pointers;
    for (size_t size : MlpBufferSizes(widths, rows)) {
      auto allocated = kernels::DeviceBuffer::Allocate(4 * size);
      if (!allocated.ok()) return allocated.status();
      mlp_storage_.push_back(*std::move(allocated));
      pointers.push_back(mlp_storage_.back().as<float>());
    }
    mlp_buffers_ = MlpBuffersOver(pointers);
    auto labels =
        kernels::DeviceBuffer::Allocate(4 * static_cast<size_t>(rows));
    if (!labels.ok()) return labels.status();
    labels_ = *std::move(labels);
    auto row_loss =
        kernels::DeviceBuffer::Allocate(8 * static_cast<size_t>(rows));
    if (!row_loss.ok()) return row_loss.status();
    row_loss_ = *std::move(row_loss);
    auto input_host = kernels::PinnedBuffer::Allocate(input_bytes);
    if (!input_host.ok()) return input_host.status();
    input_host_ = *std::move(input_host);
    auto labels_host = kernels::PinnedBuffer::Allocate(4 * rows);
    if (!labels_host.ok()) return labels_host.status();
    labels_host_ = *std::move(labels_host);
    auto blas = kernels::Blas::Create(*send_);
    if (!blas.ok()) return blas.status();
    blas_ = *std::move(blas);
    mlp_ = &w;
    return absl::OkStatus();
  }

  // The batch is drawn on the host (the CPU worker's draws) and copied
  // over; the passes run on the send stream, ahead of the encodes.
  absl::StatusOr<double> MlpGradient(int64_t) {
    const uint32_t rows = mlp_->batch_size();
    mlp_->NextBatch(reinterpret_cast<float*>(input_host_.data()),
                    reinterpret_cast<uint32_t*>(labels_host_.data()));
    if (absl::Status s = send_->CopyToDevice(
            mlp_buffers_.acts[0], input_host_.data(), input_host_.bytes());
        !s.ok())
      return s;
    if (absl::Status s = send_->CopyToDevice(
            labels_.data(), labels_host_.data(), labels_host_.bytes());
        !s.ok())
      return s;
    DeviceMlpOps ops(*send_, *blas_, row_loss_.as<double>());
    // Returns after the loss came back, so the pinned batch is free again.
    return worker::MlpGradient(ops, mlp_->widths(), x_ptr_,
                               labels_.as<uint32_t>(), static_cast<int>(rows),
                               mlp_buffers_, grad_ptr_);
  }

  compress::SimulatorConfig config_;
  compress::Layout layout_;
  std::string description_;
  int device_ = 0;
  DeviceArrays external_;
  kernels::DeviceBuffer x_, m_, v_, e_, grad_, scratch_, apply_scratch_;
  float* x_ptr_ = nullptr;     // x_ or the caller's
  float* grad_ptr_ = nullptr;  // grad_ or the caller's
  kernels::DeviceBuffer send_payload_, reply_payload_;
  kernels::PinnedBuffer send_host_, reply_host_;
  std::unique_ptr<kernels::Context> send_, apply_;
  absl::Mutex apply_mu_;
  // The synthetic workload.
  bool synthetic_ = false;
  kernels::DeviceBuffer curvature_, target_;
  uint64_t seed_ = 0;
  uint32_t rank_ = 0;
  float noise_ = 0;
  // The mlp workload.
  MlpWorkload* mlp_ = nullptr;
  std::vector<kernels::DeviceBuffer> mlp_storage_;
  MlpBuffers mlp_buffers_;
  kernels::DeviceBuffer labels_, row_loss_;
  kernels::PinnedBuffer input_host_, labels_host_;
  std::unique_ptr<kernels::Blas> blas_;
};

DeviceModel::DeviceModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceModel::~DeviceModel() = default;

absl::StatusOr<std::unique_ptr<DeviceModel>> DeviceModel::Create(
    const compress::SimulatorConfig& config, const compress::Layout& layout,
    DeviceArrays external) {
  auto device = kernels::DeviceDescription();
  if (!device.ok()) return device.status();
  if (config.worker_feedback.storage != compress::ErrorStorage::kFp32) {
    return absl::UnimplementedError(
        "the GPU path keeps the error buffer in fp32 (worker_feedback storage "
        "int8)");
  }
  for (const compress::CodecSpec* spec :
       {&config.warmup_codec, &config.up_codec, &config.down_codec}) {
    if (!OnGpu(spec->kind)) {
      return absl::UnimplementedError(
          absl::StrCat(compress::CodecName(spec->kind), " has no GPU kernel"));
    }
  }
  if (config.optimizer == compress::OptimizerKind::kAdam &&
      config.up_codec.kind == compress::CodecKind::kFp32 &&
      config.worker_feedback.kind != compress::FeedbackKind::kNone) {
    return absl::UnimplementedError(
        "fp32 with error feedback has no GPU kernel");
  }
  auto impl = std::make_unique<Impl>(config, layout, *device, external);
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  return std::unique_ptr<DeviceModel>(new DeviceModel(std::move(impl)));
}

absl::StatusOr<std::string> DeviceModel::Describe() {
  return kernels::DeviceDescription();
}

const std::string& DeviceModel::description() const {
  return impl_->description();
}
absl::Status DeviceModel::Upload(const compress::Replica& replica,
                                 absl::Span<const float> error) {
  if (absl::Status s = impl_->OnDevice(); !s.ok()) return s;
  return impl_->Upload(replica, error);
}
absl::Status DeviceModel::Download(compress::Replica& replica,
                                   absl::Span<float> error) {
  if (absl::Status s = impl_->OnDevice(); !s.ok()) return s;
  return impl_->Download(replica, error);
}
absl::Status DeviceModel::SetWorkload(Workload& workload) {
  if (absl::Status s = impl_->OnDevice(); !s.ok()) return s;
  return impl_->SetWorkload(workload);
}
absl::StatusOr<double> DeviceModel::Gradient(int64_t step) {
  if (absl::Status s = impl_->OnDevice(); !s.ok()) return s;
  return impl_->Gradient(step);
}
absl::Status DeviceModel::DownloadGradient(absl::Span<float> grad) {
  if (absl::Status s = impl_->OnDevice(); !s.ok()) return s;
  return impl_->DownloadGradient(grad);
}
absl::Status DeviceModel::WaitFor(void* stream) {
  if (absl::Status s = impl_->OnDevice(); !s.ok()) return s;
  return impl_->WaitFor(stream);
}
absl::Status DeviceModel::Encode(int64_t step, uint32_t rank,
                                 const compress::StepPlan& plan,
                                 const compress::Partition& p,
                                 std::string* payload) {
  if (absl::Status s = impl_->OnDevice(); !s.ok()) return s;
  return impl_->Encode(step, rank, plan, p, payload);
}
absl::Status DeviceModel::ApplyReply(int64_t step, const compress::Partition& p,
                                     absl::Span<const uint8_t> reply) {
  if (absl::Status s = impl_->OnDevice(); !s.ok()) return s;
  return impl_->ApplyReply(step, p, reply);
}

}  // namespace morse::worker
