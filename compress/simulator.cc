#include "compress/simulator.h"

#include "absl/strings/str_cat.h"

namespace morse::compress {

absl::Status ValidateSimulatorConfig(const SimulatorConfig& c) {
  if (c.workers == 0) return absl::InvalidArgumentError("workers must be positive");
  if (absl::Status s = Layout::Create(c.layout).status(); !s.ok()) return s;
  if (absl::Status s = ValidateAdamHyper(c.adam); !s.ok()) return s;
  if (absl::Status s = ValidateLrSchedule(c.lr); !s.ok()) return s;
  for (const CodecSpec* codec : {&c.warmup_codec, &c.up_codec, &c.down_codec}) {
    if (absl::Status s = ValidateCodecSpec(*codec); !s.ok()) return s;
    if (codec->block_elems != c.layout.block_elems) {
      return absl::InvalidArgumentError(absl::StrCat(
          "codec block_elems (", codec->block_elems,
          ") must equal the layout's block_elems (", c.layout.block_elems, ")"));
    }
  }
  const CodecKind warmup = c.warmup_codec.kind;
  if (c.optimizer == OptimizerKind::kOneBitAdam && warmup != CodecKind::kFp32 &&
      warmup != CodecKind::kFp16 && warmup != CodecKind::kBf16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "onebit_adam warmup codec must be fp32, fp16 or bf16, got ",
        CodecName(warmup)));
  }
  if (c.freeze_step < 0) return absl::InvalidArgumentError("freeze_step must be >= 0");
  for (const FeedbackSpec* fb : {&c.worker_feedback, &c.server_feedback}) {
    if (absl::Status s = ValidateFeedbackSpec(*fb); !s.ok()) return s;
  }
  return absl::OkStatus();
}

RoundingKey SenderKey(const SimulatorConfig& config, int64_t step,
                      uint32_t sender_rank, uint64_t first_index) {
  return RoundingKey{config.seed, static_cast<uint64_t>(step), sender_rank, first_index};
}

absl::StatusOr<Simulator> Simulator::Create(const SimulatorConfig& config,
                                            absl::Span<const float> x0) {
  if (absl::Status s = ValidateSimulatorConfig(config); !s.ok()) return s;
  if (x0.size() != config.layout.dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "x0 has ", x0.size(), " elements, the layout ", config.layout.dim));
  }
  absl::StatusOr<Layout> layout = Layout::Create(config.layout);
  if (!layout.ok()) return layout.status();
  return Simulator(config, *std::move(layout), x0);
}

Simulator::Simulator(const SimulatorConfig& config, Layout layout,
                     absl::Span<const float> x0)
    : config_(config),
      layout_(std::move(layout)),
      x_(x0.begin(), x0.end()),
      m_(x0.size(), 0.0f),
      v_(x0.size(), 0.0f) {
  for (uint32_t i = 0; i < config.workers; ++i) {
    worker_errors_.emplace_back(config.worker_feedback, x0.size(), config.layout.block_elems);
  }
  for (uint32_t s = 0; s < config.layout.shards; ++s) {
    server_errors_.emplace_back(config.server_feedback, layout_.shard_range(s).size(),
                                config.layout.block_elems);
  }
}

bool Simulator::compressing() const {
  return config_.optimizer == OptimizerKind::kOneBitAdam && step_ >= config_.freeze_step;
}

absl::Status Simulator::RoundTrip(const Partition& p, const CodecSpec& up,
                                  const CodecSpec& down, bool feedback,
                                  const std::vector<std::vector<float>>& messages,
                                  std::vector<float>& reply) {
  const size_t n = p.range.size();
  // Workers: encode their message for this partition.
  std::vector<std::vector<uint8_t>> pushes(config_.workers);
  for (uint32_t i = 0; i < config_.workers; ++i) {
    pushes[i].resize(PayloadBytes(up, n));
    const absl::Span<const float> part =
        absl::MakeConstSpan(messages[i]).subspan(p.range.begin, n);
    const RoundingKey key = SenderKey(config_, step_, i, p.range.begin);
    absl::Status s = feedback
        ? worker_errors_[i].Compress(up, p.range.begin, part, key, absl::MakeSpan(pushes[i]))
        : Encode(up, part, key, absl::MakeSpan(pushes[i]));
    if (!s.ok()) return s;
  }
  // Shard: average in rank order, recompress with its own error.
  std::vector<absl::Span<const uint8_t>> views(pushes.begin(), pushes.end());
  std::vector<float> average(n);
  if (absl::Status s = DecodeAverage(up, views, absl::MakeSpan(average)); !s.ok()) return s;
  std::vector<uint8_t> payload(PayloadBytes(down, n));
  const uint64_t shard_offset = p.range.begin - layout_.shard_range(p.shard).begin;
  const RoundingKey key = SenderKey(config_, step_, config_.workers + p.shard, p.range.begin);
  absl::Status s = feedback
      ? server_errors_[p.shard].Compress(down, shard_offset, average, key, absl::MakeSpan(payload))
      : Encode(down, average, key, absl::MakeSpan(payload));
  if (!s.ok()) return s;
  // Workers: decode the reply, the same bytes for everyone.
  reply.resize(n);
  return Decode(down, payload, absl::MakeSpan(reply));
}

absl::Status Simulator::Step(absl::Span<const absl::Span<const float>> gradients) {
  if (gradients.size() != config_.workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        gradients.size(), " gradients for ", config_.workers, " workers"));
  }
  for (const auto& g : gradients) {
    if (g.size() != x_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient of ", g.size(), " elements for a model of ", x_.size()));
    }
  }
  const float lr = LearningRate(config_.lr, step_);
  const bool compress = compressing();
  // What each worker sends before compression: its gradient, or in 1-bit
  // Adam's compression phase its local momentum m_i = b1*m + (1-b1)*g_i.
  std::vector<std::vector<float>> messages(config_.workers);
  for (uint32_t i = 0; i < config_.workers; ++i) {
    messages[i].assign(gradients[i].begin(), gradients[i].end());
    if (compress) LocalMomentum(config_.adam.beta1, m_, gradients[i], absl::MakeSpan(messages[i]));
  }
  const bool warmup = config_.optimizer == OptimizerKind::kOneBitAdam && !compress;
  const CodecSpec& up = warmup ? config_.warmup_codec : config_.up_codec;
  const CodecSpec& down = warmup ? config_.warmup_codec : config_.down_codec;
  for (const Partition& p : layout_.partitions()) {
    std::vector<float> reply;
    if (absl::Status s = RoundTrip(p, up, down, /*feedback=*/!warmup, messages, reply);
        !s.ok()) {
      return s;
    }
    const size_t begin = p.range.begin, n = p.range.size();
    auto x = absl::MakeSpan(x_).subspan(begin, n);
    auto m = absl::MakeSpan(m_).subspan(begin, n);
    auto v = absl::MakeSpan(v_).subspan(begin, n);
    if (compress) {
      FrozenVarianceStep(MakeAdamScalars(config_.adam, lr, step_ + 1, false), reply, x, m, v);
    } else {
      const bool correct = config_.optimizer == OptimizerKind::kAdam && config_.bias_correction;
      AdamStep(MakeAdamScalars(config_.adam, lr, step_ + 1, correct), reply, x, m, v);
    }
  }
  ++step_;
  return absl::OkStatus();
}

}  // namespace morse::compress
