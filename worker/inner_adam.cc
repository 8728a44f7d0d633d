#include "worker/inner_adam.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "compress/check.h"
#include "compress/optimizers/diloco.h"
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

bool InnerAdam::CarriesLocal() const {
  const compress::DilocoSpec& d = config_.diloco;
  return d.fragments > 1 || d.overlap_steps > 0 || d.mixing != 0.0f;
}

compress::AdamScalars InnerAdam::Scalars(int64_t inner) const {
  return compress::MakeAdamScalars(config_.adam,
                                   compress::LearningRate(schedule_, inner),
                                   inner + 1, config_.bias_correction);
}

absl::StatusOr<double> InnerAdam::Steps(int64_t step, int64_t begin,
                                        int64_t end, Workload& workload,
                                        absl::Span<const float> outer) {
  const int64_t every = steps();
  MORSE_CHECK(outer.size() == x_.size() && 0 <= begin && begin <= end &&
              end <= every && taken_ == step * every + begin);
  const int64_t merge_at = step == 0 ? 0 : config_.diloco.overlap_steps;
  double loss = 0;
  merge_seconds_ = 0;
  for (int64_t h = begin; h < end; ++h) {
    if (h == merge_at) {
      const absl::Time start = absl::Now();
      compress::MergeOuter(config_, layout_, step - 1, outer,
                           absl::MakeSpan(x_));
      merge_seconds_ = absl::ToDoubleSeconds(absl::Now() - start);
    }
    const int64_t inner = step * every + h;
    auto l = workload.Gradient(inner, x_, absl::MakeSpan(grad_));
    if (!l.ok()) return l.status();
    loss += *l;
    compress::AdamStep(Scalars(inner), grad_, absl::MakeSpan(x_),
                       absl::MakeSpan(m_), absl::MakeSpan(v_));
    ++taken_;
  }
  return loss;
}

void InnerAdam::PseudoGradient(absl::Span<const float> outer,
                               absl::Span<float> pseudo_gradient) const {
  MORSE_CHECK(outer.size() == x_.size() && pseudo_gradient.size() == x_.size());
  for (size_t j = 0; j < x_.size(); ++j) pseudo_gradient[j] = outer[j] - x_[j];
}

absl::StatusOr<double> InnerAdam::Run(int64_t step, Workload& workload,
                                      absl::Span<const float> outer,
                                      absl::Span<float> pseudo_gradient) {
  auto loss = Steps(step, 0, steps(), workload, outer);
  if (!loss.ok()) return loss.status();
  PseudoGradient(outer, pseudo_gradient);
  return *loss / static_cast<double>(steps());
}

absl::StatusOr<double> InnerAdam::RunAllButLast(int64_t step,
                                                Workload& workload,
                                                absl::Span<const float> outer) {
  return Steps(step, 0, steps() - 1, workload, outer);
}

absl::Status InnerAdam::LastStepRange(int64_t step, Workload& workload,
                                      absl::Span<const float> outer,
                                      absl::Span<float> pseudo_gradient,
                                      uint64_t begin, uint64_t end,
                                      double loss_lanes[4]) {
  MORSE_CHECK(begin <= end && end <= x_.size() && outer.size() == x_.size() &&
              pseudo_gradient.size() == x_.size());
  const int64_t last = (step + 1) * steps() - 1;
  MORSE_CHECK(taken_ == last);
  // With one inner step per outer step (no overlap then), the merge first.
  if (steps() == 1 && begin == 0)
    compress::MergeOuter(config_, layout_, step - 1, outer, absl::MakeSpan(x_));
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
  if (end == x_.size()) ++taken_;  // the last range
  return absl::OkStatus();
}

absl::Status InnerAdam::Save(const std::string& path, int64_t step,
                             uint32_t rank, uint64_t layout_fingerprint,
                             uint64_t algorithm_fingerprint) const {
  proto::CheckpointWriter writer(
      {"diloco_inner", rank, layout_fingerprint, algorithm_fingerprint, step});
  writer.AddFloats("inner_m", m_);
  writer.AddFloats("inner_v", v_);
  // Streaming, an overlap or mixing: this worker's own values.
  if (CarriesLocal()) writer.AddFloats("inner_x", x_);
  // An overlap: whether the first overlap_steps of `step` are taken.
  if (config_.diloco.overlap_steps > 0) writer.AddInts("inner_taken", {taken_});
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
  std::vector<float> x;
  if (CarriesLocal()) {
    auto saved = reader->Floats("inner_x", x_.size());
    if (!saved.ok()) return saved.status();
    x = *std::move(saved);
  }
  int64_t taken = step * steps();
  if (config_.diloco.overlap_steps > 0) {
    auto saved = reader->Ints("inner_taken", 1);
    if (!saved.ok()) return saved.status();
    if ((*saved)[0] != taken &&
        (*saved)[0] != taken + config_.diloco.overlap_steps) {
      return absl::DataLossError(absl::StrCat(
          "diloco: ", path, " says ", (*saved)[0],
          " inner steps were taken after ", step, " outer steps of ", steps(),
          "; expected ", taken, " or ", taken + config_.diloco.overlap_steps));
    }
    taken = (*saved)[0];
  }
  if (!x.empty()) x_ = std::move(x);
  taken_ = taken;
  m_ = *std::move(m);
  v_ = *std::move(v);
  return absl::OkStatus();
}

}  // namespace morse::worker
