// onebit_lamb (design.md 2.8) against the algorithm written out here element
// by element, with lossless fp32 messages: x, m, v, the fresh variance and
// every layer's state must match the simulator bit for bit through the
// warmup, the freeze and the compression phase, with layers that cross
// partitions and shards. Plus what the coefficients must do (clamps, the
// factor's threshold) and the config checks.
#include "compress/lamb.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <vector>

#include "compress/compute_pool.h"
#include "compress/optimizer.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "gtest/gtest.h"
#include "tests/compress/test_util.h"

namespace morse::compress {
namespace {

using testing::Replicas;
using testing::SameBits;

// design.md 2.8 written out: one worker loop per message, one pass per
// formula, layer sums over each layer's pieces in partition order, each
// piece's segments of 256 in order, each segment by halving.
class Reference {
 public:
  Reference(const AlgorithmConfig& c, absl::Span<const float> x0,
            const Layout& layout)
      : c_(c),
        layout_(layout),
        x_(x0.begin(), x0.end()),
        m_(x0.size()),
        v_(x0.size()),
        vf_(x0.size()) {
    bounds_.push_back(0);
    for (uint64_t size : c.layers) bounds_.push_back(bounds_.back() + size);
    freeze_.assign(c.layers.size(), 0.0f);
    last_.assign(c.layers.size(), 1.0f);
  }

  // `hypers`: each parameter group's lr and weight decay this step (one per
  // segment of the layout), or none for the job's.
  void Step(const std::vector<std::vector<float>>& g,
            const std::vector<StepHyper>& hypers = {}) {
    ++s_;
    const float b1 = c_.adam.beta1, b2 = c_.adam.beta2, eps = c_.adam.eps;
    // Element j's group.
    const auto group = [&](uint64_t j) {
      return std::upper_bound(c_.layout.cuts.begin(), c_.layout.cuts.end(), j) -
             c_.layout.cuts.begin();
    };
    const auto lr_of = [&](uint64_t j) {
      return hypers.empty() ? c_.lr.base_lr : hypers[group(j)].lr;
    };
    const auto wd_of = [&](uint64_t j) {
      return hypers.empty() ? c_.adam.weight_decay
                            : hypers[group(j)].weight_decay;
    };
    const auto correction = [&](float beta, int64_t t) {
      return c_.bias_correction
                 ? static_cast<float>(1.0 - std::pow(double{beta}, double(t)))
                 : 1.0f;
    };
    const bool warmup = s_ <= c_.freeze_step;
    const float bc1 = correction(b1, s_);
    const float bc2 = correction(b2, warmup ? s_ : c_.freeze_step);
    const float bc2_fresh = correction(b2, s_);
    const float bound = OneBitUpdateBound(c_.adam);
    const size_t n = x_.size();
    const uint32_t workers = c_.workers;
    // What the workers send, and its average.
    std::vector<float> a(n);
    for (size_t j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (uint32_t i = 0; i < workers; ++i) {
        const float sent =
            warmup
                ? g[i][j]
                : (v_[j] == 0.0f ? 0.0f : b1 * m_[j] + (1.0f - b1) * g[i][j]);
        sum += sent;
      }
      a[j] = sum / static_cast<float>(workers);
    }
    // Moments.
    for (size_t j = 0; j < n; ++j) {
      if (warmup) {
        m_[j] = b1 * m_[j] + (1.0f - b1) * a[j];
        v_[j] = b2 * v_[j] + (1.0f - b2) * (a[j] * a[j]);
        if (s_ == c_.freeze_step) vf_[j] = v_[j];
      } else {
        const float c = v_[j] == 0.0f ? 0.0f : a[j];
        const float gr = (c - b1 * m_[j]) / (1.0f - b1);
        vf_[j] = b2 * vf_[j] + (1.0f - b2) * (gr * gr);
        m_[j] = c;
      }
    }
    // Directions.
    std::vector<float> u(n), p(n), ratio(n);
    for (size_t j = 0; j < n; ++j) {
      const float d = std::sqrt(v_[j] / bc2) + eps;
      p[j] = (m_[j] / bc1) / d;
      if (!warmup) {
        p[j] = std::clamp(p[j], -bound, bound);
        ratio[j] = d / (std::sqrt(vf_[j] / bc2_fresh) + eps);
      }
      u[j] = p[j] + wd_of(j) * x_[j];
    }
    // Coefficients, layer by layer.
    coefficients_.assign(c_.layers.size(), 0.0f);
    for (size_t l = 0; l + 1 < bounds_.size(); ++l) {
      double s1 = 0, s2 = 0, most = 0;
      for (const Partition& part : layout_.partitions()) {
        const uint64_t begin = std::max(part.range.begin, bounds_[l]);
        const uint64_t end = std::min(part.range.end, bounds_[l + 1]);
        // Segments of 256 from the piece's start, each summed by halving.
        double piece1 = 0, piece2 = 0;
        for (uint64_t at = begin; at < end; at += 256) {
          std::vector<double> t1(256, 0.0), t2(256, 0.0);
          for (uint64_t j = at; j < std::min(end, at + 256); ++j) {
            t1[j - at] = warmup ? double{x_[j]} * x_[j] : double{u[j]} * u[j];
            t2[j - at] = warmup ? double{u[j]} * u[j] : double{p[j]} * p[j];
            if (!warmup) most = std::max(most, double{ratio[j]});
          }
          for (size_t half = 128; half >= 1; half /= 2) {
            for (size_t i = 0; i < half; ++i) {
              t1[i] += t1[i + half];
              t2[i] += t2[i + half];
            }
          }
          piece1 += t1[0];
          piece2 += t2[0];
        }
        s1 += piece1;
        s2 += piece2;
      }
      float coefficient = 1.0f;
      if (warmup) {
        if (s1 > 0 && s2 > 0) {
          coefficient = static_cast<float>(
              std::clamp(std::sqrt(s1) / std::sqrt(s2),
                         double{c_.lamb.min_coeff}, double{c_.lamb.max_coeff}));
          freeze_[l] = static_cast<float>(
              double{c_.lamb.coeff_beta} * freeze_[l] +
              (1.0 - double{c_.lamb.coeff_beta}) * coefficient);
        }
      } else {
        double factor = most;
        if (wd_of(bounds_[l]) > 0) {
          const double share =
              s1 > 0 ? std::min(1.0, std::sqrt(s2) / std::sqrt(s1)) : 1.0;
          factor = factor * share + (1.0 - share);
        }
        factor = std::clamp(factor, double{c_.lamb.factor_min},
                            double{c_.lamb.factor_max});
        factor = std::clamp(
            factor, last_[l] * (1.0 - double{c_.lamb.factor_threshold}),
            last_[l] * (1.0 + double{c_.lamb.factor_threshold}));
        last_[l] = static_cast<float>(factor);
        coefficient = static_cast<float>(double{freeze_[l]} * last_[l]);
      }
      coefficients_[l] = coefficient;
      for (uint64_t j = bounds_[l]; j < bounds_[l + 1]; ++j)
        x_[j] = x_[j] - (lr_of(j) * coefficient) * u[j];
    }
  }

  const std::vector<float>& x() const { return x_; }
  const std::vector<float>& m() const { return m_; }
  const std::vector<float>& v() const { return v_; }
  const std::vector<float>& v_fresh() const { return vf_; }
  const std::vector<float>& freeze() const { return freeze_; }
  const std::vector<float>& last() const { return last_; }
  const std::vector<float>& coefficients() const { return coefficients_; }

 private:
  AlgorithmConfig c_;
  const Layout& layout_;
  std::vector<float> x_, m_, v_, vf_;
  std::vector<uint64_t> bounds_;
  std::vector<float> freeze_, last_, coefficients_;
  int64_t s_ = 0;
};

AlgorithmConfig LambConfig() {
  AlgorithmConfig c;
  c.optimizer = OptimizerKind::kOneBitLamb;
  c.workers = 3;
  // Partitions of 1.5 segments: pieces of one and of two segments.
  c.layout = {1000, /*shards=*/2, /*block_elems=*/64, /*partition_elems=*/384};
  // Layers of very different sizes; the 600-element one crosses partitions
  // and both shards.
  c.layers = {10, 250, 600, 64, 76};
  c.warmup_codec = c.up_codec = c.down_codec = CodecSpec{CodecKind::kFp32, 64};
  c.worker_feedback = c.server_feedback = FeedbackSpec{FeedbackKind::kEf};
  c.freeze_step = 12;
  c.lr.base_lr = 0.01f;
  c.lamb.max_coeff =
      2.0f;  // reached by the large layer (its ||x|| / ||u|| is about 3)
  return c;
}

// `hypers_at(t)`: the groups' lr and weight decay at step t (none: the
// job's).
void RunAgainstReference(
    const AlgorithmConfig& c, int64_t steps,
    std::function<std::vector<StepHyper>(int64_t)> hypers_at = nullptr) {
  const size_t dim = c.layout.dim;
  std::vector<float> x0(dim), a(dim), target(dim);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (size_t j = 0; j < dim; ++j) {
    // Layer scales far apart, which is what LAMB's coefficients are for.
    const float scale =
        j < 10 ? 0.0f
               : (j < 260 ? 5.0f : 0.1f);  // layer 0 starts at 0: ||x|| = 0
    x0[j] = scale * uniform(rng), a[j] = 0.5f + 0.5f * uniform(rng),
    target[j] = uniform(rng);
  }
  auto layout = Layout::Create(c.layout);
  ASSERT_TRUE(layout.ok());
  auto sim = Simulator::Create(c, x0);
  ASSERT_TRUE(sim.ok()) << sim.status();
  Reference ref(c, x0, *layout);
  bool saw_factor_move = false, saw_max_coeff = false;
  std::vector<float> last(c.layers.size(), 1.0f);
  for (int64_t t = 0; t < steps; ++t) {
    std::vector<std::vector<float>> g(c.workers, std::vector<float>(dim));
    for (uint32_t i = 0; i < c.workers; ++i) {
      std::mt19937 noise(static_cast<uint32_t>(1000 * t + i));
      std::normal_distribution<float> normal(0.0f, 0.3f);
      for (size_t j = 0; j < dim; ++j) {
        g[i][j] = j % 7 == 0 ? 0.0f
                             : a[j] * (sim->x()[j] - target[j]) +
                                   normal(noise);  // dead: v = 0
      }
    }
    std::vector<absl::Span<const float>> views(g.begin(), g.end());
    const std::vector<StepHyper> hypers =
        hypers_at ? hypers_at(t) : std::vector<StepHyper>();
    ASSERT_TRUE(sim->Step(views, hypers).ok());
    ref.Step(g, hypers);
    ASSERT_TRUE(SameBits(sim->x(), ref.x())) << "x at step " << t;
    ASSERT_TRUE(SameBits(sim->m(), ref.m())) << "m at step " << t;
    ASSERT_TRUE(SameBits(sim->v(), ref.v())) << "v at step " << t;
    ASSERT_TRUE(SameBits(sim->v_fresh(), ref.v_fresh())) << "v' at step " << t;
    ASSERT_EQ(sim->layer_state().size(), 2 * c.layers.size());
    for (size_t l = 0; l < c.layers.size(); ++l) {
      ASSERT_EQ(sim->layer_state()[2 * l], ref.freeze()[l])
          << "layer " << l << " step " << t;
      ASSERT_EQ(sim->layer_state()[2 * l + 1], ref.last()[l])
          << "layer " << l << " step " << t;
      saw_max_coeff |= ref.coefficients()[l] == c.lamb.max_coeff;
      // The factor moves by at most factor_threshold a step.
      const float now = sim->layer_state()[2 * l + 1];
      EXPECT_LE(std::abs(now / last[l] - 1.0f),
                c.lamb.factor_threshold * 1.0001f)
          << l << " " << t;
      saw_factor_move |= now != last[l];
      last[l] = now;
    }
  }
  // The run went through the coefficients' clamp and moved the factors.
  EXPECT_TRUE(saw_max_coeff);
  EXPECT_TRUE(saw_factor_move);
}

TEST(LambTest, TheSimulatorIsTheAlgorithmWrittenOut) {
  RunAgainstReference(LambConfig(), 40);
}

TEST(LambTest, WithWeightDecayAndDeepSpeedsUncorrectedMoments) {
  AlgorithmConfig c = LambConfig();
  c.adam.weight_decay = 0.01f;
  c.bias_correction = false;
  c.lamb.factor_threshold = 0.05f;
  c.lamb.max_coeff = 1.0f;
  RunAgainstReference(c, 40);
}

// Partitions of 640 elements: the 600-element layer lies in pieces of
// several 256-element segments, whose order of summation design.md 2.8 fixes.
TEST(LambTest, PiecesLongerThanASegment) {
  AlgorithmConfig c = LambConfig();
  c.layout.partition_elems = 640;
  auto layout = Layout::Create(c.layout);
  ASSERT_TRUE(layout.ok());
  const std::vector<LayerPiece> pieces =
      LayerPieces(c, *layout, {0, c.layout.dim});
  uint64_t longest = 0;
  for (const LayerPiece& piece : pieces)
    longest = std::max(longest, piece.segments());
  ASSERT_GE(longest, 2u);
  RunAgainstReference(c, 30);
}

// Parameter groups with their own lr and weight decay (design.md 3's
// segments): the first of two layers and a padding layer (zeros no
// parameter uses, as morse.torch pads a group to whole blocks), a group of
// one layer that crosses partitions and shards, and a group of two layers.
AlgorithmConfig GroupedLambConfig() {
  AlgorithmConfig c = LambConfig();
  c.layers = {10, 236, 10, 640, 64, 40};
  c.layout.cuts = {256, 896};
  c.adam.weight_decay = 0.01f;
  return c;
}

// Each group's lr and weight decay, changing every step; the middle group
// without weight decay, the last at a tenth of the first's lr.
std::vector<StepHyper> GroupHypers(int64_t t) {
  const float lr = 0.01f * (1.0f - 0.01f * static_cast<float>(t));
  return {{lr, 0.01f}, {2.0f * lr, 0.0f}, {0.1f * lr, 0.05f}};
}

TEST(LambTest, GroupsTrainWithTheirOwnLrAndWeightDecay) {
  const AlgorithmConfig c = GroupedLambConfig();
  ASSERT_TRUE(ValidateAlgorithmConfig(c).ok());
  EXPECT_TRUE(OptimizerOf(c).HyperByPartition());
  EXPECT_EQ(*LayerSegments(c, "onebit_lamb"),
            (std::vector<uint32_t>{0, 0, 0, 1, 2, 2}));
  RunAgainstReference(c, 40, GroupHypers);
  // The groups' values matter: the same steps with the job's one lr and
  // weight decay end elsewhere.
  const size_t dim = c.layout.dim;
  std::vector<float> x0(dim);
  for (size_t j = 0; j < dim; ++j) x0[j] = j < 246 ? std::sin(0.1f * j) : 0.5f;
  auto grouped = Simulator::Create(c, x0), plain = Simulator::Create(c, x0);
  ASSERT_TRUE(grouped.ok() && plain.ok());
  for (int64_t t = 0; t < 16; ++t) {
    std::vector<float> g(dim);
    for (size_t j = 0; j < dim; ++j) g[j] = std::cos(0.01f * j * (t + 1));
    std::vector<absl::Span<const float>> views(c.workers, g);
    ASSERT_TRUE(grouped->Step(views, GroupHypers(t)).ok());
    ASSERT_TRUE(plain->Step(views).ok());
  }
  for (size_t j : {0, 300, 950}) EXPECT_NE(grouped->x()[j], plain->x()[j]) << j;
  // A count of hypers that is neither one nor one per group is refused.
  std::vector<absl::Span<const float>> views(c.workers,
                                             absl::Span<const float>(x0));
  EXPECT_EQ(grouped->Step(views, {{0.01f, 0.0f}, {0.01f, 0.0f}}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LambTest, AGroupMustStartOnALayer) {
  AlgorithmConfig c = GroupedLambConfig();
  c.layers = {10, 250, 640, 64, 36};  // the cut at 256 is inside [10, 260)
  const absl::Status s = ValidateAlgorithmConfig(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("starts inside layer 1"), absl::string_view::npos)
      << s;
  c.layers.clear();  // one layer: every group inside it
  EXPECT_EQ(ValidateAlgorithmConfig(c).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LambTest, LayersDefaultToOneAndMustCoverTheModel) {
  AlgorithmConfig c = LambConfig();
  c.layers.clear();
  EXPECT_EQ(LayerBounds(c), (std::vector<uint64_t>{0, 1000}));
  c.layers = {500, 400};
  EXPECT_EQ(ValidateAlgorithmConfig(c).code(),
            absl::StatusCode::kInvalidArgument);
  c.layers = {500, 0, 500};
  EXPECT_EQ(ValidateAlgorithmConfig(c).code(),
            absl::StatusCode::kInvalidArgument);
  c.layers = {1000};
  EXPECT_TRUE(ValidateAlgorithmConfig(c).ok());
}

TEST(LambTest, BadSpecsAreRefused) {
  const auto refused = [](auto edit) {
    AlgorithmConfig c = LambConfig();
    edit(c);
    return ValidateAlgorithmConfig(c).code() ==
           absl::StatusCode::kInvalidArgument;
  };
  EXPECT_TRUE(refused([](AlgorithmConfig& c) { c.lamb.min_coeff = 0; }));
  EXPECT_TRUE(refused([](AlgorithmConfig& c) { c.lamb.max_coeff = 0.001f; }));
  EXPECT_TRUE(refused([](AlgorithmConfig& c) { c.lamb.coeff_beta = 1.0f; }));
  EXPECT_TRUE(refused([](AlgorithmConfig& c) { c.lamb.factor_min = 0; }));
  EXPECT_TRUE(refused([](AlgorithmConfig& c) { c.lamb.factor_max = 0.1f; }));
  EXPECT_TRUE(
      refused([](AlgorithmConfig& c) { c.lamb.factor_threshold = -0.1f; }));
  EXPECT_TRUE(refused([](AlgorithmConfig& c) { c.lamb.max_coeff = INFINITY; }));
  EXPECT_TRUE(refused([](AlgorithmConfig& c) { c.clip_grad_norm = -1.0f; }));
  EXPECT_TRUE(refused([](AlgorithmConfig& c) { c.freeze_step = 0; }));
}

TEST(LambTest, ItsPlansAreOneBitAdamsExchange) {
  const AlgorithmConfig c = LambConfig();
  AlgorithmConfig adam = c;
  adam.optimizer = OptimizerKind::kOneBitAdam;
  for (int64_t t : {0, 11, 12, 30}) {
    EXPECT_EQ(PlanStep(c, t).compressing, PlanStep(adam, t).compressing) << t;
    EXPECT_EQ(PlanStep(c, t).up.kind, PlanStep(adam, t).up.kind) << t;
    EXPECT_STREQ(PhaseName(c, t), PhaseName(adam, t));
    EXPECT_TRUE(PlanReply(c, t).lamb);
    EXPECT_EQ(PlanReply(c, t).copy_fresh, t == 11);
  }
  EXPECT_NE(AlgorithmFingerprint(c), AlgorithmFingerprint(adam));
  AlgorithmConfig other = c;
  other.layers = {10, 250, 600, 70, 70};
  EXPECT_NE(AlgorithmFingerprint(c), AlgorithmFingerprint(other));
}

// A worker replica applies every reply then its own commit; each shard's
// mirror applies its partitions' replies and then the worker's commit, each
// partition with its group's lr and weight decay (`hypers_at`, as pushes
// carry them). Leaves the replicas of the last step.
void RunWorkerAndMirrors(
    AlgorithmConfig c, std::optional<Replicas>& out,
    std::function<std::vector<StepHyper>(int64_t)> hypers_at = nullptr) {
  c.up_codec = c.down_codec = CodecSpec{CodecKind::kFp32, 64};
  c.workers = 1;
  const size_t dim = c.layout.dim;
  auto layout = Layout::Create(c.layout);
  ASSERT_TRUE(layout.ok());
  std::vector<float> x0(dim);
  for (size_t j = 0; j < dim; ++j) x0[j] = std::sin(0.1f * j);
  auto sim = Simulator::Create(c, x0);
  ASSERT_TRUE(sim.ok());
  Replicas replicas = testing::ReplicasFrom(c, *layout, x0);
  Replica& worker = replicas.worker;
  std::vector<Replica>& mirrors = replicas.mirrors;
  ComputePool pool(2);
  for (int64_t t = 0; t < 24; ++t) {
    const std::vector<StepHyper> hypers =
        hypers_at ? hypers_at(t) : std::vector<StepHyper>();
    std::vector<float> g(dim);
    for (size_t j = 0; j < dim; ++j)
      g[j] = std::cos(0.01f * j * (t + 1)) + sim->x()[j];
    // One worker with fp32 both ways: the reply is its message.
    std::vector<float> message(dim);
    if (PlanStep(c, t).compressing) {
      worker.LocalMomentum(c.adam.beta1, 0, g, absl::MakeSpan(message));
      for (size_t j = 0; j < dim; ++j)
        message[j] = worker.v()[j] == 0.0f ? 0.0f : message[j];
    } else {
      message = g;
    }
    // On odd steps as a worker's engine does it: the segments of each
    // partition from the pass that applies its reply (the bits of
    // LambSegments after it), their pieces' sums (LambPieceSums, what a
    // shard sends with the reply) taken for some, the others left to
    // LambStep.
    std::vector<std::vector<double>> applied;
    ASSERT_TRUE(
        testing::ApplyToWorkerAndMirrors(replicas, *layout, t, message, hypers,
                                         t % 2 == 1 ? &applied : nullptr)
            .ok());
    std::vector<std::vector<double>> pieces;
    if (t % 2 == 1) {
      pieces.resize(layout->partitions().size());
      for (const Partition& p : layout->partitions()) {
        const std::vector<double> after =
            worker.SegmentStats(t, p.range, HyperOf(hypers, p.segment));
        ASSERT_EQ(applied[p.id].size(), after.size()) << p.id;
        ASSERT_EQ(
            std::memcmp(applied[p.id].data(), after.data(), 8 * after.size()),
            0)
            << "partition " << p.id << " step " << t;
        if (p.id % 2 == 0 || t % 4 == 3)
          pieces[p.id] = PieceStats(*OptimizerOf(c).Layers(),
                                    LayerPiecesOf(c, p.range), applied[p.id]);
      }
    }
    // Every fourth step, as the engine does when a layer's last piece lands:
    // layers 0, 2 and the last move first (MoveLambLayer), LambStep the rest.
    std::vector<bool> moved;
    if (t % 4 == 3) {
      moved.assign(c.layers.size(), false);
      for (size_t l : {size_t{0}, size_t{2}, c.layers.size() - 1}) {
        std::vector<LayerPiece> of;
        for (const LayerPiece& piece : LayerPieces(c, *layout, {0, dim}))
          if (piece.layer == l) of.push_back(piece);
        const StepHyper* hyper =
            HyperOf(hypers, LayerSegments(c, "onebit_lamb").value()[l]);
        const std::vector<double> layer_pieces = PieceStats(
            *OptimizerOf(c).Layers(), of,
            SegmentStatsOf(*OptimizerOf(c).Layers(), PlanReply(c, t, hyper), of,
                           {0, dim}, worker.x(), worker.m(), worker.v(),
                           worker.v_fresh()));
        ASSERT_TRUE(worker.MoveLayer(t, l, hyper, layer_pieces).ok());
        moved[l] = true;
      }
      // Statistics of a moved layer cannot be taken from x now.
      std::vector<std::vector<double>> missing = pieces;
      missing[0].clear();
      EXPECT_EQ(
          worker.CommitStep(t, hypers, missing, nullptr, moved).status().code(),
          absl::StatusCode::kInvalidArgument);
    }
    // Every third step moves x over the partitions on a pool.
    auto commit = worker.CommitStep(t, hypers, pieces,
                                    t % 3 == 2 ? &pool : nullptr, moved);
    ASSERT_TRUE(commit.ok()) << commit.status();
    for (const Partition& p : layout->partitions()) {
      ASSERT_TRUE(mirrors[p.shard]
                      .ApplyCommit(t, p.range.begin, p.range.size(), *commit,
                                   HyperOf(hypers, p.segment))
                      .ok());
    }
    std::vector<absl::Span<const float>> views{g};
    ASSERT_TRUE(sim->Step(views, hypers).ok());
    ASSERT_TRUE(SameBits(worker.x(), sim->x())) << "worker x at step " << t;
    ASSERT_TRUE(SameBits(worker.v_fresh(), sim->v_fresh()))
        << "worker v' at step " << t;
    for (uint32_t s = 0; s < c.layout.shards; ++s) {
      const Range r = layout->shard_range(s);
      ASSERT_TRUE(SameBits(mirrors[s].x(), sim->x().subspan(r.begin, r.size())))
          << "shard " << s << " step " << t;
      ASSERT_TRUE(
          SameBits(mirrors[s].m(), sim->m().subspan(r.begin, r.size())));
      ASSERT_TRUE(SameBits(mirrors[s].v_fresh(),
                           sim->v_fresh().subspan(r.begin, r.size())));
    }
    // The layers' state a shard keeps with each partition, and the worker's.
    ASSERT_EQ(LambStateOf(*commit)[2].last_factor, sim->layer_state()[5]);
    ASSERT_EQ(worker.layer_state()[5], sim->layer_state()[5]);
  }
  out.emplace(std::move(replicas));
}

TEST(LambTest, AWorkerAndShardMirrorsGiveTheSimulatorsBits) {
  const AlgorithmConfig c = LambConfig();
  std::optional<Replicas> replicas;
  RunWorkerAndMirrors(c, replicas);
  ASSERT_TRUE(replicas.has_value());
  Replica& worker = replicas->worker;
  std::vector<Replica>& mirrors = replicas->mirrors;
  auto layout = Layout::Create(c.layout);
  ASSERT_TRUE(layout.ok());
  // A malformed commit changes nothing.
  const std::vector<float> before(mirrors[0].x().begin(), mirrors[0].x().end());
  std::vector<double> bad(kLambCommit * c.layers.size(), 1.0);
  bad[4] = -1.0;
  EXPECT_EQ(mirrors[0].ApplyCommit(24, 0, 128, bad).code(),
            absl::StatusCode::kInvalidArgument);
  bad[4] = 0.1;  // not a float
  EXPECT_EQ(mirrors[0].ApplyCommit(24, 0, 128, bad).code(),
            absl::StatusCode::kInvalidArgument);
  bad.pop_back();
  EXPECT_EQ(mirrors[0].ApplyCommit(24, 0, 128, bad).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameBits(mirrors[0].x(), before));
  EXPECT_EQ(mirrors[0].CommitStep(24).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Piece statistics for another layout, or of the wrong length, change
  // nothing either.
  const std::vector<float> worker_before(worker.x().begin(), worker.x().end());
  std::vector<std::vector<double>> wrong(layout->partitions().size() + 1);
  EXPECT_EQ(worker.CommitStep(24, {}, wrong).status().code(),
            absl::StatusCode::kInvalidArgument);
  wrong.pop_back();
  wrong[1] = {1.0};  // never 3 per piece
  EXPECT_EQ(worker.CommitStep(24, {}, wrong).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameBits(worker.x(), worker_before));
}

TEST(LambTest, WithGroupsAWorkerAndShardMirrorsGiveTheSimulatorsBits) {
  std::optional<Replicas> replicas;
  RunWorkerAndMirrors(GroupedLambConfig(), replicas, GroupHypers);
  ASSERT_TRUE(replicas.has_value());
  // Two hypers for three groups change nothing.
  Replica& worker = replicas->worker;
  const std::vector<float> before(worker.x().begin(), worker.x().end());
  EXPECT_EQ(
      worker.CommitStep(24, {{0.01f, 0.0f}, {0.01f, 0.0f}}).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameBits(worker.x(), before));
}

}  // namespace
}  // namespace morse::compress
