// Pipeline boundaries (compress/boundary.h): spec parsing, the three
// feedbacks' rules against their formulas, the two ends of AQ-SGD staying
// bit-identical, and state that survives a save and refuses bad input.
#include "compress/boundary.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/compress/test_util.h"

namespace morse::compress {
namespace {

using testing::SameBits;

BoundarySpec Spec(absl::string_view text) {
  auto spec = ParseBoundarySpec(text);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// Activation-like rows: a per-sample pattern plus noise, shifting slowly
// with `step` as the model trains.
std::vector<float> Rows(const std::vector<int64_t>& samples, size_t cols,
                        int step) {
  std::vector<float> x;
  for (int64_t s : samples) {
    std::mt19937 rng(static_cast<uint32_t>(s));
    std::normal_distribution<float> normal;
    for (size_t c = 0; c < cols; ++c)
      x.push_back(normal(rng) + 0.01f * step * std::sin(float(c + s)));
  }
  return x;
}

TEST(BoundarySpecTest, ParsesAndNamesEveryForm) {
  for (const char* text :
       {"fp32", "fp16", "bf16", "int8", "int4/128", "topk:0.1", "topk:0.3+ef",
        "int8+aq", "topk:0.1+aq", "int4+ef"}) {
    auto spec = ParseBoundarySpec(text);
    ASSERT_TRUE(spec.ok()) << text << ": " << spec.status();
    EXPECT_EQ(BoundarySpecName(*spec), text);
  }
  EXPECT_EQ(Spec("int4/128").codec.block_elems, 128u);
  EXPECT_EQ(Spec("topk:0.3+ef").codec.topk_ratio, 0.3);
  EXPECT_EQ(Spec("int8+aq").feedback, BoundaryFeedback::kAqSgd);
}

TEST(BoundarySpecTest, RefusesWhatIsNotABoundary) {
  for (const char* text : {"sign1", "topk", "topk:0", "topk:1.5", "int8:0.1",
                           "int8+ema", "int8/10", "int8/x", "gzip", ""}) {
    auto spec = ParseBoundarySpec(text);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
}

TEST(BoundaryCodecTest, NoFeedbackSendsTheCodecOfX) {
  const std::vector<float> x = Rows({1, 2, 3, 4}, 96, 0);
  for (const char* text : {"fp32", "fp16", "int8/32", "topk:0.25"}) {
    BoundaryCodec sender(Spec(text)), receiver(Spec(text));
    std::string payload;
    ASSERT_TRUE(sender.Encode(x, 4, {}, 0, &payload).ok());
    EXPECT_EQ(payload.size(), BoundaryPayloadBytes(sender.spec(), 4, 96, 0));
    std::vector<float> out(x.size()), want(x.size());
    ASSERT_TRUE(receiver.Decode(payload, 4, {}, absl::MakeSpan(out)).ok());
    std::vector<uint8_t> direct(PayloadBytes(sender.spec().codec, x.size()));
    ASSERT_TRUE(
        compress::Encode(sender.spec().codec, x, {}, absl::MakeSpan(direct))
            .ok());
    ASSERT_TRUE(
        compress::Decode(sender.spec().codec, direct, absl::MakeSpan(want))
            .ok());
    EXPECT_TRUE(SameBits(out, want)) << text;
    if (std::string(text) == "fp32") {
      EXPECT_TRUE(SameBits(out, x));
    }
  }
}

TEST(BoundaryCodecTest, ErrorFeedbackCarriesWhatWasNotSentPerSlot) {
  BoundaryCodec sender(Spec("topk:0.1+ef")), receiver(Spec("topk:0.1+ef"));
  const size_t n = 4 * 50;
  std::vector<float> sent_sum(n, 0.0f), x_sum(n, 0.0f);
  for (int step = 0; step < 6; ++step) {
    const std::vector<float> x = Rows({1, 2, 3, 4}, 50, step);
    std::string payload;
    ASSERT_TRUE(sender.Encode(x, 4, {}, /*slot=*/0, &payload).ok());
    std::vector<float> out(n);
    ASSERT_TRUE(receiver.Decode(payload, 4, {}, absl::MakeSpan(out)).ok());
    for (size_t j = 0; j < n; ++j) {
      sent_sum[j] += out[j];
      x_sum[j] += x[j];
    }
  }
  // Telescoping: what was sent plus what is still owed is what was given.
  BoundaryCodec probe(Spec("topk:0.1+ef"));
  ASSERT_TRUE(probe.LoadState(sender.SaveState()).ok());
  std::string payload;
  const std::vector<float> zero(n, 0.0f);
  // Sending zeros from slot 0 sends part of the owed error; from another slot,
  // nothing.
  ASSERT_TRUE(probe.Encode(zero, 4, {}, 7, &payload).ok());
  std::vector<float> nothing(n);
  ASSERT_TRUE(BoundaryCodec::DecodeStateless(probe.spec().codec, payload,
                                             absl::MakeSpan(nothing))
                  .ok());
  for (float v : nothing) EXPECT_EQ(v, 0.0f);
  double owed = 0, gap = 0;
  // e = sum x - sum sent, up to fp32 rounding of the running sums.
  ASSERT_NE(sender.SlotError(0), nullptr);
  const std::vector<float>& e = *sender.SlotError(0);
  ASSERT_EQ(e.size(), n);
  EXPECT_EQ(sender.SlotError(1), nullptr);
  for (size_t j = 0; j < n; ++j) {
    owed += std::abs(e[j]);
    gap = std::max(gap, double(std::abs(x_sum[j] - sent_sum[j] - e[j])));
  }
  EXPECT_GT(owed, 1.0);
  EXPECT_LT(gap, 1e-4);
}

TEST(BoundaryCodecTest, AqSgdEndsStayBitIdenticalAndConverge) {
  BoundaryCodec sender(Spec("int4/32+aq")), receiver(Spec("int4/32+aq"));
  const size_t cols = 64;
  std::vector<int64_t> batch_a = {10, 11, 12}, batch_b = {12, 13, 10};
  for (int step = 0; step < 8; ++step) {
    const auto& samples = step % 2 ? batch_b : batch_a;
    const std::vector<float> x =
        Rows(samples, cols, 0);  // the same activations again
    std::string payload;
    ASSERT_TRUE(sender.Encode(x, 3, samples, 0, &payload).ok());
    std::vector<float> out(x.size());
    ASSERT_TRUE(receiver.Decode(payload, 3, samples, absl::MakeSpan(out)).ok());
    if (step == 0) {
      EXPECT_TRUE(SameBits(out, x)) << "first visits are sent in full";
      EXPECT_EQ(payload.size(), 3 + 3 * cols * 4);
    }
    EXPECT_TRUE(SameBits(out, x))
        << "unchanged activations cost nothing after the first visit";
    for (int64_t s : samples) {
      ASSERT_NE(receiver.SampleBuffer(s), nullptr);
      EXPECT_TRUE(SameBits(*sender.SampleBuffer(s), *receiver.SampleBuffer(s)))
          << "sample " << s;
    }
  }
  EXPECT_EQ(sender.samples_seen(), 4u);
  // Activations that drift slowly arrive far closer than int4 of x itself
  // would bring them: the buffers track them and only the change is rounded.
  BoundaryCodec drift_sender(Spec("int4/32+aq")),
      drift_receiver(Spec("int4/32+aq"));
  for (int step = 0; step < 5; ++step) {
    const std::vector<float> x = Rows(batch_a, cols, step);
    std::string payload;
    ASSERT_TRUE(drift_sender.Encode(x, 3, batch_a, 0, &payload).ok());
    std::vector<float> out(x.size()), plain(x.size());
    ASSERT_TRUE(
        drift_receiver.Decode(payload, 3, batch_a, absl::MakeSpan(out)).ok());
    if (step == 0) continue;
    EXPECT_LT(payload.size(), 3 * cols * 4 / 4);
    std::string direct;
    ASSERT_TRUE(
        BoundaryCodec::EncodeStateless(drift_sender.spec().codec, x, &direct)
            .ok());
    ASSERT_TRUE(BoundaryCodec::DecodeStateless(drift_sender.spec().codec,
                                               direct, absl::MakeSpan(plain))
                    .ok());
    double aq_error = 0, plain_error = 0;
    for (size_t j = 0; j < x.size(); ++j) {
      aq_error += std::abs(out[j] - x[j]);
      plain_error += std::abs(plain[j] - x[j]);
    }
    EXPECT_LT(aq_error * 10, plain_error) << "step " << step;
  }
}

TEST(BoundaryCodecTest, AqSgdRefusesEndsOutOfStepAndChangesNothing) {
  BoundaryCodec sender(Spec("int8+aq")), receiver(Spec("int8+aq"));
  const std::vector<int64_t> samples = {1, 2};
  std::string payload;
  ASSERT_TRUE(
      sender.Encode(Rows(samples, 16, 0), 2, samples, 0, &payload).ok());
  ASSERT_TRUE(
      sender.Encode(Rows(samples, 16, 1), 2, samples, 0, &payload).ok());
  std::vector<float> out(32, -7.0f);
  absl::Status s = receiver.Decode(payload, 2, samples, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("out of step"), std::string::npos) << s;
  EXPECT_EQ(receiver.samples_seen(), 0u);
  for (float v : out) EXPECT_EQ(v, -7.0f);
  // Bad shapes and duplicate or missing samples are refused before anything.
  EXPECT_EQ(sender.Encode(Rows(samples, 16, 0), 2, {1}, 0, &payload).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sender.Encode(Rows(samples, 16, 0), 2, {3, 3}, 0, &payload).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sender.Encode(Rows({3, 4}, 8, 0), 2, {3, 4}, 0, &payload).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> bad = Rows({5, 6}, 16, 0);
  bad[3] = NAN;
  EXPECT_EQ(sender.Encode(bad, 2, {5, 6}, 0, &payload).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sender.samples_seen(), 2u);
}

TEST(BoundaryCodecTest, StateSurvivesASaveAndRefusesBadBytes) {
  BoundaryCodec a(Spec("topk:0.2+aq")), b(Spec("topk:0.2+aq"));
  const std::vector<int64_t> samples = {4, 9, 2};
  std::string payload;
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(
        a.Encode(Rows(samples, 20, step), 3, samples, 0, &payload).ok());
  }
  const std::string state = a.SaveState();
  ASSERT_TRUE(b.LoadState(state).ok());
  EXPECT_EQ(b.SaveState(), state);
  std::string pa, pb;
  ASSERT_TRUE(a.Encode(Rows(samples, 20, 5), 3, samples, 0, &pa).ok());
  ASSERT_TRUE(b.Encode(Rows(samples, 20, 5), 3, samples, 0, &pb).ok());
  EXPECT_EQ(pa, pb);

  BoundaryCodec other(Spec("int8+aq"));
  EXPECT_EQ(other.LoadState(state).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.LoadState(state.substr(0, state.size() - 3)).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(b.LoadState("garbage").code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(b.SaveState(), a.SaveState()) << "a refused load changed the state";
}

}  // namespace
}  // namespace morse::compress
