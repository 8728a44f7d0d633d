// The shard core without gRPC: rank-order sums whatever the arrival order,
// the same reply for every worker, idempotent retries, conflicting bytes,
// bounded memory, initialization rules and the step observer.
#include "server/shard_core.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "compress/bytes_hash.h"
#include "compress/check.h"
#include "compress/fnv.h"
#include "compress/lamb.h"
#include "compress/messages.h"
#include "compress/simulator.h"
#include "compress/trace.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "server/checkpoint_thread.h"
#include "server/shard_host.h"
#include "tests/compress/test_util.h"

namespace morse::server {
namespace {

// The values of the optimizer's array `name` in a snapshot (empty, and a
// failure, when it has none).
std::vector<float>& Own(PartitionSnapshot& snapshot, const std::string& name) {
  for (compress::NamedState& array : snapshot.state) {
    if (array.name == name) return array.values;
  }
  ADD_FAILURE() << "no " << name;
  static std::vector<float> none;
  none.clear();
  return none;
}
std::vector<float> Own(const PartitionSnapshot& snapshot,
                       const std::string& name) {
  PartitionSnapshot copy = snapshot;
  return Own(copy, name);
}

constexpr char kConfig[] = R"(
  workers: 3
  shards: 2
  synthetic { dim: 300 }
  lr { lr: 0.01 }
  steps: 10
  freeze_step: 1
  block_elems: 16
  partition_elems: 64
)";

// Rank 0's initial values (varied per partition) for every partition of
// `shard`.
void InitializeAll(ShardCore& core, uint32_t shard = 1) {
  for (const auto& p : core.layout().shard_partitions(shard)) {
    const std::vector<float> x0 =
        compress::testing::VariedData(p.range.size(), p.id);
    ASSERT_TRUE(core.InitPartition(0, p.id, core.layout().fingerprint(),
                                   {reinterpret_cast<const char*>(x0.data()),
                                    4 * x0.size()})
                    .ok());
  }
}

// InitializeAll's values as a replica of `shard`'s range, for a test to
// apply the replies to.
compress::Replica InitialReplica(const ShardCore& core,
                                 const compress::AlgorithmConfig& config,
                                 uint32_t shard = 1) {
  const compress::Range range = core.layout().shard_range(shard);
  compress::Replica replica(config, range);
  for (const auto& p : core.layout().shard_partitions(shard)) {
    const std::vector<float> x0 =
        compress::testing::VariedData(p.range.size(), p.id);
    std::copy(x0.begin(), x0.end(),
              replica.x().begin() + (p.range.begin - range.begin));
  }
  return replica;
}

// Applies step `step`'s replies of `parts` (in order) to `replica`, scaled
// by the step's clip factor, as a shard's mirror does.
void ApplyReplies(compress::Replica& replica, int64_t step,
                  absl::Span<const compress::Partition> parts,
                  const std::vector<std::shared_ptr<const Reply>>& replies,
                  float scale,
                  absl::Span<const compress::ClipPiece> pieces = {}) {
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& payload = replies[i]->payload;
    ASSERT_TRUE(
        replica
            .ApplyReply(step, parts[i].range.begin, parts[i].range.size(),
                        {reinterpret_cast<const uint8_t*>(payload.data()),
                         payload.size()},
                        nullptr, scale, nullptr,
                        compress::ClipPiecesOf(pieces, parts[i].range.begin,
                                               parts[i].range.end))
            .ok());
  }
}

// Rank `rank`'s push of `step` to partition p: varied values of its own,
// encoded with `codec`.
PushArgs EncodedPush(uint64_t fingerprint, compress::CodecSpec codec,
                     int64_t step, uint32_t rank,
                     const compress::Partition& p) {
  const std::vector<float> x =
      compress::testing::VariedData(p.range.size(), 100 * step + rank);
  PushArgs args{step, rank, p.id, fingerprint, codec.kind, {}, std::nullopt};
  args.payload.resize(compress::PayloadBytes(codec, x.size()));
  EXPECT_TRUE(compress::Encode(codec, x, {},
                               {reinterpret_cast<uint8_t*>(args.payload.data()),
                                args.payload.size()})
                  .ok());
  return args;
}

class ShardCoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    job_ = *proto::ParseJobConfig(kConfig, proto::ConfigFormat::kText);
    core_ = *ShardCore::Create(job_, 1);
    InitializeAll(*core_);
  }
  uint64_t fingerprint() const { return core_->layout().fingerprint(); }
  const compress::Partition& first() const {
    return core_->layout().shard_partitions(1)[0];
  }

  PushArgs Args(int64_t step, uint32_t rank, const compress::Partition& p) {
    return EncodedPush(fingerprint(),
                       compress::PlanStep(job_.algorithm, step).up, step, rank,
                       p);
  }

  // Pushes and returns the status so far ("pending" while the step waits),
  // capturing the reply if one came. The callback owns what it writes to, as
  // it may run long after this returns.
  // Another shard of job_ (shard 1) that took step 0's pushes of every
  // rank on the first partition, each carrying `hyper`.
  std::unique_ptr<ShardCore> StepZeroWith(
      const std::optional<compress::StepHyper>& hyper) {
    auto core = *ShardCore::Create(job_, 1);
    InitializeAll(*core);
    for (uint32_t r = 0; r < job_.algorithm.workers; ++r) {
      PushArgs push = Args(0, r, first());
      push.hyper = hyper;
      core->Push(std::move(push), [](auto) {});
    }
    return core;
  }

  absl::Status Push(PushArgs args,
                    std::shared_ptr<const Reply>* reply = nullptr) {
    auto status = std::make_shared<absl::Status>(absl::UnknownError("pending"));
    auto got = std::make_shared<std::shared_ptr<const Reply>>();
    core_->Push(std::move(args),
                [status, got](absl::StatusOr<std::shared_ptr<const Reply>> r) {
                  *status = r.status();
                  if (r.ok()) *got = *r;
                });
    if (reply != nullptr) *reply = *got;
    return *status;
  }

  proto::JobSpec job_;
  std::unique_ptr<ShardCore> core_;
};

// Streaming DiLoCo (design.md 2.11): in step 0 of 2 fragments, shard 1's
// partitions 3 and 5 sit the step out and partition 4 syncs. An idle
// partition takes empty pushes only (bytes are INVALID_ARGUMENT and change
// nothing), replies with nothing, and its mirror stays as it was; the due
// one averages and replies as ever.
TEST(StreamingDilocoShardTest, AnIdlePartitionTakesEmptyPushesAndStaysAsItWas) {
  auto job = proto::ParseJobConfig(R"(
    workers: 3 shards: 2
    synthetic { dim: 300 }
    lr { lr: 0.01 }
    steps: 10
    block_elems: 16
    partition_elems: 64
    optimizer: "diloco" diloco { sync_every: 2 fragments: 2 }
    up_codec { codec: "fp32" } down_codec { codec: "fp32" })",
                                   proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  auto core = ShardCore::Create(*job, 1);
  ASSERT_TRUE(core.ok()) << core.status();
  InitializeAll(**core);
  const auto parts = (*core)->layout().shard_partitions(1);
  ASSERT_EQ(parts.size(), 3u);
  ASSERT_EQ(parts[0].id, 3u);
  const uint64_t fingerprint = (*core)->layout().fingerprint();
  const auto before = (*core)->FetchPartition(3, fingerprint);
  ASSERT_TRUE(before.ok()) << before.status();
  const auto push = [&](PushArgs args) {
    auto got = std::make_shared<absl::StatusOr<std::shared_ptr<const Reply>>>(
        absl::UnknownError("pending"));
    (*core)->Push(std::move(args), [got](auto r) { *got = std::move(r); });
    return got;
  };
  const compress::CodecSpec fp32 = compress::PlanStep(job->algorithm, 0).up;
  auto refused = push(EncodedPush(fingerprint, fp32, 0, 0, parts[0]));
  EXPECT_EQ(refused->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused->status().message().find("sits this step out"),
            std::string::npos)
      << refused->status();
  std::vector<std::shared_ptr<absl::StatusOr<std::shared_ptr<const Reply>>>>
      idle, due;
  for (uint32_t r = 0; r < 3; ++r) {
    PushArgs empty = EncodedPush(fingerprint, fp32, 0, r, parts[0]);
    empty.payload.clear();
    idle.push_back(push(std::move(empty)));
    due.push_back(push(EncodedPush(fingerprint, fp32, 0, r, parts[1])));
  }
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(idle[r]->ok()) << idle[r]->status();
    EXPECT_TRUE((**idle[r])->payload.empty());
    ASSERT_TRUE(due[r]->ok()) << due[r]->status();
    EXPECT_EQ((**due[r])->payload.size(), 4 * parts[1].range.size());
  }
  const auto after = (*core)->FetchPartition(3, fingerprint);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->completed_steps, 1);
  EXPECT_EQ(after->x, before->x);
  EXPECT_EQ(after->m, before->m);
}

TEST_F(ShardCoreTest, ArrivalOrderDoesNotChangeTheReply) {
  std::vector<std::string> replies;
  std::vector<uint32_t> order = {0, 1, 2};
  do {
    SetUp();  // a fresh shard per order
    std::vector<std::shared_ptr<const Reply>> got(3);
    for (uint32_t rank : order) {
      const absl::Status s = Push(Args(0, rank, first()), &got[rank]);
      // Every push but the last waits for the others.
      EXPECT_EQ(s.ok(), rank == order.back()) << s;
    }
    ASSERT_NE(got[order.back()], nullptr);
    replies.push_back(got[order.back()]->payload);
  } while (std::next_permutation(order.begin(), order.end()));
  for (const std::string& r : replies) EXPECT_EQ(r, replies[0]);
}

// A compute pool (ShardCore::Create's compute_threads) completes
// partitions in parallel off the pushing thread; every reply and the mirror
// keep the bits of the inline core's, whatever the thread count.
TEST_F(ShardCoreTest, AComputePoolOfAnySizeGivesTheInlineCoresBits) {
  const auto partitions = core_->layout().shard_partitions(1);
  constexpr int64_t kSteps = 4;
  // The inline core's replies, step by step (SetUp's core_).
  std::vector<std::string> expected;
  for (int64_t t = 0; t < kSteps; ++t) {
    for (const compress::Partition& p : partitions) {
      std::shared_ptr<const Reply> reply;
      for (uint32_t r = 0; r < 3; ++r)
        ASSERT_EQ(Push(Args(t, r, p), &reply).ok(), r == 2);
      expected.push_back(reply->payload);
    }
  }
  const uint64_t expected_mirror = core_->MirrorChecksum();
  for (int threads : {1, 2, 8}) {
    SCOPED_TRACE(threads);
    auto pooled = *ShardCore::Create(job_, 1, /*memory_limit=*/0, threads);
    ASSERT_NO_FATAL_FAILURE(InitializeAll(*pooled));
    Mutex mu;
    std::vector<std::string> got(expected.size());
    size_t answered = 0;
    for (int64_t t = 0; t < kSteps; ++t) {
      const size_t first_reply = t * partitions.size();
      // Every partition's pushes, then wait for the step's replies.
      for (size_t i = 0; i < partitions.size(); ++i) {
        for (uint32_t r = 0; r < 3; ++r) {
          pooled->Push(Args(t, r, partitions[i]),
                       [&, slot = first_reply + i,
                        r](absl::StatusOr<std::shared_ptr<const Reply>> reply) {
                         MutexLock lock(&mu);
                         ASSERT_TRUE(reply.ok()) << reply.status();
                         if (r == 0) got[slot] = (*reply)->payload;
                         ++answered;
                       });
        }
      }
      MutexLock lock(&mu);
      struct Wait {
        const size_t* answered;
        size_t want;
      } wait{&answered, 3 * (first_reply + partitions.size())};
      mu.Await(absl::Condition(
          +[](Wait* w) { return *w->answered == w->want; }, &wait));
    }
    EXPECT_EQ(got, expected);
    EXPECT_EQ(pooled->Status().completed_steps, kSteps);
    EXPECT_EQ(pooled->MirrorChecksum(), expected_mirror);
  }
}

TEST_F(ShardCoreTest, EveryWorkerGetsTheSameReplyAndRetriesToo) {
  std::vector<std::shared_ptr<const Reply>> got(3);
  std::vector<absl::Status> status(3, absl::UnknownError("none"));
  for (uint32_t r = 0; r < 3; ++r) {
    core_->Push(Args(0, r, first()),
                [&, r](absl::StatusOr<std::shared_ptr<const Reply>> reply) {
                  status[r] = reply.status();
                  if (reply.ok()) got[r] = *reply;
                });
  }
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_EQ(got[r]->payload, got[0]->payload);
  }
  std::shared_ptr<const Reply> retry;
  ASSERT_TRUE(Push(Args(0, 2, first()), &retry).ok());
  EXPECT_EQ(retry->payload, got[0]->payload);
  PushArgs changed = Args(0, 2, first());
  changed.payload[5] ^= 1;
  EXPECT_EQ(Push(changed).code(), absl::StatusCode::kFailedPrecondition);
}

// Finite but huge scales whose average overflows: the recompression fails
// in the partition's last block, after the blocks before it were encoded.
// The step is refused and the server error buffer is exactly as before, so
// the same step pushed again with sane data gives a fresh shard's reply.
TEST_F(ShardCoreTest, AFailedRecompressionLeavesTheServerErrorAlone) {
  // With the zero-variance mask (a temporary error, committed on success)
  // and without it (the error updated in place, so restored on failure).
  for (bool mask : {true, false}) {
    SCOPED_TRACE(mask ? "mask" : "no mask");
    SetUp();
    job_.algorithm.mask_zero_variance = mask;
    core_ = *ShardCore::Create(job_, 1);
    ASSERT_NO_FATAL_FAILURE(InitializeAll(*core_));
    for (int64_t step : {0, 1}) {
      for (uint32_t r = 0; r < 3; ++r)
        ASSERT_NE(Push(Args(step, r, first())).code(),
                  absl::StatusCode::kInternal);
    }
    const double error_before = core_->ServerErrorNorm();
    ASSERT_GT(error_before, 0.0);
    absl::Status last;
    for (uint32_t r = 0; r < 3; ++r) {
      PushArgs huge = Args(2, r, first());
      const float scale = 3e38f;  // finite; three of them sum to Inf
      std::memcpy(huge.payload.data() + 4 * 3, &scale, 4);  // block 3 of 4
      last = Push(std::move(huge));
    }
    EXPECT_EQ(last.code(), absl::StatusCode::kInternal) << last;
    EXPECT_NE(last.message().find("recompression failed"),
              absl::string_view::npos)
        << last;
    EXPECT_EQ(core_->ServerErrorNorm(), error_before);

    // The same step again with sane pushes: a fresh shard's reply.
    std::shared_ptr<const Reply> again;
    for (uint32_t r = 0; r < 3; ++r) (void)Push(Args(2, r, first()), &again);
    auto fresh_core = *ShardCore::Create(job_, 1);
    std::swap(core_, fresh_core);
    ASSERT_NO_FATAL_FAILURE(InitializeAll(*core_));
    std::shared_ptr<const Reply> fresh;
    for (int64_t step : {0, 1, 2}) {
      for (uint32_t r = 0; r < 3; ++r)
        (void)Push(Args(step, r, first()), &fresh);
    }
    ASSERT_NE(again, nullptr);
    ASSERT_NE(fresh, nullptr);
    EXPECT_EQ(again->payload, fresh->payload);
  }
}

TEST_F(ShardCoreTest, APendingPushResentWithOtherBytesIsRejected) {
  core_->Push(Args(0, 0, first()), [](auto) {});
  PushArgs changed = Args(0, 0, first());
  changed.payload[0] ^= 1;
  EXPECT_EQ(Push(changed).code(), absl::StatusCode::kFailedPrecondition);
  // The original push still completes with the others.
  ASSERT_TRUE(Push(Args(0, 1, first())).code() == absl::StatusCode::kUnknown);
  EXPECT_TRUE(Push(Args(0, 2, first())).ok());
}

// Per-step learning rate and weight decay (PyTorch's param_groups): every
// push of a partition and step must carry the same values, bad values are
// refused, and the mirror applies what the pushes carried.
TEST_F(ShardCoreTest, StepHyperParametersMustAgreeAndReachTheMirror) {
  const compress::StepHyper hyper{0.5f, 0.01f};
  PushArgs bad = Args(0, 0, first());
  bad.hyper = compress::StepHyper{-1.0f, 0.0f};
  EXPECT_EQ(Push(bad).code(), absl::StatusCode::kInvalidArgument);
  bad.hyper =
      compress::StepHyper{std::numeric_limits<float>::quiet_NaN(), 0.0f};
  EXPECT_EQ(Push(bad).code(), absl::StatusCode::kInvalidArgument);

  PushArgs a = Args(0, 0, first());
  a.hyper = hyper;
  EXPECT_EQ(Push(a).code(),
            absl::StatusCode::kUnknown);  // waits for the others
  PushArgs other = Args(0, 1, first());
  other.hyper = compress::StepHyper{0.25f, 0.01f};
  const absl::Status refused = Push(other);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("same learning rate"),
            absl::string_view::npos)
      << refused;
  PushArgs none = Args(0, 1, first());  // the schedule, against rank 0's values
  EXPECT_EQ(Push(none).code(), absl::StatusCode::kFailedPrecondition);
  for (uint32_t r = 1; r < 3; ++r) {
    PushArgs same = Args(0, r, first());
    same.hyper = hyper;
    EXPECT_EQ(Push(same).ok(), r == 2);
  }
  // A second shard that saw the same pushes without the values applies the
  // schedule's lr instead: its mirror differs.
  std::unique_ptr<ShardCore> plain;
  ASSERT_NO_FATAL_FAILURE(plain = StepZeroWith(std::nullopt));
  EXPECT_NE(plain->MirrorChecksum(), core_->MirrorChecksum());
}

// A group added mid-job (StepHyper::first_step, design.md 2.1): a push of a
// step before its first is refused, and every push of a partition and step
// must say the same first step, as the same lr. (onebit_adam takes one
// before its freeze_step, here 1: OneBitOptionsTest; adam at any step.)
TEST_F(ShardCoreTest, AGroupsFirstStepMustAgreeAndNotComeAfterThePush) {
  PushArgs frozen = Args(1, 0, first());
  frozen.hyper = compress::StepHyper{0.5f, 0.01f, std::nullopt, 1};
  const absl::Status refused_frozen = Push(frozen);
  EXPECT_EQ(refused_frozen.code(), absl::StatusCode::kInvalidArgument)
      << refused_frozen;
  EXPECT_NE(refused_frozen.message().find("freeze_step 1"),
            absl::string_view::npos)
      << refused_frozen;
  job_ = *proto::ParseJobConfig(absl::StrCat(kConfig, R"(optimizer: "adam")"),
                                proto::ConfigFormat::kText);
  core_ = *ShardCore::Create(job_, 1);
  InitializeAll(*core_);
  PushArgs early = Args(0, 0, first());
  early.hyper = compress::StepHyper{0.5f, 0.01f, std::nullopt, 1};
  const absl::Status refused_early = Push(early);
  EXPECT_EQ(refused_early.code(), absl::StatusCode::kInvalidArgument)
      << refused_early;
  EXPECT_NE(refused_early.message().find("since step 1"),
            absl::string_view::npos)
      << refused_early;
  for (uint32_t r = 0; r < 3; ++r) {
    PushArgs plain = Args(0, r, first());
    plain.hyper = compress::StepHyper{0.5f, 0.01f};
    EXPECT_EQ(Push(plain).ok(), r == 2);
  }
  const compress::StepHyper added{0.5f, 0.01f, std::nullopt, 1};
  PushArgs a = Args(1, 0, first());
  a.hyper = added;
  EXPECT_EQ(Push(a).code(), absl::StatusCode::kUnknown);  // waits
  PushArgs other = Args(1, 1, first());
  other.hyper = compress::StepHyper{0.5f, 0.01f};
  const absl::Status refused = Push(other);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("training since step 1"),
            absl::string_view::npos)
      << refused;
  for (uint32_t r = 1; r < 3; ++r) {
    PushArgs same = Args(1, r, first());
    same.hyper = added;
    EXPECT_EQ(Push(same).ok(), r == 2);
  }
}

// Betas and eps set by the workers (a scheduler that cycles the momentum):
// every optimizer's but diloco's, so a push that carries them there is
// refused; for adam every push of a partition and step must carry the
// same, bad values are refused, and the mirror applies them.
TEST_F(ShardCoreTest, StepMomentsAreAdamsAndMustAgree) {
  const compress::StepHyper hyper{0.5f, 0.01f,
                                  compress::StepMoments{0.8f, 0.99f, 1e-6f}};
  PushArgs onebit = Args(0, 0, first());
  onebit.hyper = hyper;
  EXPECT_EQ(Push(onebit).code(), absl::StatusCode::kUnknown);  // waits
  // The same job under another optimizer, on a fresh shard 1.
  const auto restart_as = [&](const std::string& optimizer) {
    job_ = *proto::ParseJobConfig(
        absl::StrCat("workers: 3 shards: 2 synthetic { dim: 300 } lr { lr: "
                     "0.01 } steps: 10 block_elems: 16 partition_elems: 64 ",
                     optimizer),
        proto::ConfigFormat::kText);
    core_ = *ShardCore::Create(job_, 1);
    InitializeAll(*core_);
  };
  restart_as(R"(optimizer: "onebit_lamb" freeze_step: 2)");
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  PushArgs lamb = Args(0, 0, first());
  lamb.hyper = hyper;
  EXPECT_EQ(Push(lamb).code(), absl::StatusCode::kUnknown);  // waits
  restart_as(R"(optimizer: "diloco" diloco { sync_every: 2 })");
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  PushArgs diloco = Args(0, 0, first());
  diloco.hyper = hyper;
  const absl::Status refused_here = Push(diloco);
  EXPECT_EQ(refused_here.code(), absl::StatusCode::kInvalidArgument)
      << refused_here;
  EXPECT_NE(
      refused_here.message().find("betas and eps set for a step of diloco"),
      absl::string_view::npos)
      << refused_here;

  restart_as(R"(optimizer: "adam")");
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  PushArgs bad = Args(0, 0, first());
  bad.hyper = hyper;
  bad.hyper->moments->beta1 = 1.0f;
  EXPECT_EQ(Push(bad).code(), absl::StatusCode::kInvalidArgument);
  PushArgs a = Args(0, 0, first());
  a.hyper = hyper;
  EXPECT_EQ(Push(a).code(), absl::StatusCode::kUnknown);  // waits
  PushArgs other = Args(0, 1, first());
  other.hyper = hyper;
  other.hyper->moments->eps = 1e-5f;
  const absl::Status refused = Push(other);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("betas (0.8, 0.99) and eps 1e-06"),
            absl::string_view::npos)
      << refused;
  PushArgs without = Args(0, 1, first());  // the job's betas and eps
  without.hyper = compress::StepHyper{0.5f, 0.01f};
  EXPECT_EQ(Push(without).code(), absl::StatusCode::kFailedPrecondition);
  for (uint32_t r = 1; r < 3; ++r) {
    PushArgs same = Args(0, r, first());
    same.hyper = hyper;
    EXPECT_EQ(Push(same).ok(), r == 2);
  }
  // The same pushes with the job's betas and eps: another mirror.
  std::unique_ptr<ShardCore> plain;
  ASSERT_NO_FATAL_FAILURE(plain =
                              StepZeroWith(compress::StepHyper{0.5f, 0.01f}));
  EXPECT_NE(plain->MirrorChecksum(), core_->MirrorChecksum());
}

// Replies go out before the mirror applies them; whatever reads the mirror
// in between (a checkpoint, FetchPartition, a checksum, here from inside the
// last reply's callback) sees the whole step.
// Step 0's pushes carry the hash of the worker's x over the partition
// (PushRequest.x_hash): one from another model is FAILED_PRECONDITION and
// changes nothing; the job's model (InitializeAll's) is taken; later steps
// carry none.
TEST_F(ShardCoreTest, AStepZeroPushFromAnotherModelIsRefused) {
  const compress::Partition& p = first();
  const std::vector<float> x0 =
      compress::testing::VariedData(p.range.size(), p.id);
  const uint64_t job_hash =
      compress::BytesHash(x0.data(), x0.size() * sizeof(float));
  PushArgs other = Args(0, 1, p);
  other.x_hash = job_hash ^ 1;
  const absl::Status refused = Push(std::move(other));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("rank 1's parameters in partition"),
            std::string::npos)
      << refused;
  EXPECT_NE(refused.message().find("load them on every rank"),
            std::string::npos)
      << refused;
  std::vector<std::shared_ptr<const Reply>> got(3);
  for (uint32_t rank = 0; rank < 3; ++rank) {
    PushArgs args = Args(0, rank, p);
    args.x_hash = job_hash;
    const absl::Status s = Push(std::move(args), &got[rank]);
    EXPECT_EQ(s.ok(), rank == 2) << s;  // rank 1's refused push never counted
  }
  ASSERT_NE(got[2], nullptr);
  const auto after = core_->FetchPartition(p.id, fingerprint());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->completed_steps, 1);
}

// Weights changed after a step (ReplaceX, design.md 4): rank 0 replaces a
// partition's x alone between two steps; m and v go on; the next step's
// pushes must carry the new x's hash; anything else is refused and
// changes nothing; once every partition of the shard is replaced the
// replace observer runs (the runtime's checkpoint).
TEST_F(ShardCoreTest, WeightsChangedAfterAStepReplaceXAloneAndAreChecked) {
  const compress::Partition& p = first();
  const uint64_t n = p.range.size();
  for (uint32_t rank = 0; rank < 3; ++rank)
    ASSERT_EQ(Push(Args(0, rank, p)).ok(), rank == 2);  // the last answers
  const PartitionSnapshot before = *core_->FetchPartition(p.id, fingerprint());
  ASSERT_EQ(before.completed_steps, 1);
  std::vector<float> changed = before.x;
  for (float& f : changed) f = std::min(std::max(f, -0.01f), 0.01f);
  ASSERT_NE(changed, before.x);
  int64_t observed = -1;
  int observations = 0;
  core_->SetChangeObserver(
      [&](int64_t step, const ShardCore&, absl::string_view) {
        observed = step;
        ++observations;
      });

  const auto code = [&](uint32_t rank, int64_t step,
                        absl::Span<const float> x) {
    return core_->ReplaceX(rank, p.id, fingerprint(), step, x).code();
  };
  EXPECT_EQ(code(1, 1, changed), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(code(0, 0, changed), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(code(0, 2, changed), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(code(0, 1, absl::MakeSpan(changed).subspan(1)),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> nan = changed;
  nan[n / 2] = std::nanf("");
  EXPECT_EQ(code(0, 1, nan), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->FetchPartition(p.id, fingerprint())->x, before.x)
      << "a refused replacement changed x";

  ASSERT_TRUE(core_->ReplaceX(0, p.id, fingerprint(), 1, changed).ok());
  EXPECT_TRUE(core_->ReplaceX(0, p.id, fingerprint(), 1, changed).ok())
      << "the same x again (rank 0 replaying)";
  const PartitionSnapshot after = *core_->FetchPartition(p.id, fingerprint());
  EXPECT_EQ(after.completed_steps, 1);
  EXPECT_EQ(after.x, changed);
  EXPECT_EQ(after.m, before.m);
  EXPECT_EQ(after.v, before.v);
  EXPECT_EQ(observations, 0) << "the shard's other partitions are not in";
  // A worker asking whether the shards hold its x gets x's hash alone.
  const uint64_t hash = compress::BytesHash(changed.data(), n * sizeof(float));
  const PartitionSnapshot hashed = *core_->FetchPartition(
      p.id, fingerprint(), {.model = false, .x_hash = true});
  EXPECT_EQ(hashed.completed_steps, 1);
  EXPECT_EQ(hashed.x_hash, hash);
  EXPECT_TRUE(hashed.x.empty() && hashed.m.empty() && hashed.v.empty());

  // Step 1: a push without the hash, or of another x, is refused.
  const absl::Status unchanged = Push(Args(1, 1, p));
  EXPECT_EQ(unchanged.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(unchanged.message().find("rank 1 did not"), std::string::npos)
      << unchanged;
  PushArgs other = Args(1, 2, p);
  other.x_hash = compress::BytesHash(before.x.data(), n * sizeof(float));
  const absl::Status differs = Push(std::move(other));
  EXPECT_EQ(differs.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(differs.message().find("same way on every rank"), std::string::npos)
      << differs;
  for (uint32_t rank = 0; rank < 3; ++rank) {
    PushArgs args = Args(1, rank, p);
    args.x_hash = hash;
    const absl::Status s = Push(std::move(args));
    EXPECT_EQ(s.ok(), rank == 2) << s;
  }
  EXPECT_EQ(core_->FetchPartition(p.id, fingerprint())->completed_steps, 2);

  // Step 2: a push of it is in before rank 0's replacement.
  core_->Push(Args(2, 1, p), [](auto) {});
  const absl::Status late = core_->ReplaceX(0, p.id, fingerprint(), 2, changed);
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(late.message().find("rank 1 pushed step 2"), std::string::npos)
      << late;
  // Unless the change left the partition as it was: another rank found
  // the shards holding its weights once rank 0 had given the partitions
  // that changed, and pushed.
  const std::vector<float> now = core_->FetchPartition(p.id, fingerprint())->x;
  const absl::Status kept = core_->ReplaceX(0, p.id, fingerprint(), 2, now);
  EXPECT_TRUE(kept.ok()) << kept;
  EXPECT_EQ(core_->FetchPartition(p.id, fingerprint())->x, now);

  // Every partition of the shard replaced at one step: the observer, once.
  auto fresh = *ShardCore::Create(job_, 1);
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*fresh));
  fresh->SetChangeObserver(
      [&](int64_t step, const ShardCore&, absl::string_view) {
        observed = step;
        ++observations;
      });
  const auto& all = fresh->layout().shard_partitions(1);
  for (const compress::Partition& q : all) {
    for (uint32_t rank = 0; rank < 3; ++rank)
      fresh->Push(Args(0, rank, q), [](auto) {});
  }
  for (const compress::Partition& q : all) {
    EXPECT_EQ(observations, 0);
    const std::vector<float> x(q.range.size(), 0.5f);
    ASSERT_TRUE(fresh->ReplaceX(0, q.id, fingerprint(), 1, x).ok());
  }
  EXPECT_EQ(observations, 1);
  EXPECT_EQ(observed, 1);
}

TEST_F(ShardCoreTest, TheShardAnswersFirstAndReadersSeeTheWholeStep) {
  const auto& partitions = core_->layout().shard_partitions(1);
  ASSERT_GE(partitions.size(), 2u);
  for (const auto& p : partitions) {
    for (uint32_t r = 0; r < 3; ++r) {
      if (&p == &partitions.back() && r == 2) continue;
      core_->Push(Args(0, r, p), [](auto) {});
    }
  }
  const std::string path = ::testing::TempDir() + "/answers_first.ckpt";
  absl::Status saved = absl::UnknownError("callback not run");
  PartitionSnapshot inside;
  uint64_t checksum_inside = 0;
  core_->Push(Args(0, 2, partitions.back()),
              [&](absl::StatusOr<std::shared_ptr<const Reply>> reply) {
                ASSERT_TRUE(reply.ok()) << reply.status();
                saved = core_->SaveCheckpoint(path);
                inside =
                    *core_->FetchPartition(partitions.back().id, fingerprint());
                checksum_inside = core_->MirrorChecksum();
              });
  ASSERT_TRUE(saved.ok()) << saved;
  const PartitionSnapshot after =
      *core_->FetchPartition(partitions.back().id, fingerprint());
  EXPECT_EQ(inside.completed_steps, 1);
  EXPECT_EQ(inside.x, after.x);
  EXPECT_EQ(inside.m, after.m);
  EXPECT_EQ(checksum_inside, core_->MirrorChecksum());
  auto restored = *ShardCore::Create(job_, 1);
  ASSERT_TRUE(restored->RestoreCheckpoint(path).ok());
  EXPECT_EQ(restored->MirrorChecksum(), core_->MirrorChecksum());
  // And the mirror did move: a step was applied.
  auto fresh = *ShardCore::Create(job_, 1);
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*fresh));
  EXPECT_NE(fresh->MirrorChecksum(), core_->MirrorChecksum());
}

TEST_F(ShardCoreTest, OnlyTheLastCompletedStepIsKept) {
  for (int64_t step = 0; step < 3; ++step) {
    for (uint32_t r = 0; r < 3; ++r)
      core_->Push(Args(step, r, first()), [](auto) {});
  }
  EXPECT_TRUE(Push(Args(2, 0, first())).ok());
  EXPECT_EQ(Push(Args(1, 0, first())).code(),
            absl::StatusCode::kFailedPrecondition);
}

// With checkpoint.replay_steps = K the shard keeps the replies of its last
// K completed steps: a restarted worker replaying from its checkpoint gets
// each step's reply again if it pushes the same bytes, and a clear refusal
// for other bytes or a step no longer kept. Nothing changes either way.
TEST_F(ShardCoreTest, TheLastReplayStepsRepliesAreKeptForRestartedWorkers) {
  job_ = *proto::ParseJobConfig(
      std::string(kConfig) + "checkpoint { every_steps: 2 }",
      proto::ConfigFormat::kText);
  ASSERT_EQ(job_.replay_steps, 3u);
  core_ = *ShardCore::Create(job_, 1);
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*core_));
  std::vector<std::shared_ptr<const Reply>> replies;
  for (int64_t step = 0; step < 6; ++step) {
    std::shared_ptr<const Reply> reply;
    for (uint32_t r = 0; r < 3; ++r)
      ASSERT_EQ(Push(Args(step, r, first()), &reply).ok(), r == 2);
    replies.push_back(reply);
  }
  const uint64_t mirror = core_->MirrorChecksum();
  for (int64_t step :
       {3, 4, 5}) {  // steps 3 and 4 from the history, 5 the last
    for (uint32_t r = 0; r < 3; ++r) {
      std::shared_ptr<const Reply> again;
      ASSERT_TRUE(Push(Args(step, r, first()), &again).ok()) << step;
      EXPECT_EQ(again->payload, replies[step]->payload) << step;
    }
  }
  PushArgs other = Args(4, 1, first());
  other.payload[0] ^= 1;
  const absl::Status changed = Push(std::move(other));
  EXPECT_EQ(changed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(changed.message().find("with other bytes than it pushed then"),
            std::string::npos)
      << changed;
  const absl::Status gone = Push(Args(2, 1, first()));
  EXPECT_EQ(gone.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(gone.message().find("keeps the replies of steps 3 on"),
            std::string::npos)
      << gone;
  EXPECT_EQ(core_->MirrorChecksum(), mirror);
  EXPECT_EQ(core_->Status().completed_steps,
            0);  // the other partitions never stepped
  // The next step goes on as before.
  for (uint32_t r = 0; r < 3; ++r)
    EXPECT_EQ(Push(Args(6, r, first())).ok(), r == 2);
}

TEST_F(ShardCoreTest, InitializationRules) {
  auto fresh = *ShardCore::Create(job_, 0);
  const auto& p = fresh->layout().shard_partitions(0)[0];
  const std::vector<float> x0(p.range.size(), 1.0f);
  const absl::string_view bytes(reinterpret_cast<const char*>(x0.data()),
                                4 * x0.size());
  // Pushes wait for initial values.
  absl::Status status;
  fresh->Push(Args(0, 0, p), [&](auto r) { status = r.status(); });
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(fresh->InitPartition(1, p.id, fingerprint(), bytes).code(),
            absl::StatusCode::kFailedPrecondition);  // only rank 0
  EXPECT_EQ(
      fresh->InitPartition(0, p.id, fingerprint(), bytes.substr(4)).code(),
      absl::StatusCode::kInvalidArgument);
  std::vector<float> nan = x0;
  nan[3] = NAN;
  EXPECT_EQ(fresh
                ->InitPartition(
                    0, p.id, fingerprint(),
                    {reinterpret_cast<const char*>(nan.data()), bytes.size()})
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(fresh->InitPartition(0, p.id, fingerprint(), bytes).ok());
  EXPECT_TRUE(
      fresh->InitPartition(0, p.id, fingerprint(), bytes).ok());  // idempotent
  std::vector<float> other = x0;
  other[0] = 2.0f;
  EXPECT_EQ(fresh
                ->InitPartition(
                    0, p.id, fingerprint(),
                    {reinterpret_cast<const char*>(other.data()), bytes.size()})
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fresh->Status().partitions_initialized, 1u);
}

TEST_F(ShardCoreTest, TheObserverSeesEveryStepOnceInOrder) {
  std::vector<int64_t> seen;
  core_->SetStepObserver(
      [&](int64_t step, const ShardCore&) { seen.push_back(step); });
  for (int64_t step = 0; step < 3; ++step) {
    for (const auto& p : core_->layout().shard_partitions(1)) {
      for (uint32_t r = 0; r < 3; ++r)
        core_->Push(Args(step, r, p), [](auto) {});
    }
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(core_->Status().completed_steps, 3);
}

TEST_F(ShardCoreTest, ExpiredStepsFailTheirWaitersAndLeaveTheShardAlone) {
  const uint64_t before = core_->MirrorChecksum();
  absl::Status status;
  core_->Push(Args(0, 0, first()), [&](auto r) { status = r.status(); });
  core_->ExpireWaiting(absl::Now());  // not yet
  EXPECT_TRUE(status.ok());
  // Past the step timeout the step is only reported as stalled...
  EXPECT_FALSE(core_->Stalled(absl::Now()).has_value());
  const absl::Time late =
      absl::Now() + absl::Seconds(job_.step_timeout_seconds + 1);
  const std::optional<std::string> stalled = core_->Stalled(late);
  ASSERT_TRUE(stalled.has_value());
  EXPECT_NE(stalled->find("for rank(s) 1, 2"), std::string::npos) << *stalled;
  core_->ExpireWaiting(late);
  EXPECT_TRUE(status.ok());
  // ...and fails past the recovery timeout.
  core_->ExpireWaiting(absl::Now() +
                       absl::Seconds(job_.recovery_timeout_seconds + 1));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(status.message().find("rank(s) 1, 2 did not push"),
            absl::string_view::npos)
      << status;
  EXPECT_EQ(core_->MirrorChecksum(), before);
}

// Shard 1 of an elastic job of 3 workers (min_workers 2: a step waits
// step_seconds 1 for the missing), every partition initialized; pushes of
// its first partition, and each rank's last answer.
struct ElasticShard {
  std::optional<proto::JobSpec> job;
  std::unique_ptr<ShardCore> core;
  const compress::Partition* p = nullptr;
  uint64_t fingerprint = 0;
  std::vector<absl::StatusOr<std::shared_ptr<const Reply>>> got =
      std::vector<absl::StatusOr<std::shared_ptr<const Reply>>>(
          3, absl::UnknownError("pending"));

  PushArgs Args(int64_t step, uint32_t rank) const {
    return EncodedPush(fingerprint, compress::PlanStep(job->algorithm, step).up,
                       step, rank, *p);
  }
  void Push(PushArgs args) {
    const uint32_t rank = args.rank;
    got[rank] = absl::UnknownError("pending");
    core->Push(std::move(args), [this, rank](auto r) { got[rank] = r; });
  }
};

void MakeElasticShard(ElasticShard* shard) {
  auto job = proto::ParseJobConfig(
      absl::StrCat(kConfig,
                   "min_workers: 2 timeouts { step_seconds: 1 "
                   "recovery_seconds: 5 } checkpoint { replay_steps: 4 }"),
      proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  shard->job = *std::move(job);
  shard->core = *ShardCore::Create(*shard->job, 1);
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*shard->core));
  shard->p = &shard->core->layout().shard_partitions(1)[0];
  shard->fingerprint = shard->core->layout().fingerprint();
}

// An elastic job (min_workers 2 of 3; design.md 4, "Membership"): a step that
// has waited step_seconds completes with the pushes it has, averaged over them
// alone; the missing rank leaves the membership (the next step does not
// wait for it), its late pushes get their steps' replies whatever its
// bytes, and bring it back: the step in flight waits for it. Below min_workers
// the step fails at the recovery timeout, naming the missing and min_workers.
TEST(ElasticShardTest, AStepCompletesWithoutTheMissingWhoComeBackByPushing) {
  ElasticShard shard;
  ASSERT_NO_FATAL_FAILURE(MakeElasticShard(&shard));
  const std::optional<proto::JobSpec>& job = shard.job;
  ShardCore* const core = shard.core.get();
  const compress::Partition& p = *shard.p;
  const auto args = [&](int64_t step, uint32_t rank) {
    return shard.Args(step, rank);
  };
  std::vector<absl::StatusOr<std::shared_ptr<const Reply>>>& got = shard.got;
  const auto push = [&](int64_t step, uint32_t rank) {
    shard.Push(args(step, rank));
  };
  // Step 0: ranks 0 and 1 push; rank 2 does not. (Times are taken before
  // the pushes they bound, so that a slow machine cannot pass a deadline
  // between a push and the check.)
  const absl::Time step0_start = absl::Now();
  push(0, 0);
  push(0, 1);
  EXPECT_TRUE(core->ExpireWaiting(step0_start).empty());  // not yet
  const std::vector<std::string> changes =
      core->ExpireWaiting(absl::Now() + absl::Seconds(2));
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_NE(changes[0].find("step 0 completed without rank(s) 2 in partition"),
            std::string::npos)
      << changes[0];
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  ASSERT_TRUE(got[1].ok()) << got[1].status();
  EXPECT_EQ(*got[0], *got[1]);
  EXPECT_EQ((*got[0])->absent, std::vector<uint32_t>{2});
  const std::shared_ptr<const Reply> step0 = *got[0];
  // The average is over the two pushes that came: the shard's rule on them.
  {
    const compress::StepPlan plan = compress::PlanStep(job->algorithm, 0);
    const compress::SendRule down =
        compress::PlanSend(job->algorithm, 0, compress::Direction::kDown,
                           job->workers() + 1, p.range.begin);
    std::vector<PushArgs> pushes = {args(0, 0), args(0, 1)};
    std::vector<absl::Span<const uint8_t>> views;
    for (const PushArgs& a : pushes) {
      views.emplace_back(reinterpret_cast<const uint8_t*>(a.payload.data()),
                         a.payload.size());
    }
    compress::ErrorFeedback error(job->algorithm.server_feedback,
                                  core->layout().shard_range(1).size(),
                                  job->algorithm.layout.block_elems);
    std::vector<uint8_t> expected(
        compress::PayloadBytes(down.codec, p.range.size()));
    ASSERT_TRUE(compress::EncodeShardReply(
                    down, plan.up, views, error,
                    p.range.begin - core->layout().shard_range(1).begin,
                    p.range.size(), {}, absl::MakeSpan(expected))
                    .ok());
    EXPECT_EQ((*got[0])->payload,
              std::string(expected.begin(), expected.end()));
  }
  {
    // The same step re-sent to a shard restarted from before it (DESIGN 4),
    // each push with the membership its reply had: the step completes
    // without rank 2 at once, rank 2's own re-send counts for nothing, and
    // the reply is the one the workers applied.
    auto restarted = *ShardCore::Create(*job, 1);
    ASSERT_NO_FATAL_FAILURE(InitializeAll(*restarted));
    std::vector<absl::StatusOr<std::shared_ptr<const Reply>>> again(
        3, absl::UnknownError("pending"));
    for (uint32_t rank : {2u, 0u, 1u}) {
      PushArgs replay = args(0, rank);
      replay.replay_absent = std::vector<uint32_t>{2};
      restarted->Push(std::move(replay),
                      [&again, rank](auto r) { again[rank] = r; });
      EXPECT_EQ(again[0].ok(), rank == 1u);
    }
    for (uint32_t rank = 0; rank < 3; ++rank) {
      ASSERT_TRUE(again[rank].ok()) << rank << ": " << again[rank].status();
      EXPECT_EQ((*again[rank])->payload, step0->payload);
      EXPECT_EQ((*again[rank])->absent, std::vector<uint32_t>{2});
    }
    PushArgs bad = args(1, 0);
    bad.replay_absent = std::vector<uint32_t>{2, 1};  // not ascending
    absl::Status refused;
    restarted->Push(std::move(bad), [&](auto r) { refused = r.status(); });
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  }
  ShardStatus status = core->Status();
  EXPECT_EQ(status.out, std::vector<uint32_t>{2});
  EXPECT_EQ(status.workers_dropped, 1u);
  // Step 1 completes with ranks 0 and 1 alone, without waiting.
  push(1, 0);
  EXPECT_FALSE(got[0].ok());
  push(1, 1);
  ASSERT_TRUE(got[1].ok()) << got[1].status();
  EXPECT_EQ((*got[1])->absent, std::vector<uint32_t>{2});
  const std::shared_ptr<const Reply> step1 = *got[1];
  // Rank 2 catches up, its pushes late: the replies of those steps,
  // whatever its bytes; and from then on the step in flight waits for it.
  push(0, 2);
  ASSERT_TRUE(got[2].ok()) << got[2].status();
  EXPECT_EQ(*got[2], step0);
  push(1, 2);
  ASSERT_TRUE(got[2].ok()) << got[2].status();
  EXPECT_EQ(*got[2], step1);
  push(2, 0);
  push(2, 1);
  EXPECT_FALSE(got[1].ok());
  push(2, 2);
  ASSERT_TRUE(got[2].ok()) << got[2].status();
  EXPECT_TRUE((*got[2])->absent.empty());
  EXPECT_TRUE(core->Status().out.empty());
  // Step 3 with one push, fewer than min_workers: only the recovery
  // timeout ends it, as a failure.
  const absl::Time step3_start = absl::Now();
  push(3, 0);
  EXPECT_TRUE(core->ExpireWaiting(step3_start + absl::Seconds(2)).empty());
  EXPECT_FALSE(got[0].ok());
  EXPECT_EQ(got[0].status().code(), absl::StatusCode::kUnknown);  // pending
  const std::optional<std::string> stalled =
      core->Stalled(absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(stalled.has_value());
  EXPECT_NE(stalled->find("fewer than min_workers (2)"), std::string::npos)
      << *stalled;
  const uint64_t before = core->MirrorChecksum();
  EXPECT_TRUE(core->ExpireWaiting(absl::Now() + absl::Seconds(6)).empty());
  EXPECT_EQ(got[0].status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(got[0].status().message().find(
                "rank(s) 1, 2 did not push, and the 1 that did are fewer "
                "than min_workers (2)"),
            absl::string_view::npos)
      << got[0].status();
  EXPECT_EQ(core->MirrorChecksum(), before);
}

// Weights changed after a step in an elastic job (ReplaceX): rank 0 gives
// them as in any job; a rank left out of the step after the change shows
// with its late push that it changed them the same way (its push has no
// bytes of its own to be checked against), or is refused.
TEST(ElasticShardTest, ALeftOutRanksLatePushShowsTheChangedWeights) {
  ElasticShard shard;
  ASSERT_NO_FATAL_FAILURE(MakeElasticShard(&shard));
  ShardCore* const core = shard.core.get();
  const compress::Partition& p = *shard.p;
  const uint64_t fingerprint = shard.fingerprint;
  const auto args = [&](int64_t step, uint32_t rank) {
    return shard.Args(step, rank);
  };
  std::vector<absl::StatusOr<std::shared_ptr<const Reply>>>& got = shard.got;
  const auto push = [&](PushArgs a) { shard.Push(std::move(a)); };
  // Step 0 without rank 2.
  push(args(0, 0));
  push(args(0, 1));
  ASSERT_EQ(core->ExpireWaiting(absl::Now() + absl::Seconds(2)).size(), 1u);
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  const std::shared_ptr<const Reply> step0 = *got[0];
  // Rank 0 changes the weights before step 1.
  std::vector<float> changed = core->FetchPartition(p.id, fingerprint)->x;
  for (float& f : changed) f = std::min(std::max(f, -0.01f), 0.01f);
  const absl::Status replaced =
      core->ReplaceX(0, p.id, fingerprint, 1, changed);
  ASSERT_TRUE(replaced.ok()) << replaced;
  EXPECT_EQ(core->FetchPartition(p.id, fingerprint)->x, changed);
  const uint64_t hash = compress::XHash(changed);
  for (uint32_t rank : {0u, 1u}) {
    PushArgs a = args(1, rank);
    a.x_hash = hash;
    push(std::move(a));
  }
  ASSERT_TRUE(got[1].ok()) << got[1].status();
  const std::shared_ptr<const Reply> step1 = *got[1];
  EXPECT_EQ(step1->absent, std::vector<uint32_t>{2});
  // Rank 2 catches up: step 0 as before; step 1 only from the new weights.
  push(args(0, 2));
  ASSERT_TRUE(got[2].ok()) << got[2].status();
  EXPECT_EQ(*got[2], step0);
  push(args(1, 2));
  EXPECT_EQ(got[2].status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(
      got[2].status().message().find(
          "at step 1 (a step completed without it) was computed from the old"),
      absl::string_view::npos)
      << got[2].status();
  PushArgs other = args(1, 2);
  other.x_hash = hash + 1;
  push(std::move(other));
  EXPECT_EQ(got[2].status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(got[2].status().message().find("not the ones rank 0 changed"),
            absl::string_view::npos)
      << got[2].status();
  PushArgs same = args(1, 2);
  same.x_hash = hash;
  push(std::move(same));
  ASSERT_TRUE(got[2].ok()) << got[2].status();
  EXPECT_EQ(*got[2], step1);
}

// Stragglers (design.md 4, "Stragglers"): with timeouts.straggler_seconds a
// step that has min_workers pushes waits that much longer for the others,
// counted from the min_workers-th push, not step_seconds; the late rank
// gets its step's reply and is back in the membership.
TEST(ElasticShardTest, StragglersAreLeftOutStragglerSecondsAfterMinWorkers) {
  auto job = proto::ParseJobConfig(
      absl::StrCat(kConfig,
                   "min_workers: 2 timeouts { step_seconds: 30 "
                   "straggler_seconds: 0.5 recovery_seconds: 60 } "
                   "checkpoint { replay_steps: 4 }"),
      proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  auto core = *ShardCore::Create(*job, 1);
  std::vector<absl::Time> wakeups;
  core->SetWakeup([&](absl::Time t) { wakeups.push_back(t); });
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*core));
  const compress::Partition& p = core->layout().shard_partitions(1)[0];
  const uint64_t fingerprint = core->layout().fingerprint();
  const auto args = [&](int64_t step, uint32_t rank) {
    return EncodedPush(fingerprint, compress::PlanStep(job->algorithm, step).up,
                       step, rank, p);
  };
  std::vector<absl::StatusOr<std::shared_ptr<const Reply>>> got(
      3, absl::UnknownError("pending"));
  const auto push = [&](int64_t step, uint32_t rank) {
    got[rank] = absl::UnknownError("pending");
    core->Push(args(step, rank), [&got, rank](auto r) { got[rank] = r; });
  };
  EXPECT_EQ(core->NextDeadline(), absl::InfiniteFuture());
  push(0, 0);
  EXPECT_TRUE(wakeups.empty());  // one push: below min_workers
  const absl::Time before = absl::Now();
  push(0, 1);
  const absl::Time after = absl::Now();
  // The partition got its deadline from its second push.
  ASSERT_EQ(wakeups.size(), 1u);
  EXPECT_GE(wakeups[0], before + absl::Milliseconds(500));
  EXPECT_LE(wakeups[0], after + absl::Milliseconds(500));
  EXPECT_LE(core->NextDeadline(), wakeups[0]);
  EXPECT_NE(core->NextDeadline(), absl::InfiniteFuture());
  EXPECT_TRUE(core->ExpireWaiting(after).empty());
  EXPECT_FALSE(got[0].ok());  // within the grace
  // Past it, and long before step_seconds: completed without rank 2, with
  // no line of its own (stragglers are counted).
  EXPECT_TRUE(core->ExpireWaiting(after + absl::Seconds(1)).empty());
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ((*got[0])->absent, std::vector<uint32_t>{2});
  ShardStatus status = core->Status();
  EXPECT_EQ(status.out, std::vector<uint32_t>{2});
  EXPECT_EQ(status.straggler_steps, 1u);
  EXPECT_EQ(status.workers_dropped, 1u);
  EXPECT_EQ(core->NextDeadline(), absl::InfiniteFuture());
  // The straggler's push: its step's reply, and back in the membership;
  // step 1 then waits for it.
  push(0, 2);
  ASSERT_TRUE(got[2].ok()) << got[2].status();
  EXPECT_EQ(*got[2], *got[0]);
  EXPECT_TRUE(core->Status().out.empty());
  push(1, 0);
  push(1, 1);
  push(1, 2);
  ASSERT_TRUE(got[2].ok()) << got[2].status();
  EXPECT_TRUE((*got[2])->absent.empty());
  EXPECT_EQ(core->Status().straggler_steps, 1u);
}

// The memberships are in the shard's checkpoints (design.md 4,
// "Membership"): a shard restored from one still leaves out the ranks it had
// left out, so its next step does not wait step_seconds for a rank that is
// gone, and a retry of the last step gets the reply with its absent ranks.
TEST(ElasticShardTest, CheckpointsKeepTheMemberships) {
  auto job = proto::ParseJobConfig(
      absl::StrCat(kConfig,
                   "min_workers: 2 timeouts { step_seconds: 1 "
                   "recovery_seconds: 5 }"),
      proto::ConfigFormat::kText);
  ASSERT_TRUE(job.ok()) << job.status();
  auto core = *ShardCore::Create(*job, 1);
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*core));
  const uint64_t fingerprint = core->layout().fingerprint();
  const auto partitions = core->layout().shard_partitions(1);
  const auto push =
      [&](ShardCore& c, int64_t step, uint32_t rank,
          std::vector<absl::StatusOr<std::shared_ptr<const Reply>>>* got) {
        for (size_t i = 0; i < partitions.size(); ++i) {
          (*got)[i] = absl::UnknownError("pending");
          c.Push(EncodedPush(fingerprint,
                             compress::PlanStep(job->algorithm, step).up, step,
                             rank, partitions[i]),
                 [got, i](auto r) { (*got)[i] = r; });
        }
      };
  std::vector<absl::StatusOr<std::shared_ptr<const Reply>>> got(
      partitions.size(), absl::UnknownError("pending"));
  push(*core, 0, 0, &got);
  push(*core, 0, 1, &got);
  core->ExpireWaiting(absl::Now() + absl::Seconds(2));
  for (const auto& reply : got) {
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ((*reply)->absent, std::vector<uint32_t>{2});
  }
  const std::string path = ::testing::TempDir() + "/memberships.ckpt";
  ASSERT_TRUE(core->SaveCheckpoint(path).ok());
  auto restored = *ShardCore::Create(*job, 1);
  ASSERT_TRUE(restored->RestoreCheckpoint(path).ok());
  EXPECT_EQ(restored->Status().out, std::vector<uint32_t>{2});
  // A retry of step 0: the reply, still without rank 2.
  push(*restored, 0, 1, &got);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    EXPECT_EQ((*got[i])->absent, std::vector<uint32_t>{2});
  }
  // Step 1 completes with ranks 0 and 1 alone, without waiting.
  push(*restored, 1, 0, &got);
  push(*restored, 1, 1, &got);
  for (const auto& reply : got) {
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ((*reply)->absent, std::vector<uint32_t>{2});
  }
  EXPECT_EQ(restored->Status().completed_steps, 2);
}

// A worker whose step failed stops the job: the pushes waiting for it and
// every later push of that step fail at once with its reason, the mirror is
// untouched, a retry of an earlier step still gets its reply, and after a
// Join clears the abort the same step completes as if nothing happened.
TEST_F(ShardCoreTest, AnAbortFailsTheStepForEveryWorkerAndChangesNothing) {
  std::shared_ptr<const Reply> step0;
  for (uint32_t r = 0; r < 3; ++r)
    ASSERT_TRUE(Push(Args(0, r, first()), &step0).ok() || r < 2);
  ASSERT_NE(step0, nullptr);
  const uint64_t before = core_->MirrorChecksum();
  absl::Status waiting;
  core_->Push(Args(1, 0, first()), [&](auto r) { waiting = r.status(); });
  EXPECT_TRUE(waiting.ok());  // not called yet
  EXPECT_EQ(core_->Abort(7, 1, fingerprint(), "x").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->Abort(2, 1, fingerprint() + 1, "x").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(core_->aborted().has_value());
  ASSERT_TRUE(
      core_->Abort(2, 1, fingerprint(), "sign1: a block scale is not finite")
          .ok());
  EXPECT_EQ(waiting.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      waiting.message(),
      "rank 2 stopped the job at step 1: sign1: a block scale is not finite");
  ASSERT_TRUE(core_->Abort(0, 1, fingerprint(), "a second reason")
                  .ok());  // the first wins
  EXPECT_EQ(*core_->aborted(), waiting.message());
  const absl::Status later = Push(Args(1, 1, first()));
  EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(later.message(), waiting.message());
  std::shared_ptr<const Reply> retry;
  ASSERT_TRUE(
      Push(Args(0, 1, first()), &retry).ok());  // step 0 is before the abort
  EXPECT_EQ(retry->payload, step0->payload);
  EXPECT_EQ(core_->MirrorChecksum(), before);

  // The job restarts: a Join clears the abort and step 1 completes from
  // scratch (the aborted step's pushes were dropped).
  core_->ClearAbort();
  std::shared_ptr<const Reply> step1;
  for (uint32_t r = 0; r < 3; ++r) {
    const absl::Status s = Push(Args(1, r, first()), &step1);
    EXPECT_EQ(s.ok(), r == 2) << s;
  }
  ASSERT_NE(step1, nullptr);
  EXPECT_EQ(step1->step, 1);
}

// A shard shutting down (a signal) answers the pushes waiting for other
// workers at once, so that the server's shutdown does not wait on them, and
// refuses later ones; UNAVAILABLE, so that the workers retry against the
// restarted shard. The mirror is unchanged.
TEST_F(ShardCoreTest, AStoppingShardAnswersItsWaitingPushesAndLaterOnes) {
  const uint64_t before = core_->MirrorChecksum();
  absl::Status waiting;
  bool answered = false;
  core_->Push(Args(0, 0, first()), [&](auto r) {
    waiting = r.status();
    answered = true;
  });
  EXPECT_FALSE(answered);  // waits for ranks 1 and 2
  core_->Stop(absl::UnavailableError("shard 0 is shutting down (signal 15)"));
  ASSERT_TRUE(answered);
  EXPECT_EQ(waiting.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(waiting.message(), "shard 0 is shutting down (signal 15)");
  for (uint32_t r = 0; r < 3; ++r)
    EXPECT_EQ(Push(Args(0, r, first())).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(core_->MirrorChecksum(), before);
}

// Gradient clipping in warmup (compress::ClipsAverage): each reply carries
// its partition's sum of squares; the mirror applies the step only once the
// whole model's total arrives (Commit, or the next step's pushes), scaled by
// the clip factor, and until then the step observer waits and checkpoints
// and fetches are refused. Bad totals change nothing.
TEST_F(ShardCoreTest,
       AClippedStepWaitsForTheWholeModelsNormBeforeTheMirrorMoves) {
  std::string config(kConfig);
  config.replace(config.find("freeze_step: 1"), 14,
                 "freeze_step: 3 clip_grad_norm: 0.5");
  job_ = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  ASSERT_EQ(job_.algorithm.clip_grad_norm, 0.5f);
  core_ = *ShardCore::Create(job_, 1);
  const auto parts = core_->layout().shard_partitions(1);
  InitializeAll(*core_);
  compress::Replica expected = InitialReplica(*core_, job_.algorithm);
  std::vector<int64_t> seen;
  core_->SetStepObserver(
      [&](int64_t step, const ShardCore&) { seen.push_back(step); });
  // One step of every partition; `previous` rides on the pushes. Returns
  // the whole model's sum of squares (this shard's plus 3.0 for the other
  // shard's partitions) and the largest partition's own.
  std::vector<std::shared_ptr<const Reply>> replies(parts.size());
  const auto step = [&](int64_t t, std::optional<double> previous,
                        double* largest) {
    double total = 0;
    *largest = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      for (uint32_t r = 0; r < 3; ++r) {
        PushArgs args = Args(t, r, parts[i]);
        args.previous_grad_sum_of_squares = previous;
        const absl::Status s = Push(std::move(args), &replies[i]);
        EXPECT_EQ(s.ok(), r == 2) << s;
      }
      EXPECT_TRUE(replies[i]->grad_sum_of_squares.has_value());
      total += *replies[i]->grad_sum_of_squares;
      *largest = std::max(*largest, *replies[i]->grad_sum_of_squares);
    }
    return total + 3.0;
  };
  const auto apply = [&](int64_t t, double total) {
    ApplyReplies(expected, t, parts, replies, compress::ClipScale(total, 0.5f));
  };
  double largest = 0;
  const double total0 = step(0, std::nullopt, &largest);
  ASSERT_LT(compress::ClipScale(total0, 0.5f),
            0.5f);  // the clip does something
  EXPECT_TRUE(seen.empty());
  EXPECT_EQ(core_->Snapshot().status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core_->FetchPartition(first().id, fingerprint()).status().code(),
            absl::StatusCode::kUnavailable);
  const uint64_t before = core_->MirrorChecksum();
  EXPECT_EQ(Push(Args(1, 0, first())).code(),
            absl::StatusCode::kFailedPrecondition);  // no norm
  EXPECT_EQ(core_->Commit(0, 0, fingerprint(), -1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_
                ->Commit(0, 0, fingerprint(),
                         std::numeric_limits<double>::quiet_NaN())
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->Commit(7, 0, fingerprint(), total0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->Commit(0, 1, fingerprint(), total0).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      core_->Commit(0, 0, fingerprint(), largest / 2).code(),
      absl::StatusCode::kFailedPrecondition);  // less than one partition's own
  EXPECT_EQ(core_->MirrorChecksum(), before);
  EXPECT_TRUE(seen.empty());

  ASSERT_TRUE(core_->Commit(0, 0, fingerprint(), total0).ok());
  EXPECT_EQ(seen, std::vector<int64_t>{0});
  apply(0, total0);
  EXPECT_EQ(core_->MirrorChecksum(), expected.Checksum());
  EXPECT_TRUE(core_->Commit(1, 0, fingerprint(), total0)
                  .ok());  // another rank's, the same
  EXPECT_EQ(core_->Commit(1, 0, fingerprint(), 2 * total0).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(core_->Snapshot().ok());
  PushArgs wrong = Args(1, 0, first());
  wrong.previous_grad_sum_of_squares = 2 * total0;
  EXPECT_EQ(Push(std::move(wrong)).code(),
            absl::StatusCode::kFailedPrecondition);

  // Step 1 without a Commit: step 2's pushes bring its norm.
  const double total1 = step(1, total0, &largest);
  EXPECT_EQ(seen, std::vector<int64_t>{0});
  std::vector<std::shared_ptr<const Reply>> step1 = replies;
  for (const auto& p : parts) {
    PushArgs args = Args(2, 0, p);
    args.previous_grad_sum_of_squares = total1;
    EXPECT_EQ(Push(std::move(args)).message(), "pending");
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1}));
  replies = step1;
  apply(1, total1);
  EXPECT_EQ(core_->MirrorChecksum(), expected.Checksum());
}

// The workers' own clip (morse.torch's clip_grad_norm_ after backward(), in
// a job without clip_grad_norm): a step whose pushes say workers_clip sends
// each reply's sum of squares and its mirror waits for a commit carrying the
// workers' max_norm, then applies the step scaled by ClipScale(total,
// max_norm). Pushes that disagree, commits without (or with a bad, or
// another) max_norm, a max_norm for a step that did not say so and
// workers_clip in a job that clips by clip_grad_norm are refused.
TEST_F(ShardCoreTest, TheWorkersMaxNormComesWithTheirCommit) {
  std::string config(kConfig);
  config.replace(config.find("freeze_step: 1"), 14, "freeze_step: 3");
  job_ = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  core_ = *ShardCore::Create(job_, 1);
  const auto parts = core_->layout().shard_partitions(1);
  InitializeAll(*core_);
  compress::Replica expected = InitialReplica(*core_, job_.algorithm);
  std::vector<std::shared_ptr<const Reply>> replies(parts.size());
  // Step t of every partition with workers_clip `clip`; returns the whole
  // model's sum of squares (this shard's plus 3.0 for the other's).
  const auto step = [&](int64_t t, bool clip,
                        std::optional<float> previous_max_norm,
                        std::optional<double> previous_total) {
    double total = 3.0;
    for (size_t i = 0; i < parts.size(); ++i) {
      for (uint32_t r = 0; r < 3; ++r) {
        PushArgs args = Args(t, r, parts[i]);
        args.workers_clip = clip;
        args.previous_clip_max_norm = previous_max_norm;
        args.previous_grad_sum_of_squares = previous_total;
        const absl::Status s = Push(std::move(args), &replies[i]);
        EXPECT_EQ(s.ok(), r == 2) << s;
      }
      EXPECT_EQ(replies[i]->grad_sum_of_squares.has_value(), clip);
      total += replies[i]->grad_sum_of_squares.value_or(0.0);
    }
    return total;
  };
  const auto apply = [&](int64_t t, float scale) {
    ApplyReplies(expected, t, parts, replies, scale);
  };
  // Ranks that disagree on workers_clip.
  PushArgs first_push = Args(0, 0, first());
  first_push.workers_clip = true;
  EXPECT_EQ(Push(std::move(first_push)).message(), "pending");
  EXPECT_EQ(Push(Args(0, 1, first())).code(),
            absl::StatusCode::kFailedPrecondition);
  const double total0 = step(0, true, std::nullopt, std::nullopt);
  ASSERT_LT(compress::ClipScale(total0, 0.3f), 1.0f);  // the clip acts
  const uint64_t before = core_->MirrorChecksum();
  EXPECT_EQ(core_->Commit(0, 0, fingerprint(), total0).code(),
            absl::StatusCode::kInvalidArgument);  // no max_norm
  EXPECT_EQ(core_
                ->Commit(0, 0, fingerprint(), total0,
                         std::numeric_limits<float>::quiet_NaN())
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->Commit(0, 0, fingerprint(), total0, -1.0f).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->MirrorChecksum(), before);
  ASSERT_TRUE(core_->Commit(0, 0, fingerprint(), total0, 0.3f).ok());
  apply(0, compress::ClipScale(total0, 0.3f));
  EXPECT_EQ(core_->MirrorChecksum(), expected.Checksum());
  EXPECT_TRUE(core_->Commit(1, 0, fingerprint(), total0, 0.3f).ok());
  EXPECT_EQ(core_->Commit(1, 0, fingerprint(), total0, 0.4f).code(),
            absl::StatusCode::kFailedPrecondition);

  // A step that does not say workers_clip takes no max_norm and no norm.
  step(1, false, 0.3f, total0);
  EXPECT_EQ(core_->Commit(0, 1, fingerprint(), total0, 0.3f).code(),
            absl::StatusCode::kFailedPrecondition);
  apply(1, 1.0f);
  EXPECT_EQ(core_->MirrorChecksum(), expected.Checksum());

  // Step 2's commit (max_norm 0: not clipped) rides on step 3's pushes.
  const double total2 = step(2, true, std::nullopt, std::nullopt);
  PushArgs carried = Args(3, 0, first());
  carried.previous_grad_sum_of_squares = total2;
  EXPECT_EQ(Push(std::move(carried)).code(),
            absl::StatusCode::kInvalidArgument);  // without its max_norm
  carried = Args(3, 0, first());
  carried.previous_grad_sum_of_squares = total2;
  carried.previous_clip_max_norm = 0.0f;
  EXPECT_EQ(Push(std::move(carried)).message(), "pending");
  apply(2, 1.0f);
  const std::vector<float> x =
      core_->FetchPartition(first().id, fingerprint())->x;
  EXPECT_TRUE(std::equal(x.begin(), x.end(), expected.x().begin()));

  // A job that clips by clip_grad_norm takes no workers' max_norm.
  config.replace(config.find("freeze_step: 3"), 14,
                 "freeze_step: 3 clip_grad_norm: 0.5");
  job_ = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  core_ = *ShardCore::Create(job_, 1);
  InitializeAll(*core_);
  PushArgs refused = Args(0, 0, first());
  refused.workers_clip = true;
  EXPECT_EQ(Push(std::move(refused)).code(),
            absl::StatusCode::kInvalidArgument);
}

// Rank 0's module buffers ride on its push of partition 0 and come back in
// that partition's reply to every worker; any other rank or partition
// sending them is refused, and the shard is unchanged.
TEST_F(ShardCoreTest, ModuleBuffersGoFromRankZeroToEveryWorker) {
  PushArgs elsewhere = Args(0, 0, first());  // shard 1 holds partition 2 on
  elsewhere.buffers = "stats";
  const uint64_t before = core_->MirrorChecksum();
  EXPECT_EQ(Push(elsewhere).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->MirrorChecksum(), before);

  core_ = *ShardCore::Create(job_, 0);
  const compress::Partition& zero = core_->layout().shard_partitions(0)[0];
  ASSERT_EQ(zero.id, 0u);
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*core_, 0));
  PushArgs impostor = Args(0, 1, zero);
  impostor.buffers = "stats";
  EXPECT_EQ(Push(impostor).code(), absl::StatusCode::kInvalidArgument);
  PushArgs huge = Args(0, 0, zero);
  huge.buffers.assign(proto::kMaxBufferBytes + 1, 'x');
  EXPECT_EQ(Push(huge).code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::shared_ptr<const Reply>> got(3);
  for (uint32_t r = 0; r < 3; ++r) {
    PushArgs args = Args(0, r, zero);
    if (r == 0) args.buffers = std::string("running\0stats", 13);
    core_->Push(std::move(args), [&got, r](auto reply) {
      ASSERT_TRUE(reply.ok()) << reply.status();
      got[r] = *reply;
    });
  }
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_NE(got[r], nullptr);
    EXPECT_EQ(got[r]->buffers, std::string("running\0stats", 13));
  }
  // The next step without buffers replies without them.
  std::shared_ptr<const Reply> next;
  for (uint32_t r = 0; r < 3; ++r) (void)Push(Args(1, r, zero), &next);
  ASSERT_NE(next, nullptr);
  EXPECT_TRUE(next->buffers.empty());
}

// A checkpoint of another layout (here another partition_elems, which an
// unset config now picks from the model's size) or of another algorithm is
// refused, naming what differs, and leaves the shard as it was.
TEST_F(ShardCoreTest, ACheckpointOfAnotherLayoutOrAlgorithmIsRefused) {
  const std::string path = ::testing::TempDir() + "/other_layout.ckpt";
  ASSERT_TRUE(core_->SaveCheckpoint(path).ok());
  proto::JobSpec other_layout = job_;
  other_layout.algorithm.layout.partition_elems = 32;
  proto::JobSpec other_algorithm = job_;
  other_algorithm.algorithm.adam.beta2 = 0.99f;
  for (const auto& [job, names] :
       std::vector<std::pair<proto::JobSpec, std::string>>{
           {other_layout, "partition_elems"}, {other_algorithm, "optimizer"}}) {
    auto restored = *ShardCore::Create(job, 1);
    const absl::Status status = restored->RestoreCheckpoint(path);
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_NE(status.message().find(names), std::string::npos) << status;
    EXPECT_EQ(restored->Status().partitions_initialized, 0u);
    EXPECT_EQ(restored->Status().completed_steps, 0);
  }
}

// A shard restored from its checkpoint after step 1 (DESIGN 4, shard
// recovery): a retry of step 1 gets the reply the shard gave before it died
// (the checkpoint keeps the last replies and push hashes), a push of step 3
// is ABORTED with the step to replay from, and replaying step 2 gives the
// same reply as the shard that never died.
TEST_F(ShardCoreTest, ARestoredShardAnswersRetriesAndAsksForAReplay) {
  const std::string path = ::testing::TempDir() + "/restored_shard.ckpt";
  std::vector<std::shared_ptr<const Reply>> step1(
      core_->layout().shard_partitions(1).size());
  for (int64_t step : {0, 1}) {
    for (size_t i = 0; i < step1.size(); ++i) {
      for (uint32_t r = 0; r < 3; ++r) {
        Push(Args(step, r, core_->layout().shard_partitions(1)[i]), &step1[i]);
      }
    }
  }
  ASSERT_TRUE(core_->SaveCheckpoint(path).ok());
  std::shared_ptr<const Reply> step2;
  for (uint32_t r = 0; r < 3; ++r) Push(Args(2, r, first()), &step2);
  ASSERT_NE(step2, nullptr);

  auto restored = *ShardCore::Create(job_, 1);
  ASSERT_TRUE(restored->RestoreCheckpoint(path).ok());
  std::swap(core_, restored);
  std::shared_ptr<const Reply> retried;
  ASSERT_TRUE(Push(Args(1, 2, first()), &retried).ok());
  ASSERT_NE(retried, nullptr);
  EXPECT_EQ(retried->payload, step1[0]->payload);
  EXPECT_EQ(Push([&] {
              PushArgs a = Args(1, 2, first());
              a.payload[0] ^= 1;
              return a;
            }())
                .code(),
            absl::StatusCode::kFailedPrecondition);

  const absl::Status ahead = Push(Args(3, 0, first()));
  EXPECT_EQ(ahead.code(), absl::StatusCode::kAborted) << ahead;
  ASSERT_TRUE(ahead.GetPayload(kNextStepPayload).has_value());
  EXPECT_EQ(std::string(*ahead.GetPayload(kNextStepPayload)), "2");

  std::shared_ptr<const Reply> replayed;
  for (uint32_t r = 0; r < 3; ++r) Push(Args(2, r, first()), &replayed);
  ASSERT_NE(replayed, nullptr);
  EXPECT_EQ(replayed->payload, step2->payload);

  // A file from before push_hashes (its hashes were std::hash's, under
  // "last_hashes"): restored without the last replies, so the retry is
  // refused as for files from before they were kept, never compared.
  std::string file;
  {
    std::ifstream in(path, std::ios::binary);
    file.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t at = file.find("push_hashes");
  ASSERT_NE(at, std::string::npos);
  file.replace(at, 11, "last_hashes");
  compress::Fnv64 checksum;
  checksum.MixWords(file.data(), file.size() - 8);
  const uint64_t sum = checksum.value();
  for (int b = 0; b < 8; ++b)
    file[file.size() - 8 + b] = static_cast<char>(sum >> (8 * b));
  { std::ofstream(path, std::ios::binary) << file; }
  auto old = *ShardCore::Create(job_, 1);
  ASSERT_TRUE(old->RestoreCheckpoint(path).ok());
  std::swap(core_, old);
  const absl::Status gone = Push(Args(1, 2, first()));
  EXPECT_EQ(gone.code(), absl::StatusCode::kFailedPrecondition) << gone;
  EXPECT_NE(gone.message().find("its reply is gone"), absl::string_view::npos)
      << gone;
}

// Periodic checkpoints are written off the step's thread: snapshots go to
// a CheckpointThread, a newer one replaces one still waiting, and Flush
// returns once the latest is on disk.
TEST_F(ShardCoreTest, CheckpointsAreWrittenOnTheirOwnThread) {
  const std::string path = ::testing::TempDir() + "/threaded.ckpt";
  std::vector<int64_t> written;
  Mutex mu;
  {
    CheckpointThread thread(
        path, [&](const absl::Status& s, int64_t step, const std::string& why) {
          EXPECT_TRUE(s.ok()) << s;
          EXPECT_EQ(why, "periodic");
          MutexLock lock(&mu);
          written.push_back(step);
        });
    for (int64_t step : {0, 1, 2}) {
      for (const auto& p : core_->layout().shard_partitions(1)) {
        for (uint32_t r = 0; r < 3; ++r) Push(Args(step, r, p));
      }
      auto snapshot = core_->Snapshot();
      ASSERT_TRUE(snapshot.ok()) << snapshot.status();
      thread.Submit(*std::move(snapshot), "periodic");
    }
    thread.Flush();
    MutexLock lock(&mu);
    ASSERT_FALSE(written.empty());
    EXPECT_EQ(written.back(), 3);  // the latest snapshot always gets written
    EXPECT_TRUE(std::is_sorted(written.begin(), written.end()));
  }
  auto restored = *ShardCore::Create(job_, 1);
  ASSERT_TRUE(restored->RestoreCheckpoint(path).ok());
  EXPECT_EQ(restored->Status().completed_steps, 3);
  EXPECT_EQ(restored->MirrorChecksum(), core_->MirrorChecksum());
}

// The zero_one_adam job of the ZeroOneShardTests: 2 workers, 1 shard;
// variance steps 0 and 1, syncs at 2 and 3, local steps 4..6, a sync at 7.
proto::JobSpec ZeroOneShardJob() {
  return *proto::ParseJobConfig(R"(
    workers: 2
    shards: 1
    synthetic { dim: 200 }
    lr { lr: 0.01 }
    steps: 20
    block_elems: 16
    partition_elems: 64
    optimizer: "zero_one_adam"
    zero_one_adam { var_freeze_step: 2 var_update_scaler: 1 local_step_scaler: 1 local_step_clipper: 4 }
  )",
                                proto::ConfigFormat::kText);
}

// `core`'s answer to push `args` as Push returns: "pending" (UNKNOWN) while
// its step waits for other pushes.
absl::Status PushedNow(ShardCore& core, PushArgs args) {
  auto status = std::make_shared<absl::Status>(absl::UnknownError("pending"));
  core.Push(std::move(args),
            [status](absl::StatusOr<std::shared_ptr<const Reply>> r) {
              *status = r.status();
            });
  return *status;
}

// zero_one_adam (docs/design.md 2.7): the shard takes pushes only at the
// schedule's exchanges. A push of a local step, or with the codec of
// another phase, is refused with FAILED_PRECONDITION and changes nothing;
// one beyond the next sync is ABORTED naming the step the shard accepts.
TEST(ZeroOneShardTest, PushesOnlyAtExchangesAndOfTheirPhasesKind) {
  const proto::JobSpec job = ZeroOneShardJob();
  std::unique_ptr<ShardCore> core = *ShardCore::Create(job, 0);
  const uint64_t fingerprint = core->layout().fingerprint();
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*core, 0));  // the only shard
  const auto args = [&](int64_t step, uint32_t rank,
                        const compress::Partition& p,
                        compress::CodecSpec codec) {
    return EncodedPush(fingerprint, codec, step, rank, p);
  };
  const auto push = [&](PushArgs a) { return PushedNow(*core, std::move(a)); };
  const compress::CodecSpec fp32 = job.algorithm.warmup_codec,
                            sign1 = job.algorithm.up_codec;
  const compress::Partition& first = core->layout().partitions()[0];
  // Step 0 updates v: full precision only.
  uint64_t checksum = core->MirrorChecksum();
  absl::Status wrong = push(args(0, 0, first, sign1));
  EXPECT_EQ(wrong.code(), absl::StatusCode::kFailedPrecondition) << wrong;
  EXPECT_NE(wrong.message().find("variance phase"), std::string::npos) << wrong;
  EXPECT_EQ(core->Status().pushes_accepted, 0u);
  EXPECT_EQ(core->MirrorChecksum(), checksum);
  for (int64_t step = 0; step < 4; ++step) {
    for (const auto& p : core->layout().partitions()) {
      for (uint32_t rank = 0; rank < 2; ++rank) {
        const compress::CodecSpec codec =
            compress::PlanStep(job.algorithm, step).up;
        const absl::Status s = push(args(step, rank, p, codec));
        ASSERT_EQ(s.ok(), rank == 1) << "step " << step << ": " << s;
      }
    }
  }
  EXPECT_EQ(core->Status().completed_steps, 4);
  // Steps 4..6 are local: nobody pushes.
  checksum = core->MirrorChecksum();
  const uint64_t accepted = core->Status().pushes_accepted;
  for (int64_t step : {4, 5, 6}) {
    const absl::Status local = push(args(step, 0, first, sign1));
    EXPECT_EQ(local.code(), absl::StatusCode::kFailedPrecondition) << local;
    EXPECT_NE(local.message().find("local step"), std::string::npos) << local;
    EXPECT_NE(local.message().find("accepts step 7"), std::string::npos)
        << local;
  }
  const absl::Status ahead = push(args(11, 0, first, sign1));
  EXPECT_EQ(ahead.code(), absl::StatusCode::kAborted) << ahead;
  EXPECT_EQ(ahead.GetPayload(kNextStepPayload).value_or(absl::Cord()), "7");
  EXPECT_EQ(push(args(7, 0, first, fp32)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core->Status().pushes_accepted, accepted);
  EXPECT_EQ(core->MirrorChecksum(), checksum);
  EXPECT_EQ(core->Status().completed_steps, 4);
  // The sync of step 7 is taken.
  EXPECT_EQ(push(args(7, 0, first, sign1)).message(), "pending");
  EXPECT_EQ(push(args(7, 1, first, sign1)), absl::OkStatus());
}

// zero_one_adam: weights changed right after a step that exchanged and
// before a local interval (ReplaceX, design.md 2.7) are the interval's
// anchor: the shard's x, which the pushes of the interval's sync must show
// (without the hash, or with the old x's, refused). Inside the interval the
// shard refuses a change (each rank's own there), changing nothing.
TEST(ZeroOneShardTest, WeightsChangedBeforeAnIntervalAreShownAtItsSync) {
  const proto::JobSpec job = ZeroOneShardJob();
  std::unique_ptr<ShardCore> core = *ShardCore::Create(job, 0);
  const uint64_t fingerprint = core->layout().fingerprint();
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*core, 0));
  const auto push = [&](PushArgs a) { return PushedNow(*core, std::move(a)); };
  const auto args = [&](int64_t step, uint32_t rank,
                        const compress::Partition& p) {
    return EncodedPush(fingerprint, compress::PlanStep(job.algorithm, step).up,
                       step, rank, p);
  };
  for (int64_t step = 0; step < 4; ++step) {
    for (const auto& p : core->layout().partitions()) {
      for (uint32_t rank = 0; rank < 2; ++rank)
        ASSERT_EQ(push(args(step, rank, p)).ok(), rank == 1) << step;
    }
  }
  const compress::Partition& first = core->layout().partitions()[0];
  const PartitionSnapshot before = *core->FetchPartition(first.id, fingerprint);
  ASSERT_EQ(before.completed_steps, 4);
  std::vector<float> changed = before.x;
  for (float& f : changed) f *= 0.5f;
  ASSERT_NE(changed, before.x);

  const absl::Status inside =
      core->ReplaceX(0, first.id, fingerprint, 5, changed);
  EXPECT_EQ(inside.code(), absl::StatusCode::kFailedPrecondition) << inside;
  EXPECT_EQ(core->FetchPartition(first.id, fingerprint)->x, before.x);

  ASSERT_TRUE(core->ReplaceX(0, first.id, fingerprint, 4, changed).ok());
  EXPECT_TRUE(core->ReplaceX(0, first.id, fingerprint, 4, changed).ok())
      << "the same x again (rank 0 replaying)";
  const PartitionSnapshot after = *core->FetchPartition(first.id, fingerprint);
  EXPECT_EQ(after.completed_steps, 4);
  EXPECT_EQ(after.x, changed);
  EXPECT_EQ(after.m, before.m);

  // The sync of step 7.
  const absl::Status unchanged = push(args(7, 1, first));
  EXPECT_EQ(unchanged.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(unchanged.message().find("after step 3 and rank 1 did not"),
            std::string::npos)
      << unchanged;
  PushArgs old = args(7, 1, first);
  old.x_hash = compress::XHash(before.x);
  const absl::Status differs = push(std::move(old));
  EXPECT_EQ(differs.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(differs.message().find("same way on every rank"), std::string::npos)
      << differs;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    PushArgs shown = args(7, rank, first);
    shown.x_hash = compress::XHash(changed);
    const absl::Status s = push(std::move(shown));
    EXPECT_EQ(s.ok(), rank == 1) << s;
  }
  EXPECT_EQ(core->FetchPartition(first.id, fingerprint)->completed_steps, 8);
}

// The onebit_lamb shard of the LambShardTests (2 workers, 1 shard, layers
// of 90 elements across 64-element partitions), `extra` JobConfig fields
// added, its partitions initialized with VariedData, and `worker`'s replica
// of the whole model holding the same x.
proto::JobSpec LambShardJob(const std::string& extra = "") {
  return *proto::ParseJobConfig(R"(
    workers: 2
    shards: 1
    synthetic { dim: 200 layer_elems: 90 }
    lr { lr: 0.01 }
    steps: 20
    block_elems: 16
    partition_elems: 64
    optimizer: "onebit_lamb"
    freeze_step: 2
  )" + extra,
                                proto::ConfigFormat::kText);
}

std::unique_ptr<ShardCore> InitializedLambShard(const proto::JobSpec& job,
                                                compress::Replica& worker) {
  std::unique_ptr<ShardCore> core = *ShardCore::Create(job, 0);
  for (const auto& p : core->layout().partitions()) {
    const std::vector<float> x0 =
        compress::testing::VariedData(p.range.size(), p.id);
    std::copy(x0.begin(), x0.end(), worker.x().begin() + p.range.begin);
    MORSE_CHECK(core->InitPartition(0, p.id, core->layout().fingerprint(),
                                    {reinterpret_cast<const char*>(x0.data()),
                                     4 * x0.size()})
                    .ok());
  }
  return core;
}

// Step 0 of both workers on every partition of the LambShardJob's `core`:
// rank 0's push waits, rank 1's completes it; `worker` applies each reply
// and *commit is its commit of the step (Replica::LambStep).
void CompleteLambStepZero(ShardCore& core, const proto::JobSpec& job,
                          compress::Replica& worker,
                          std::vector<double>* commit) {
  const uint64_t fingerprint = core.layout().fingerprint();
  for (const auto& p : core.layout().partitions()) {
    std::shared_ptr<const Reply> reply;
    for (uint32_t rank = 0; rank < 2; ++rank) {
      core.Push(
          EncodedPush(fingerprint, compress::PlanStep(job.algorithm, 0).up, 0,
                      rank, p),
          [&](absl::StatusOr<std::shared_ptr<const Reply>> r) {
            ASSERT_TRUE(r.ok()) << r.status();
            reply = *r;
          });
      ASSERT_EQ(reply != nullptr, rank == 1) << p.id;
    }
    ASSERT_TRUE(worker
                    .ApplyReply(0, p.range.begin, p.range.size(),
                                {reinterpret_cast<const uint8_t*>(
                                     reply->payload.data()),
                                 reply->payload.size()})
                    .ok());
  }
  *commit = *worker.CommitStep(0);
}

// onebit_lamb (docs/design.md 2.8): each step's mirror update waits for the
// workers' layer commit. A push of the next step without it, a malformed
// one, one that differs from the commit already taken, or one for a step
// the shard has not completed is refused and changes nothing; the right
// one (from Commit or from the pushes) moves the mirror as a worker's
// replica moves.
// A clip of part of the model (design.md 2.6): the commit's pieces, with
// S and a max_norm of 0, scale the mirror's decoded average piece by piece;
// malformed pieces are refused and change nothing, another clip of the
// same step too.
TEST_F(ShardCoreTest, AClipOfPartOfTheModelComesAsPieces) {
  std::string config(kConfig);
  config.replace(config.find("freeze_step: 1"), 14, "freeze_step: 3");
  job_ = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  core_ = *ShardCore::Create(job_, 1);
  const auto parts = core_->layout().shard_partitions(1);
  InitializeAll(*core_);
  compress::Replica expected = InitialReplica(*core_, job_.algorithm);
  std::vector<std::shared_ptr<const Reply>> replies(parts.size());
  double total = 3.0;  // the other shard's, and this one's below
  for (size_t i = 0; i < parts.size(); ++i) {
    for (uint32_t r = 0; r < 3; ++r) {
      PushArgs args = Args(0, r, parts[i]);
      args.workers_clip = true;
      ASSERT_EQ(Push(std::move(args), &replies[i]).ok(), r == 2);
    }
    total += *replies[i]->grad_sum_of_squares;
  }
  const uint64_t dim = job_.algorithm.layout.dim;
  const uint64_t mid = parts[0].range.begin + parts[0].range.size() / 2;
  // Half of the first partition by 0.25, the rest as it is.
  const compress::ClipPieces pieces = {
      {mid, 1.0f}, {parts[0].range.end, 0.25f}, {dim, 1.0f}};
  const auto commit = [&](compress::ClipPieces p, std::optional<float> m) {
    return core_->CommitStep(0, 0, fingerprint(),
                             StepCommit{total, m, {}, std::move(p)});
  };
  const uint64_t before = core_->MirrorChecksum();
  EXPECT_EQ(commit(pieces, 0.3f).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(commit(pieces, std::nullopt).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(commit({{mid, 1.0f}, {mid, 0.5f}, {dim, 1.0f}}, 0.0f).code(),
            absl::StatusCode::kInvalidArgument);  // ends not rising
  EXPECT_EQ(commit({{mid, 1.0f}, {dim - 1, 0.5f}}, 0.0f).code(),
            absl::StatusCode::kInvalidArgument);  // short of the model
  EXPECT_EQ(
      commit({{mid, std::numeric_limits<float>::infinity()}, {dim, 1.0f}}, 0.0f)
          .code(),
      absl::StatusCode::kInvalidArgument);  // not finite
  EXPECT_EQ(
      commit({{mid, std::numeric_limits<float>::quiet_NaN()}, {dim, 1.0f}},
             0.0f)
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->MirrorChecksum(), before);
  ASSERT_TRUE(commit(pieces, 0.0f).ok());
  ApplyReplies(expected, 0, parts, replies, 1.0f, pieces);
  EXPECT_EQ(core_->MirrorChecksum(), expected.Checksum());
  compress::Replica unclipped = InitialReplica(*core_, job_.algorithm);
  ApplyReplies(unclipped, 0, parts, replies, 1.0f);
  EXPECT_NE(unclipped.Checksum(), expected.Checksum());  // the pieces acted
  EXPECT_TRUE(commit(pieces, 0.0f).ok());                // the same again
  EXPECT_EQ(commit({{dim, 1.0f}}, 0.0f).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core_->MirrorChecksum(), expected.Checksum());

  // Restarted from a checkpoint written after step 0, the shard holds the
  // clipped mirror, and step 1's pushes carry step 0's clip again
  // (previous_*): it takes them as applied (it refused them, knowing no
  // workers_clip of a step it restored, and the job stopped).
  const std::string path = ::testing::TempDir() + "/clipped_in_pieces.ckpt";
  ASSERT_TRUE(core_->SaveCheckpoint(path).ok());
  auto restored = *ShardCore::Create(job_, 1);
  ASSERT_TRUE(restored->RestoreCheckpoint(path).ok());
  std::swap(core_, restored);
  EXPECT_EQ(core_->MirrorChecksum(), expected.Checksum());
  for (uint32_t r = 0; r < 3; ++r) {
    PushArgs args = Args(1, r, parts[0]);
    args.workers_clip = true;
    args.previous_grad_sum_of_squares = total;
    args.previous_clip_max_norm = 0.0f;
    args.previous_clip_pieces = pieces;
    const absl::Status pushed = Push(std::move(args));
    EXPECT_TRUE(r < 2 ? pushed.message() == "pending" : pushed.ok()) << pushed;
  }
}

// Edits after the clip (design.md 2.6): a commit whose workers amended the
// step's gradient (with S, a max_norm of 0 and no pieces) has every one of
// the shard's partitions, each of its size and finite, or is refused and
// changes nothing; the mirror then applies the amended values in place of
// the decoded average. Another commit of the step must amend alike, and so
// must the next step's pushes, which carry it too (previous_amended).
TEST_F(ShardCoreTest, AnAmendedGradientTakesTheAveragesPlace) {
  std::string config(kConfig);
  config.replace(config.find("freeze_step: 1"), 14, "freeze_step: 3");
  job_ = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  core_ = *ShardCore::Create(job_, 1);
  const auto parts = core_->layout().shard_partitions(1);
  InitializeAll(*core_);
  std::vector<std::shared_ptr<const Reply>> replies(parts.size());
  double total = 3.0;  // the other shard's, and this one's below
  for (size_t i = 0; i < parts.size(); ++i) {
    for (uint32_t r = 0; r < 3; ++r) {
      PushArgs args = Args(0, r, parts[i]);
      args.workers_clip = true;
      ASSERT_EQ(Push(std::move(args), &replies[i]).ok(), r == 2);
    }
    total += *replies[i]->grad_sum_of_squares;
  }
  // The amended gradient of each partition: values of its own.
  std::vector<std::pair<uint32_t, std::string>> amended;
  for (const compress::Partition& p : parts) {
    const std::vector<float> g =
        compress::testing::VariedData(p.range.size(), 700 + p.id);
    amended.emplace_back(
        p.id,
        std::string(reinterpret_cast<const char*>(g.data()), 4 * g.size()));
  }
  const auto commit = [&](std::optional<float> m, compress::ClipPieces pieces,
                          std::vector<std::pair<uint32_t, std::string>> a) {
    StepCommit c{total, m, {}, std::move(pieces)};
    c.amended = std::move(a);
    return core_->CommitStep(0, 0, fingerprint(), c);
  };
  const uint64_t dim = job_.algorithm.layout.dim;
  const uint64_t before = core_->MirrorChecksum();
  EXPECT_EQ(commit(0.5f, {}, amended).code(),
            absl::StatusCode::kInvalidArgument);  // a max_norm besides
  EXPECT_EQ(commit(0.0f, {{dim, 0.5f}}, amended).code(),
            absl::StatusCode::kInvalidArgument);  // pieces besides
  auto foreign = amended;
  foreign[0].first = core_->layout().shard_partitions(0)[0].id;
  EXPECT_EQ(commit(0.0f, {}, foreign).code(),
            absl::StatusCode::kInvalidArgument);  // shard 0's partition
  auto shorter = amended;
  shorter[0].second.resize(shorter[0].second.size() - 4);
  EXPECT_EQ(commit(0.0f, {}, shorter).code(),
            absl::StatusCode::kInvalidArgument);
  auto nan = amended;
  const float bad = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan[1].second.data() + 8, &bad, 4);
  EXPECT_EQ(commit(0.0f, {}, nan).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->MirrorChecksum(), before);

  compress::Replica expected = InitialReplica(*core_, job_.algorithm);
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& g = amended[i].second;
    ASSERT_TRUE(
        expected
            .ApplyReply(0, parts[i].range.begin, parts[i].range.size(),
                        {reinterpret_cast<const uint8_t*>(g.data()), g.size()},
                        nullptr, 1.0f, nullptr, {}, /*amended=*/true)
            .ok());
  }
  // A commit of each partition apart (as Commit sends them): until the
  // last one's comes, that partition waits.
  for (size_t i = 0; i + 1 < amended.size(); ++i)
    ASSERT_TRUE(commit(0.0f, {}, {amended[i]}).ok());
  EXPECT_NE(core_->MirrorChecksum(), expected.Checksum());
  ASSERT_TRUE(commit(0.0f, {}, {amended.back()}).ok());
  EXPECT_EQ(core_->MirrorChecksum(), expected.Checksum());
  compress::Replica averaged = InitialReplica(*core_, job_.algorithm);
  ApplyReplies(averaged, 0, parts, replies, 1.0f);
  EXPECT_NE(averaged.Checksum(), expected.Checksum());  // the amendment acted
  EXPECT_TRUE(commit(0.0f, {}, amended).ok());          // the same again
  EXPECT_EQ(commit(0.0f, {}, {}).code(),
            absl::StatusCode::kFailedPrecondition);  // not amended
  auto other = amended;
  other[0].second[0] ^= 1;
  EXPECT_EQ(commit(0.0f, {}, other).code(),
            absl::StatusCode::kFailedPrecondition);  // amended otherwise
  EXPECT_EQ(core_->MirrorChecksum(), expected.Checksum());

  // Step 1's pushes carry step 0's commit with the partition's part of the
  // amendment: another part is refused.
  const auto next = [&](uint32_t rank, std::string part) {
    PushArgs args = Args(1, rank, parts[0]);
    args.previous_grad_sum_of_squares = total;
    args.previous_clip_max_norm = 0.0f;
    args.previous_amended = std::move(part);
    return Push(std::move(args));
  };
  EXPECT_EQ(next(0, other[0].second).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(next(0, "").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(next(0, amended[0].second).message(), "pending");
}

// A shard whose commit of an amended step came with the next step's pushes
// alone (rank 0's Commit lost) moves its mirror by the amended gradient as
// well.
TEST_F(ShardCoreTest, AnAmendedGradientMayComeWithTheNextPushes) {
  std::string config(kConfig);
  config.replace(config.find("freeze_step: 1"), 14, "freeze_step: 3");
  job_ = *proto::ParseJobConfig(config, proto::ConfigFormat::kText);
  core_ = *ShardCore::Create(job_, 1);
  InitializeAll(*core_);
  const compress::Partition& p = first();
  std::shared_ptr<const Reply> reply;
  for (uint32_t r = 0; r < 3; ++r) {
    PushArgs args = Args(0, r, p);
    args.workers_clip = true;
    ASSERT_EQ(Push(std::move(args), &reply).ok(), r == 2);
  }
  const std::vector<float> g =
      compress::testing::VariedData(p.range.size(), 77);
  const std::string bytes(reinterpret_cast<const char*>(g.data()),
                          4 * g.size());
  const double total = *reply->grad_sum_of_squares + 1.0;
  std::shared_ptr<const Reply> next;
  for (uint32_t r = 0; r < 3; ++r) {
    PushArgs args = Args(1, r, p);
    args.previous_grad_sum_of_squares = total;
    args.previous_clip_max_norm = 0.0f;
    args.previous_amended = bytes;
    const absl::Status pushed = Push(std::move(args), &next);
    EXPECT_TRUE(r < 2 ? pushed.message() == "pending" : pushed.ok()) << pushed;
  }
  compress::Replica expected = InitialReplica(*core_, job_.algorithm);
  ASSERT_TRUE(expected
                  .ApplyReply(0, p.range.begin, p.range.size(),
                              {reinterpret_cast<const uint8_t*>(bytes.data()),
                               bytes.size()},
                              nullptr, 1.0f, nullptr, {}, /*amended=*/true)
                  .ok());
  ApplyReplies(expected, 1, {&p, 1}, {next}, 1.0f);
  EXPECT_EQ(core_->MirrorChecksum(), expected.Checksum());
}

TEST(LambShardTest, TheMirrorMovesOnlyWithTheWorkersCommit) {
  const proto::JobSpec job = LambShardJob();
  compress::Replica worker(job.algorithm, {0, job.algorithm.layout.dim});
  std::unique_ptr<ShardCore> core = InitializedLambShard(job, worker);
  const uint64_t fingerprint = core->layout().fingerprint();
  const auto push = [&](int64_t step, uint32_t rank,
                        const compress::Partition& p,
                        std::vector<double> commit) {
    PushArgs a = EncodedPush(
        fingerprint, compress::PlanStep(job.algorithm, step).up, step, rank, p);
    a.previous_commit = std::move(commit);
    return PushedNow(*core, std::move(a));
  };
  const auto parts = core->layout().partitions();
  // Step 0 completes on every partition; the worker applies the replies and
  // forms the commit.
  std::vector<double> commit;
  ASSERT_NO_FATAL_FAILURE(CompleteLambStepZero(*core, job, worker, &commit));
  ASSERT_EQ(commit.size(), 3u * 3);  // layers of 90, 90 and 20
  // Without its commit, the mirror cannot be read and step 1 is refused.
  EXPECT_EQ(core->FetchPartition(parts[0].id, fingerprint).status().code(),
            absl::StatusCode::kUnavailable);
  absl::Status missing = push(1, 0, parts[0], {});
  EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition) << missing;
  EXPECT_NE(missing.message().find("previous_commit"), std::string::npos)
      << missing;
  std::vector<double> bad = commit;
  bad[0] = std::nan("");
  EXPECT_EQ(push(1, 0, parts[0], bad).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core->CommitValues(0, 0, fingerprint, {1.0, 1.0}).code(),
            absl::StatusCode::kInvalidArgument);
  // A commit of a step not completed yet (the shard restarted behind it)
  // says how many steps the shard has completed.
  const absl::Status ahead = core->CommitValues(0, 1, fingerprint, commit);
  EXPECT_EQ(ahead.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ahead.GetPayload(kNextStepPayload).value_or(absl::Cord("none")),
            absl::Cord("1"))
      << ahead;
  EXPECT_EQ(core->Commit(0, 0, fingerprint, 1.0).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core->Status().pushes_accepted, 2u * parts.size());
  // Rank 0's Commit applies it; the mirror is the worker's replica.
  ASSERT_TRUE(core->CommitValues(0, 0, fingerprint, commit).ok());
  std::vector<double> other = commit;
  other[0] = 0.5;
  EXPECT_EQ(push(1, 1, parts[0], other).code(),
            absl::StatusCode::kFailedPrecondition);
  for (const auto& p : parts) {
    const PartitionSnapshot s = *core->FetchPartition(p.id, fingerprint);
    EXPECT_TRUE(
        std::equal(s.x.begin(), s.x.end(), worker.x().begin() + p.range.begin))
        << p.id;
    const std::vector<float> v_fresh = Own(s, "v_fresh");
    EXPECT_TRUE(std::equal(v_fresh.begin(), v_fresh.end(),
                           worker.v_fresh().begin() + p.range.begin));
    EXPECT_EQ(Own(s, "lamb_layers").size(), 6u);
  }
  // The pushes of step 1 may carry the same commit again.
  EXPECT_EQ(push(1, 0, parts[0], commit).message(), "pending");
  EXPECT_TRUE(push(1, 1, parts[0], commit).ok());
  // Each partition keeps the layers' state of its own step: one a step
  // ahead (its commit of step 1 carried by a push of step 2) does not move
  // the state the others report.
  std::vector<double> later = commit;
  later[1] = 0.25;  // layer 0's coeff_freeze and last_factor
  later[2] = 0.75;
  EXPECT_EQ(push(2, 0, parts[0], later).message(), "pending");
  const auto layers = [&](const compress::Partition& p) {
    return Own(*core->FetchPartition(p.id, fingerprint), "lamb_layers");
  };
  EXPECT_EQ(layers(parts[0]),
            compress::FlattenLambLayers(compress::LambStateOf(later)));
  for (size_t i = 1; i < parts.size(); ++i) {
    EXPECT_EQ(layers(parts[i]),
              compress::FlattenLambLayers(compress::LambStateOf(commit)))
        << i;
  }
  // A saved run (load_state_dict) restores v' and the layers' state with
  // x, m, v and the server error into a fresh shard, which then reports
  // what this one did; without them it is refused and nothing changes.
  std::unique_ptr<ShardCore> fresh = *ShardCore::Create(job, 0);
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*fresh, 0));
  std::vector<std::pair<int64_t, std::string>> observed;
  fresh->SetChangeObserver(
      [&](int64_t step, const ShardCore&, absl::string_view what) {
        observed.emplace_back(step, std::string(what));
      });
  const PartitionSnapshot before =
      *fresh->FetchPartition(parts[1].id, fingerprint, {.server_error = true});
  PartitionSnapshot saved =
      *core->FetchPartition(parts[1].id, fingerprint, {.server_error = true});
  ASSERT_EQ(Own(saved, "v_fresh").size(), parts[1].range.size());
  PartitionSnapshot partial = saved;
  Own(partial, "v_fresh").clear();
  absl::Status refused =
      fresh->RestorePartition(0, parts[1].id, fingerprint, partial);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("onebit_lamb needs"), std::string::npos)
      << refused;
  partial = saved;
  partial.state.erase(partial.state.begin());
  refused = fresh->RestorePartition(0, parts[1].id, fingerprint, partial);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("onebit_lamb keeps [v_fresh, lamb_layers]"),
            std::string::npos)
      << refused;
  partial = saved;
  Own(partial, "lamb_layers")[0] = std::nanf("");
  EXPECT_EQ(
      fresh->RestorePartition(0, parts[1].id, fingerprint, partial).code(),
      absl::StatusCode::kInvalidArgument);
  const PartitionSnapshot unchanged =
      *fresh->FetchPartition(parts[1].id, fingerprint, {.server_error = true});
  EXPECT_EQ(unchanged.x, before.x);
  EXPECT_EQ(Own(unchanged, "v_fresh"), Own(before, "v_fresh"));
  EXPECT_EQ(Own(unchanged, "lamb_layers"), Own(before, "lamb_layers"));
  const absl::Status restore =
      fresh->RestorePartition(0, parts[1].id, fingerprint, saved);
  ASSERT_TRUE(restore.ok()) << restore;
  const PartitionSnapshot restored =
      *fresh->FetchPartition(parts[1].id, fingerprint, {.server_error = true});
  EXPECT_EQ(restored.completed_steps, saved.completed_steps);
  EXPECT_EQ(restored.x, saved.x);
  EXPECT_EQ(restored.m, saved.m);
  EXPECT_EQ(restored.v, saved.v);
  EXPECT_EQ(restored.server_error, saved.server_error);
  EXPECT_EQ(Own(restored, "v_fresh"), Own(saved, "v_fresh"));
  EXPECT_EQ(Own(restored, "lamb_layers"), Own(saved, "lamb_layers"));
  // Once every partition of the shard holds the saved run (and not
  // before), the change observer runs, once: the runtime writes a
  // checkpoint then (a layout made anew mid-job has no other).
  ASSERT_GT(parts.size(), 1u);
  EXPECT_TRUE(observed.empty());
  size_t given = 1;  // parts[1]
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i == 1) continue;
    ++given;
    PartitionSnapshot other =
        *core->FetchPartition(parts[i].id, fingerprint, {.server_error = true});
    other.completed_steps = saved.completed_steps;
    ASSERT_TRUE(
        fresh->RestorePartition(0, parts[i].id, fingerprint, other).ok());
    EXPECT_EQ(observed.size(), given == parts.size() ? 1u : 0u) << i;
  }
  EXPECT_EQ(
      observed,
      (std::vector<std::pair<int64_t, std::string>>{
          {saved.completed_steps, absl::StrCat("a saved run restored at step ",
                                               saved.completed_steps)}}));
  // Another optimizer has no v' or layer state to take.
  std::unique_ptr<ShardCore> adam =
      *ShardCore::Create(*proto::ParseJobConfig(R"(
    workers: 2 shards: 1 synthetic { dim: 200 } lr { lr: 0.01 } steps: 20 block_elems: 16
    partition_elems: 64 optimizer: "adam")",
                                                proto::ConfigFormat::kText),
                         0);
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*adam, 0));
  const absl::Status foreign = adam->RestorePartition(
      0, parts[1].id, adam->layout().fingerprint(), saved);
  EXPECT_EQ(foreign.code(), absl::StatusCode::kInvalidArgument) << foreign;
  EXPECT_NE(foreign.message().find("adam keeps [none]"), std::string::npos)
      << foreign;
}

// The step observer sees the mirror as after its step: the runtime writes
// the state log's checksums and the periodic checkpoints from it. A step of
// onebit_lamb completes with its commit (rank 0's Commit, and every push of
// the next step carries it), and a partition may have every push of the
// next step while the observer still reads the shard: its completion waits
// for the observer to return, and then runs.
TEST(LambShardTest, TheObserverSeesItsStepWhileTheNextOneArrives) {
  const proto::JobSpec job = LambShardJob();
  compress::Replica worker(job.algorithm, {0, job.algorithm.layout.dim});
  std::unique_ptr<ShardCore> core = InitializedLambShard(job, worker);
  const uint64_t fingerprint = core->layout().fingerprint();
  const auto parts = core->layout().partitions();
  std::vector<double> commit;
  ASSERT_NO_FATAL_FAILURE(CompleteLambStepZero(*core, job, worker, &commit));
  // The step trace shows the hold.
  const std::string trace_path = ::testing::TempDir() + "/held_trace.json";
  ASSERT_TRUE(trace::Start(trace_path, "shard 0").ok());
  // The observer of step 0 lets both ranks push step 1 to the first
  // partition, and gives that step a second to complete before it reads
  // the shard.
  absl::Notification observing, completed;
  std::optional<uint64_t> checksum;
  absl::Status snapshot;
  core->SetStepObserver([&](int64_t step, const ShardCore& c) {
    if (step != 0) return;
    observing.Notify();
    completed.WaitForNotificationWithTimeout(absl::Seconds(1));
    checksum = c.MirrorChecksum();
    snapshot = c.Snapshot().status();
  });
  std::thread next([&] {
    observing.WaitForNotification();
    for (uint32_t rank = 0; rank < 2; ++rank) {
      PushArgs a =
          EncodedPush(fingerprint, compress::PlanStep(job.algorithm, 1).up, 1,
                      rank, parts[0]);
      a.previous_commit = commit;
      core->Push(std::move(a),
                 [&, rank](absl::StatusOr<std::shared_ptr<const Reply>> r) {
                   EXPECT_TRUE(r.ok()) << r.status();
                   if (rank == 1) completed.Notify();
                 });
    }
  });
  ASSERT_TRUE(core->CommitValues(0, 0, fingerprint, commit).ok());
  next.join();
  EXPECT_EQ(checksum, worker.Checksum());
  EXPECT_TRUE(snapshot.ok()) << snapshot;
  // Held, not lost: step 1 of that partition completed once it returned.
  EXPECT_TRUE(completed.HasBeenNotified());
  ASSERT_TRUE(trace::Stop().ok());
  std::ifstream file(trace_path);
  const std::string trace_json((std::istreambuf_iterator<char>(file)),
                               std::istreambuf_iterator<char>());
  EXPECT_NE(trace_json.find("\"name\":\"held\""), std::string::npos)
      << trace_json;
}

// A server applies onebit_lamb commits from its RPC threads, each under its
// partition's lock only: partitions pushing at once from their own threads
// must not share anything unguarded (the sanitizers' run of this test found
// a double free when they shared the layers' state).
// onebit_lamb with clip_grad_norm (design.md 2.6): a warmup step clips the
// averaged gradient, so its commit carries the norm with the layers'
// values, in one; either alone is refused and changes nothing, and the
// whole one moves the mirror as the worker's replica moved.
TEST(LambShardTest, AClippedWarmupStepsCommitCarriesTheNormWithTheValues) {
  const proto::JobSpec job = LambShardJob("clip_grad_norm: 0.01\n");
  compress::Replica worker(job.algorithm, {0, job.algorithm.layout.dim});
  std::unique_ptr<ShardCore> core = InitializedLambShard(job, worker);
  const uint64_t fingerprint = core->layout().fingerprint();
  const auto parts = core->layout().partitions();
  std::vector<std::shared_ptr<const Reply>> replies(parts.size());
  double total = 0;
  for (const auto& p : parts) {
    for (uint32_t rank = 0; rank < 2; ++rank) {
      PushArgs a = EncodedPush(
          fingerprint, compress::PlanStep(job.algorithm, 0).up, 0, rank, p);
      core->Push(
          std::move(a),
          [&, id = p.id](absl::StatusOr<std::shared_ptr<const Reply>> r) {
            ASSERT_TRUE(r.ok()) << r.status();
            replies[id] = *r;
          });
    }
    ASSERT_NE(replies[p.id], nullptr);
    ASSERT_TRUE(replies[p.id]->grad_sum_of_squares.has_value());
    // Its moments wait for the clip factor: no layer statistics.
    EXPECT_TRUE(replies[p.id]->piece_stats.empty());
    total += *replies[p.id]->grad_sum_of_squares;
  }
  const float scale = compress::ClipScale(total, job.algorithm.clip_grad_norm);
  ASSERT_LT(scale, 1.0f);  // it clips
  for (const auto& p : parts) {
    ASSERT_TRUE(worker
                    .ApplyReply(0, p.range.begin, p.range.size(),
                                {reinterpret_cast<const uint8_t*>(
                                     replies[p.id]->payload.data()),
                                 replies[p.id]->payload.size()},
                                nullptr, scale)
                    .ok());
  }
  const std::vector<double> commit = *worker.CommitStep(0);
  const uint64_t checksum = core->MirrorChecksum();
  const absl::Status values_alone =
      core->CommitValues(0, 0, fingerprint, commit);
  EXPECT_EQ(values_alone.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(values_alone.message().find("no gradient norm"), std::string::npos)
      << values_alone;
  const absl::Status norm_alone = core->Commit(0, 0, fingerprint, total);
  EXPECT_EQ(norm_alone.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(norm_alone.message().find("onebit_lamb values"), std::string::npos)
      << norm_alone;
  EXPECT_EQ(core->FetchPartition(parts[0].id, fingerprint).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(core->MirrorChecksum(), checksum);
  ASSERT_TRUE(core->CommitStep(0, 0, fingerprint,
                               StepCommit{total, std::nullopt, commit, {}})
                  .ok());
  // The same again is OK; another norm is refused.
  EXPECT_TRUE(core->CommitStep(1, 0, fingerprint,
                               StepCommit{total, std::nullopt, commit, {}})
                  .ok());
  EXPECT_EQ(core->CommitStep(1, 0, fingerprint,
                             StepCommit{2 * total, std::nullopt, commit, {}})
                .code(),
            absl::StatusCode::kFailedPrecondition);
  for (const auto& p : parts) {
    const PartitionSnapshot s = *core->FetchPartition(p.id, fingerprint);
    EXPECT_TRUE(
        std::equal(s.x.begin(), s.x.end(), worker.x().begin() + p.range.begin))
        << p.id;
    EXPECT_TRUE(
        std::equal(s.m.begin(), s.m.end(), worker.m().begin() + p.range.begin))
        << p.id;
  }
}

// A reply of a step that does not clip the average carries the layer
// statistics of its partition's pieces, taken on the mirror as the reply
// went out (design.md 2.8): bit for bit what a worker's replica gives after
// applying the reply, through the warmup and the compression phase, and a
// commit from them alone moves the mirror as the worker's replica moves.
TEST(LambShardTest, RepliesCarryTheLayerStatisticsAWorkerWouldTake) {
  // Partitions of 4 segments and layers across them: pieces of 1 to 4
  // segments.
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
  compress::Replica worker(job.algorithm, {0, job.algorithm.layout.dim});
  std::unique_ptr<ShardCore> core = InitializedLambShard(job, worker);
  // A second replica that takes its statistics itself.
  compress::Replica own(job.algorithm, {0, job.algorithm.layout.dim});
  std::copy(worker.x().begin(), worker.x().end(), own.x().begin());
  const uint64_t fingerprint = core->layout().fingerprint();
  const auto parts = core->layout().partitions();
  std::vector<double> commit;
  for (int64_t step = 0; step < 4; ++step) {  // freeze_step 2
    std::vector<std::vector<double>> pieces(parts.size());
    for (const auto& p : parts) {
      std::shared_ptr<const Reply> reply;
      for (uint32_t rank = 0; rank < 2; ++rank) {
        PushArgs a =
            EncodedPush(fingerprint, compress::PlanStep(job.algorithm, step).up,
                        step, rank, p);
        a.previous_commit = commit;
        core->Push(std::move(a),
                   [&](absl::StatusOr<std::shared_ptr<const Reply>> r) {
                     ASSERT_TRUE(r.ok()) << r.status();
                     reply = *r;
                   });
      }
      ASSERT_NE(reply, nullptr) << step << " " << p.id;
      const absl::Span<const uint8_t> bytes(
          reinterpret_cast<const uint8_t*>(reply->payload.data()),
          reply->payload.size());
      ASSERT_TRUE(
          worker.ApplyReply(step, p.range.begin, p.range.size(), bytes).ok());
      ASSERT_TRUE(
          own.ApplyReply(step, p.range.begin, p.range.size(), bytes).ok());
      const std::vector<compress::LayerPiece> of =
          compress::LayerPiecesOf(job.algorithm, p.range);
      const std::vector<double> expected =
          compress::PieceStats(*compress::OptimizerOf(job.algorithm).Layers(),
                               of, worker.SegmentStats(step, p.range));
      ASSERT_EQ(reply->piece_stats.size(), compress::kLambStats * of.size());
      EXPECT_EQ(0, std::memcmp(reply->piece_stats.data(), expected.data(),
                               expected.size() * sizeof(double)))
          << "step " << step << " partition " << p.id;
      // A statistic that is not zero (the sums of squares of each piece).
      EXPECT_GT(reply->piece_stats[0], 0.0);
      pieces[p.id] = reply->piece_stats;
    }
    // The worker's commit from the shard's statistics alone is the one
    // from its own.
    commit = *worker.CommitStep(step, {}, pieces);
    EXPECT_EQ(*own.CommitStep(step), commit) << step;
    EXPECT_TRUE(
        std::equal(worker.x().begin(), worker.x().end(), own.x().begin()))
        << step;
    ASSERT_TRUE(core->CommitValues(0, step, fingerprint, commit).ok());
    for (const auto& p : parts) {
      const PartitionSnapshot s = *core->FetchPartition(p.id, fingerprint);
      EXPECT_TRUE(std::equal(s.x.begin(), s.x.end(),
                             worker.x().begin() + p.range.begin))
          << step << " " << p.id;
      EXPECT_TRUE(std::equal(s.m.begin(), s.m.end(),
                             worker.m().begin() + p.range.begin))
          << step << " " << p.id;
    }
  }
  // Statistics of another count are refused (nothing moves).
  std::vector<std::vector<double>> wrong(parts.size());
  wrong[0] = {1.0};
  EXPECT_EQ(worker.CommitStep(4, {}, wrong).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LambShardTest, PartitionsApplyTheirCommitsFromTheirOwnThreads) {
  const proto::JobSpec job = *proto::ParseJobConfig(R"(
    workers: 1
    shards: 1
    synthetic { dim: 512 layer_elems: 100 }
    lr { lr: 0.01 }
    steps: 400
    block_elems: 16
    partition_elems: 64
    optimizer: "onebit_lamb"
    freeze_step: 4
  )",
                                                    proto::ConfigFormat::kText);
  std::unique_ptr<ShardCore> core = *ShardCore::Create(job, 0);
  const uint64_t fingerprint = core->layout().fingerprint();
  const auto parts = core->layout().partitions();
  ASSERT_EQ(parts.size(), 8u);
  ASSERT_NO_FATAL_FAILURE(InitializeAll(*core, 0));  // the only shard
  // Any well-formed commit will do: the shard checks its form, not how the
  // workers computed it. Step t's commit gives every layer the factor t.
  const size_t layers = compress::LayerCount(job.algorithm);
  const auto commit_of = [layers](int64_t step) {
    std::vector<double> c(compress::kLambCommit * layers, 1.0);
    for (size_t l = 0; l < layers; ++l)
      c[compress::kLambCommit * l + 2] = static_cast<double>(step);
    return c;
  };
  constexpr int64_t kSteps = 300;
  std::vector<std::thread> threads;
  std::vector<absl::Status> failures(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    threads.emplace_back([&, i] {
      const compress::Partition& p = parts[i];
      for (int64_t step = 0; step < kSteps && failures[i].ok(); ++step) {
        PushArgs a =
            EncodedPush(fingerprint, compress::PlanStep(job.algorithm, step).up,
                        step, 0, p);
        if (step > 0) a.previous_commit = commit_of(step - 1);
        core->Push(
            std::move(a),
            [&failures, i](absl::StatusOr<std::shared_ptr<const Reply>> r) {
              if (!r.ok()) failures[i] = r.status();
            });
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < parts.size(); ++i)
    ASSERT_TRUE(failures[i].ok()) << i << ": " << failures[i];
  ASSERT_TRUE(
      core->CommitValues(0, kSteps - 1, fingerprint, commit_of(kSteps - 1))
          .ok());
  for (const auto& p : parts) {
    auto snapshot = core->FetchPartition(p.id, fingerprint);
    ASSERT_TRUE(snapshot.ok()) << snapshot.status();
    EXPECT_EQ(snapshot->completed_steps, kSteps);
    EXPECT_EQ(Own(*snapshot, "lamb_layers"),
              compress::FlattenLambLayers(
                  compress::LambStateOf(commit_of(kSteps - 1))));
  }
}

TEST(ShardLimitsTest, MemoryAndModelSizeCaps) {
  auto job = *proto::ParseJobConfig(kConfig, proto::ConfigFormat::kText);
  // x, m, v and an fp32 error: 16 bytes per element of shard 1.
  const uint64_t bytes =
      16 *
      compress::Layout::Create(job.algorithm.layout)->shard_range(1).size();
  EXPECT_TRUE(ShardCore::Create(job, 1, bytes).ok());
  auto tight = ShardCore::Create(job, 1, bytes - 1);
  EXPECT_EQ(tight.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(tight.status().message().find("GiB of state"),
            absl::string_view::npos)
      << tight.status();

  auto base = *proto::ParseJobConfig(
      "workers: 2 shards: 1 external {} lr { lr: 0.01 } steps: 5 freeze_step: "
      "1",
      proto::ConfigFormat::kText);
  auto host = ShardHost::Create(base, 0, nullptr, /*max_model_elems=*/1000);
  ASSERT_TRUE(host.ok()) << host.status();
  auto big = *proto::ParseJobConfig(
      "workers: 2 shards: 1 external { dim: 1001 } lr { lr: 0.01 } steps: 5 "
      "freeze_step: 1",
      proto::ConfigFormat::kText);
  const absl::Status refused = (*host)->Join(0, big);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("--max_model_elems"),
            absl::string_view::npos)
      << refused;
  EXPECT_EQ((*host)->core(), nullptr);
  EXPECT_EQ((*host)->workers_joined(), 0u);
  auto fits = *proto::ParseJobConfig(
      "workers: 2 shards: 1 external { dim: 1000 } lr { lr: 0.01 } steps: 5 "
      "freeze_step: 1",
      proto::ConfigFormat::kText);
  EXPECT_TRUE((*host)->Join(0, fits).ok());
  EXPECT_NE((*host)->core(), nullptr);
}

// An external job (`head`: workers, shards, ...) of `dim` parameters laid out
// `generation` times (`extra`: more of external's fields), with the
// settings the ShardHost tests share.
proto::JobSpec LaidOut(absl::string_view head, uint64_t dim,
                       uint32_t generation, const std::string& extra = "") {
  return *proto::ParseJobConfig(
      absl::StrCat(head, " optimizer: \"adam\" external { dim: ", dim,
                   " generation: ", generation, extra,
                   " } lr { lr: 0.01 } steps: 50 block_elems: 16 "
                   "partition_elems: 64 timeouts { step_seconds: 1 }"),
      proto::ConfigFormat::kText);
}

// A model laid out anew mid-job (ExternalModel.generation, add_param_group):
// the shard serves the old core until every worker has joined with the next
// generation alike, then a fresh core of the new layout; a worker of an
// older generation, one that skips one, or one whose new layout differs
// from another's is refused, and none of them changes what the shard
// serves; the old core is freed once nothing holds it.
TEST(ShardHostTest, ANewLayoutTakesEffectOnceEveryWorkerJoinedWithIt) {
  const auto job = [](uint64_t dim, uint32_t generation,
                      const std::string& extra = "") {
    return LaidOut("workers: 2 shards: 1", dim, generation, extra);
  };
  std::vector<bool> relaid;
  auto host = ShardHost::Create(
      *proto::ParseJobConfig("workers: 2 shards: 1 optimizer: \"adam\" "
                             "external {} lr { lr: 0.01 } steps: 50",
                             proto::ConfigFormat::kText),
      0, [&](const proto::JobSpec&, ShardCore&, bool r) {
        relaid.push_back(r);
        return absl::OkStatus();
      });
  ASSERT_TRUE(host.ok()) << host.status();
  ShardHost& h = **host;
  ASSERT_TRUE(h.Join(0, job(100, 0)).ok());
  ASSERT_TRUE(h.Join(1, job(100, 0)).ok());
  std::shared_ptr<ShardCore> first = h.core();
  EXPECT_EQ(first->layout().spec().dim, 100u);
  InitializeAll(*first, 0);
  EXPECT_EQ(h.generation(), 0u);

  const absl::Status skipped = h.Join(0, job(160, 2));
  EXPECT_EQ(skipped.code(), absl::StatusCode::kFailedPrecondition) << skipped;
  ASSERT_TRUE(h.Join(0, job(160, 1, " groups: 96 groups: 64")).ok());
  EXPECT_EQ(h.core(), first);  // rank 1 has not joined it yet
  EXPECT_EQ(h.workers_joined(), 2u);
  EXPECT_EQ(h.workers_joined_next(), 1u);
  const absl::Status differs =
      h.Join(1, job(176, 1, " groups: 112 groups: 64"));
  EXPECT_EQ(differs.code(), absl::StatusCode::kFailedPrecondition) << differs;
  EXPECT_NE(differs.message().find("every rank must add the same"),
            std::string::npos)
      << differs;
  EXPECT_EQ(h.core(), first);
  EXPECT_EQ(h.workers_joined_next(), 1u);

  ASSERT_TRUE(h.Join(1, job(160, 1, " groups: 96 groups: 64")).ok());
  std::shared_ptr<ShardCore> second = h.core();
  ASSERT_NE(second, first);
  EXPECT_EQ(second->layout().spec().dim, 160u);
  EXPECT_EQ(second->layout().segment_count(), 2u);
  EXPECT_EQ(second->Status().partitions_initialized, 0u);  // rank 0 restores
  EXPECT_EQ(h.generation(), 1u);
  EXPECT_EQ(h.workers_joined(), 2u);
  EXPECT_EQ(h.workers_joined_next(), 0u);
  EXPECT_EQ(relaid, (std::vector<bool>{false, true}));
  // The old core lives while a call holds it (here the test), answering
  // pushes with the reason, and goes with the last holder.
  EXPECT_EQ(first->layout().spec().dim, 100u);
  auto answer = std::make_shared<absl::Status>(absl::UnknownError("none"));
  first->Push(EncodedPush(first->layout().fingerprint(),
                          compress::PlanStep(job(100, 0).algorithm, 0).up, 0, 0,
                          first->layout().shard_partitions(0)[0]),
              [answer](auto r) { *answer = r.status(); });
  EXPECT_EQ(answer->code(), absl::StatusCode::kFailedPrecondition) << *answer;
  EXPECT_NE(answer->message().find("laid out anew"), std::string::npos)
      << *answer;
  const std::weak_ptr<ShardCore> gone = first;
  first.reset();
  EXPECT_TRUE(gone.expired());

  const absl::Status old = h.Join(0, job(100, 0));
  EXPECT_EQ(old.code(), absl::StatusCode::kFailedPrecondition) << old;
  EXPECT_NE(old.message().find("at the same step"), std::string::npos) << old;
  EXPECT_TRUE(h.Join(0, job(160, 1, " groups: 96 groups: 64")).ok());
  EXPECT_EQ(h.core(), second);  // a rejoin of the generation served
}

// In an elastic job (min_workers 2 of 3) the ranks that left every
// partition's membership are not waited for when the model is laid out
// anew: the new core's steps leave them out from the start, and such a rank
// cannot join it later (its state is of the old layout). A rank still in
// some membership is waited for, and so is rank 0 (it restores the core).
TEST(ShardHostTest, AnElasticJobLaysItsModelOutAnewWithoutTheRanksThatLeft) {
  const auto job = [](uint64_t dim, uint32_t generation,
                      const std::string& extra = "") {
    return LaidOut("workers: 3 shards: 1 min_workers: 2", dim, generation,
                   extra);
  };
  auto host = ShardHost::Create(
      *proto::ParseJobConfig("workers: 3 shards: 1 min_workers: 2 optimizer: "
                             "\"adam\" external {} lr { lr: 0.01 } steps: 50 "
                             "timeouts { step_seconds: 1 }",
                             proto::ConfigFormat::kText),
      0, nullptr);
  ASSERT_TRUE(host.ok()) << host.status();
  ShardHost& h = **host;
  for (uint32_t r = 0; r < 3; ++r) ASSERT_TRUE(h.Join(r, job(100, 0)).ok());
  std::shared_ptr<ShardCore> first = h.core();
  InitializeAll(*first, 0);
  // Step 0 without rank 2: it leaves every partition's membership.
  const auto push = [](ShardCore& core, const proto::JobSpec& spec,
                       int64_t step, uint32_t rank) {
    auto replies =
        std::make_shared<std::vector<std::shared_ptr<const Reply>>>();
    for (const compress::Partition& p : core.layout().shard_partitions(0)) {
      core.Push(EncodedPush(core.layout().fingerprint(),
                            compress::PlanStep(spec.algorithm, step).up, step,
                            rank, p),
                [replies](auto r) {
                  if (r.ok()) replies->push_back(*r);
                });
    }
    return replies;
  };
  const auto zero = push(*first, job(100, 0), 0, 0);
  push(*first, job(100, 0), 0, 1);
  first->ExpireWaiting(absl::Now() + absl::Seconds(2));
  ASSERT_EQ(zero->size(), 2u);
  EXPECT_EQ(zero->front()->absent, std::vector<uint32_t>{2});
  EXPECT_EQ(first->InSomeMembership(), (std::vector<bool>{true, true, false}));

  // Rank 1 (a member) is waited for; then the new core, without rank 2.
  ASSERT_TRUE(h.Join(0, job(160, 1, " groups: 96 groups: 64")).ok());
  EXPECT_EQ(h.core(), first);
  ASSERT_TRUE(h.Join(1, job(160, 1, " groups: 96 groups: 64")).ok());
  std::shared_ptr<ShardCore> second = h.core();
  ASSERT_NE(second, first);
  EXPECT_EQ(h.generation(), 1u);
  EXPECT_EQ(second->InSomeMembership(), (std::vector<bool>{true, true, false}));
  // Its steps average ranks 0 and 1 at once, naming rank 2 left out.
  InitializeAll(*second, 0);
  const auto next = push(*second, job(160, 1, " groups: 96 groups: 64"), 0, 0);
  EXPECT_TRUE(next->empty());  // waits for rank 1
  push(*second, job(160, 1, " groups: 96 groups: 64"), 0, 1);
  ASSERT_EQ(next->size(), second->layout().shard_partitions(0).size());
  EXPECT_EQ(next->front()->absent, std::vector<uint32_t>{2});
  // Rank 2 cannot join the new layout, nor the old.
  for (const proto::JobSpec& late :
       {job(160, 1, " groups: 96 groups: 64"), job(100, 0)}) {
    const absl::Status refused = h.Join(2, late);
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_EQ(h.core(), second);
  }
  EXPECT_NE(h.Join(2, job(160, 1, " groups: 96 groups: 64"))
                .message()
                .find("had left this elastic job"),
            std::string::npos);
  EXPECT_TRUE(h.Join(0, job(160, 1, " groups: 96 groups: 64")).ok());

  // Rank 0 is waited for even when it has left: it restores the new core.
  auto again = ShardHost::Create(job(100, 0), 0, nullptr);
  ASSERT_TRUE(again.ok()) << again.status();
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE((*again)->Join(r, job(100, 0)).ok());
  }
  std::shared_ptr<ShardCore> core = (*again)->core();
  InitializeAll(*core, 0);
  push(*core, job(100, 0), 0, 1);
  push(*core, job(100, 0), 0, 2);
  core->ExpireWaiting(absl::Now() + absl::Seconds(2));
  EXPECT_EQ(core->InSomeMembership(), (std::vector<bool>{false, true, true}));
  ASSERT_TRUE((*again)->Join(1, job(160, 1, " groups: 96 groups: 64")).ok());
  ASSERT_TRUE((*again)->Join(2, job(160, 1, " groups: 96 groups: 64")).ok());
  EXPECT_EQ((*again)->core(), core);
  EXPECT_EQ((*again)->workers_joined_next(), 2u);
}

}  // namespace
}  // namespace morse::server
