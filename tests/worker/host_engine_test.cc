// The host engine's onebit_lamb replies (worker/engine/host/engine.cc): the
// layer statistics a shard sends with a reply (PushReply lamb_pieces) stand
// in for the worker's own, with the same bits; malformed ones are refused
// before anything changes.
#include <algorithm>
#include <cstring>
#include <vector>

#include "compress/codec.h"
#include "compress/error_feedback.h"
#include "compress/lamb.h"
#include "compress/replica.h"
#include "compress/step_plan.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "worker/engine/host/engine.h"

namespace morse::worker {
namespace {

// A worker's replica, error buffer and host engine.
struct HostWorker {
  HostWorker(const proto::JobSpec& job, const compress::Layout& layout,
             absl::Span<const float> x0)
      : replica(job.algorithm, {0, job.algorithm.layout.dim}),
        error(job.algorithm.worker_feedback, job.algorithm.layout.dim,
              job.algorithm.layout.block_elems),
        engine(host::CreateEngine(
            EngineState{&job.algorithm, &layout, &replica, &error})) {
    std::copy(x0.begin(), x0.end(), replica.x().begin());
  }
  compress::Replica replica;
  compress::ErrorFeedback error;
  std::unique_ptr<Engine> engine;
};

// The reply of `step` for partition `p`: some values in the step's reply
// codec.
std::string ReplyOf(const proto::JobSpec& job, int64_t step,
                    const compress::Partition& p) {
  const compress::ReplyRule rule = compress::PlanReply(job.algorithm, step);
  std::vector<float> values(p.range.size());
  for (size_t j = 0; j < values.size(); ++j)
    values[j] =
        0.01f * static_cast<float>((j * 7 + step * 13 + p.id) % 23) - 0.1f;
  std::string payload(compress::PayloadBytes(rule.codec, values.size()), '\0');
  EXPECT_TRUE(compress::Encode(
                  rule.codec, values, compress::RoundingKey{},
                  {reinterpret_cast<uint8_t*>(payload.data()), payload.size()})
                  .ok());
  return payload;
}

absl::Span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

// A host worker keeps 32 partitions in flight where the config leaves
// `window` out: its encoded payloads are host memory the window bounds.
TEST(HostEngineTest, KeepsThirtyTwoPartitionsInFlightByDefault) {
  const proto::JobSpec job = *proto::ParseJobConfig(
      "workers: 1 shards: 1 synthetic { dim: 64 } lr { lr: 0.01 } steps: 1 "
      "optimizer: \"adam\"",
      proto::ConfigFormat::kText);
  const compress::Layout layout =
      *compress::Layout::Create(job.algorithm.layout);
  HostWorker worker(job, layout, std::vector<float>(64));
  EXPECT_EQ(job.window, 0u);
  EXPECT_EQ(worker.engine->DefaultWindow(130), 32u);
  EXPECT_EQ(worker.engine->DefaultWindow(1), 32u);
}

TEST(HostEngineTest, TakesALambReplysLayerStatisticsFromItsShard) {
  const proto::JobSpec job = *proto::ParseJobConfig(R"(
    workers: 2
    shards: 1
    synthetic { dim: 2000 layer_elems: 900 }
    lr { lr: 0.01 }
    steps: 20
    block_elems: 16
    partition_elems: 1024
    optimizer: "onebit_lamb"
    freeze_step: 2
  )",
                                                    proto::ConfigFormat::kText);
  const compress::Layout layout =
      *compress::Layout::Create(job.algorithm.layout);
  std::vector<float> x0(job.algorithm.layout.dim);
  for (size_t j = 0; j < x0.size(); ++j)
    x0[j] = 0.001f * static_cast<float>(j % 97) - 0.05f;
  // `given` takes the statistics its shard sends, which the shard takes on
  // its mirror; `own` takes its own.
  HostWorker given(job, layout, x0), own(job, layout, x0);
  compress::Replica mirror(job.algorithm, {0, job.algorithm.layout.dim});
  std::copy(x0.begin(), x0.end(), mirror.x().begin());
  // The mirror's x moves with the step's commit, after every reply.
  const auto shard_pieces = [&](int64_t step, const compress::Partition& p,
                                const std::string& reply) {
    EXPECT_TRUE(
        mirror.ApplyReply(step, p.range.begin, p.range.size(), Bytes(reply))
            .ok());
    return compress::PieceStats(*compress::OptimizerOf(job.algorithm).Layers(),
                                compress::LayerPiecesOf(job.algorithm, p.range),
                                mirror.SegmentStats(step, p.range));
  };
  for (int64_t step = 0; step < 4; ++step) {  // the warmup, then 1-bit
    given.engine->BeginReplies(step);
    own.engine->BeginReplies(step);
    for (const compress::Partition& p : layout.partitions()) {
      const std::string reply = ReplyOf(job, step, p);
      ASSERT_TRUE(own.engine->ApplyReply(step, p, Bytes(reply)).ok());
      const std::vector<double> pieces = shard_pieces(step, p, reply);
      if (step == 1 && p.id == 0) {
        // Malformed: another count, or with a clipped average; nothing
        // changes.
        const std::vector<float> m(given.replica.m().begin(),
                                   given.replica.m().end());
        std::vector<double> short_by_one(pieces.begin(), pieces.end() - 1);
        EXPECT_EQ(
            given.engine
                ->ApplyReply(step, p, Bytes(reply), nullptr, 1.0f, short_by_one)
                .code(),
            absl::StatusCode::kInvalidArgument);
        EXPECT_EQ(given.engine
                      ->ApplyReply(step, p, Bytes(reply), nullptr, 0.5f, pieces)
                      .code(),
                  absl::StatusCode::kInvalidArgument);
        EXPECT_TRUE(std::equal(m.begin(), m.end(), given.replica.m().begin()));
      }
      ASSERT_TRUE(
          given.engine->ApplyReply(step, p, Bytes(reply), nullptr, 1.0f, pieces)
              .ok());
    }
    const std::vector<double> commit =
        *own.engine->CommitStep(step, {}, nullptr);
    EXPECT_EQ(*given.engine->CommitStep(step, {}, nullptr), commit) << step;
    ASSERT_EQ(*mirror.CommitStep(step), commit);
    EXPECT_EQ(0, std::memcmp(given.replica.x().data(), own.replica.x().data(),
                             4 * x0.size()))
        << step;
  }
  // And it uses them: other statistics give another commit.
  const int64_t step = 4;
  given.engine->BeginReplies(step);
  own.engine->BeginReplies(step);
  for (const compress::Partition& p : layout.partitions()) {
    const std::string reply = ReplyOf(job, step, p);
    ASSERT_TRUE(own.engine->ApplyReply(step, p, Bytes(reply)).ok());
    std::vector<double> pieces = shard_pieces(step, p, reply);
    // Each piece's largest d/d' (design.md 2.8's F) far above any factor.
    for (size_t k = 2; k < pieces.size(); k += compress::kLambStats)
      pieces[k] = 100.0;
    ASSERT_TRUE(
        given.engine->ApplyReply(step, p, Bytes(reply), nullptr, 1.0f, pieces)
            .ok());
  }
  EXPECT_NE(*given.engine->CommitStep(step, {}, nullptr),
            *own.engine->CommitStep(step, {}, nullptr));
}

}  // namespace
}  // namespace morse::worker
