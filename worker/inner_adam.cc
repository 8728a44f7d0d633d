#include "worker/inner_adam.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "compress/check.h"
#include "compress/step_plan.h"
#include "compress/update_rules.h"
#include "proto/checkpoint_file.h"

namespace morse::worker {

InnerAdam::InnerAdam(const compress::AlgorithmConfig& config, uint64_t dim)
    : config_(config),
      layout_(*compress::Layout::Create(config.layout)),
      schedule_(config.lr),
      x_(dim),
      m_(dim, 0.0f),
      v_(dim, 0.0f),
      grad_(dim) {
  // The job's steps are outer steps; the schedule runs over inner ones.
  schedule_.total_steps *= steps();
}

void InnerAdam::StartFrom(int64_t step, absl::Span<const float> outer) {
  if (step == 0 || config_.diloco.fragments <= 1) {
    std::copy(outer.begin(), outer.end(), x_.begin());
    return;
  }
  for (const compress::Partition& p : layout_.partitions()) {
    if (compress::Idle(config_, step - 1, p.range.begin)) continue;
    std::copy(outer.begin() + p.range.begin, outer.begin() + p.range.end,
              x_.begin() + p.range.begin);
  }
}

compress::AdamScalars InnerAdam::Scalars(int64_t inner) const {
  return compress::MakeAdamScalars(config_.adam,
                                   compress::LearningRate(schedule_, inner),
                                   inner + 1, config_.bias_correction);
}

absl::StatusOr<double> InnerAdam::Run(int64_t step, Workload& workload,
                                      absl::Span<const float> outer,
                                      absl::Span<float> pseudo_gradient) {
  MORSE_CHECK(pseudo_gradient.size() == x_.size());
  auto loss = RunAllButLast(step, workload, outer);
  if (!loss.ok()) return loss.status();
  const int64_t last = (step + 1) * steps() - 1;
  auto l = workload.Gradient(last, x_, absl::MakeSpan(grad_));
  if (!l.ok()) return l.status();
  compress::AdamStep(Scalars(last), grad_, absl::MakeSpan(x_),
                     absl::MakeSpan(m_), absl::MakeSpan(v_));
  for (size_t j = 0; j < x_.size(); ++j) pseudo_gradient[j] = outer[j] - x_[j];
  return (*loss + *l) / static_cast<double>(steps());
}

absl::StatusOr<double> InnerAdam::RunAllButLast(int64_t step,
                                                Workload& workload,
                                                absl::Span<const float> outer) {
  MORSE_CHECK(outer.size() == x_.size());
  StartFrom(step, outer);
  const int64_t every = steps();
  double loss = 0;
  for (int64_t h = 0; h + 1 < every; ++h) {
    const int64_t inner = step * every + h;
    auto l = workload.Gradient(inner, x_, absl::MakeSpan(grad_));
    if (!l.ok()) return l.status();
    loss += *l;
    compress::AdamStep(Scalars(inner), grad_, absl::MakeSpan(x_),
                       absl::MakeSpan(m_), absl::MakeSpan(v_));
  }
  return loss;
}

absl::Status InnerAdam::LastStepRange(int64_t step, Workload& workload,
                                      absl::Span<const float> outer,
                                      absl::Span<float> pseudo_gradient,
                                      uint64_t begin, uint64_t end,
                                      double loss_lanes[4]) {
  MORSE_CHECK(begin <= end && end <= x_.size() && outer.size() == x_.size() &&
              pseudo_gradient.size() == x_.size());
  const int64_t last = (step + 1) * steps() - 1;
  if (absl::Status s = workload.GradientRange(last, x_, absl::MakeSpan(grad_),
                                              begin, end, loss_lanes);
      !s.ok()) {
    return s;
  }
  const size_t n = end - begin;
  compress::AdamStep(Scalars(last),
                     absl::MakeConstSpan(grad_).subspan(begin, n),
                     absl::MakeSpan(x_).subspan(begin, n),
                     absl::MakeSpan(m_).subspan(begin, n),
                     absl::MakeSpan(v_).subspan(begin, n));
  for (uint64_t j = begin; j < end; ++j) pseudo_gradient[j] = outer[j] - x_[j];
  return absl::OkStatus();
}

absl::Status InnerAdam::Save(const std::string& path, int64_t step,
                             uint32_t rank, uint64_t layout_fingerprint,
                             uint64_t algorithm_fingerprint) const {
  proto::CheckpointWriter writer(
      {"diloco_inner", rank, layout_fingerprint, algorithm_fingerprint, step});
  writer.AddFloats("inner_m", m_);
  writer.AddFloats("inner_v", v_);
  // Streaming: the partitions not synced keep this worker's own values.
  if (config_.diloco.fragments > 1) writer.AddFloats("inner_x", x_);
  return writer.Write(path);
}

absl::Status InnerAdam::Load(const std::string& path, int64_t step,
                             uint32_t rank, uint64_t layout_fingerprint,
                             uint64_t algorithm_fingerprint) {
  auto reader = proto::CheckpointReader::Open(path);
  if (absl::IsNotFound(reader.status())) {
    return absl::FailedPreconditionError(
        absl::StrCat("diloco: no inner Adam state at ", path));
  }
  if (!reader.ok()) return reader.status();
  const proto::CheckpointHeader& h = reader->header();
  if (h.kind != "diloco_inner" || h.index != rank ||
      h.layout_fingerprint != layout_fingerprint ||
      h.algorithm_fingerprint != algorithm_fingerprint) {
    return absl::FailedPreconditionError(
        absl::StrCat("diloco: ", path, " is not worker ", rank,
                     "'s inner Adam state of this job (", h.kind, " of worker ",
                     h.index, ")"));
  }
  if (h.step != step) {
    return absl::FailedPreconditionError(
        absl::StrCat("diloco: ", path, " holds the inner Adam state after ",
                     h.step, " outer steps; the worker starts at ", step));
  }
  auto m = reader->Floats("inner_m", m_.size());
  if (!m.ok()) return m.status();
  auto v = reader->Floats("inner_v", v_.size());
  if (!v.ok()) return v.status();
  if (config_.diloco.fragments > 1) {
    auto x = reader->Floats("inner_x", x_.size());
    if (!x.ok()) return x.status();
    x_ = *std::move(x);
  }
  m_ = *std::move(m);
  v_ = *std::move(v);
  return absl::OkStatus();
}

}  // namespace morse::worker
