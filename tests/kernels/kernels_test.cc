// Every GPU kernel of kernels/ against compress/ (the CPU reference) on
// random inputs: identical payload bytes, error buffers and updated x, m, v,
// bit for bit (the kernels reproduce compress/'s scale reductions, so even
// the scales match; DESIGN 2.5 would allow them 1e-6). Outputs are poisoned
// before every run, so an element a kernel forgets to write shows up.
// Sizes: 0, 1, 7, B-1, B, B+1, odd multi-block sizes and 64 MiB of floats.
// The mlp workload's operations (kernels/mlp.h) against the CPU's
// (worker/mlp_backprop.h): element-wise ones and column sums exactly, the
// softmax and the cuBLAS products to rounding.
// Skips, saying why, when there is no GPU.
#include "compress/kernels.h"

#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/codec.h"
#include "compress/error_feedback.h"
#include "compress/lamb.h"
#include "compress/layout.h"
#include "compress/optimizer.h"
#include "compress/replica.h"
#include "compress/stochastic_rounding.h"
#include "compress/update_rules.h"
#include "gtest/gtest.h"
#include "kernels/codecs.h"
#include "kernels/device.h"
#include "kernels/layers.h"
#include "kernels/mlp.h"
#include "worker/mlp_backprop.h"

namespace morse {
namespace {

using compress::CodecKind;
using compress::CodecSpec;
using compress::FeedbackArgs;
using compress::FeedbackKind;

constexpr uint8_t kPoison = 0xA5;

// Values spread over several binades, both signs, some exact zeros.
std::vector<float> RandomValues(size_t n, uint64_t seed, float scale) {
  std::vector<float> u(n);
  compress::RoundingKey key;
  key.seed = seed;
  compress::FillDraws(key, u.data(), n);
  for (size_t i = 0; i < n; ++i) {
    const float d = u[i];
    u[i] = (i % 97 == 13) ? 0.0f : (d - 0.5f) * scale * (1.0f + 15.0f * d * d);
  }
  return u;
}

template <class T>
kernels::DeviceBuffer Upload(const std::vector<T>& host) {
  auto buffer = kernels::DeviceBuffer::Allocate(sizeof(T) * host.size());
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_TRUE(buffer->Upload(host.data(), sizeof(T) * host.size()).ok());
  return *std::move(buffer);
}

template <class T>
std::vector<T> Download(const kernels::DeviceBuffer& buffer, size_t n) {
  std::vector<T> host(n);
  EXPECT_TRUE(buffer.Download(host.data(), sizeof(T) * n).ok());
  return host;
}

kernels::DeviceBuffer Poisoned(size_t bytes) {
  auto buffer = kernels::DeviceBuffer::Allocate(bytes);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_TRUE(buffer->Fill(kPoison).ok());
  return *std::move(buffer);
}

// Index and values of the first difference, or "" when the bytes are equal.
std::string FirstDifference(const void* a, const void* b, size_t bytes,
                            size_t unit) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  for (size_t i = 0; i < bytes; ++i) {
    if (x[i] != y[i]) {
      return absl::StrCat("first difference at element ", i / unit, " (byte ",
                          i, "): ", int{x[i]}, " vs ", int{y[i]});
    }
  }
  return "";
}

class KernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = kernels::DeviceDescription();
    if (!device.ok())
      GTEST_SKIP() << "no GPU here: " << device.status().message();
    auto ctx = kernels::Context::Create();
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    ctx_ = *std::move(ctx);
  }

  // Encodes x (+ e) on both sides and compares payload and error. The
  // device arrays start `offset` floats into their allocations (1: not
  // 16-byte aligned, which the vectorized kernels must leave to others).
  void CheckEncode(const CodecSpec& spec, FeedbackArgs fb, size_t n,
                   uint64_t seed, size_t offset = 0) {
    SCOPED_TRACE(absl::StrCat(
        compress::CodecName(spec.kind), " n=", n, " offset=", offset,
        " block=", spec.block_elems, " feedback=", static_cast<int>(fb.kind),
        " stochastic=", spec.rounding == compress::Rounding::kStochastic));
    const std::vector<float> x = RandomValues(n, seed, 3.0f);
    std::vector<float> e = RandomValues(n, seed + 1, 0.5f);
    const bool feedback = fb.kind != FeedbackKind::kNone;
    compress::RoundingKey key{seed, 7, 3, 1000003};
    const size_t bytes = compress::PayloadBytes(spec, n);

    std::vector<uint8_t> cpu_payload(bytes);
    std::vector<float> cpu_e = e;
    ASSERT_TRUE(compress::EncodeWithError(
                    spec, x,
                    feedback ? absl::MakeSpan(cpu_e) : absl::Span<float>(), fb,
                    key, absl::MakeSpan(cpu_payload))
                    .ok());

    std::vector<float> padded_x(offset, 0.0f), padded_e(offset, 0.0f);
    padded_x.insert(padded_x.end(), x.begin(), x.end());
    padded_e.insert(padded_e.end(), e.begin(), e.end());
    kernels::DeviceBuffer dx = Upload(padded_x), de_all = Upload(padded_e);
    kernels::DeviceBuffer payload = Poisoned(bytes);
    ASSERT_TRUE(kernels::EncodeWithError(
                    *ctx_, spec, dx.as<float>() + offset,
                    feedback ? de_all.as<float>() + offset : nullptr, n, fb,
                    key, payload.as<uint8_t>())
                    .ok());
    const auto gpu_payload = Download<uint8_t>(payload, bytes);
    EXPECT_EQ(FirstDifference(gpu_payload.data(), cpu_payload.data(), bytes, 1),
              "")
        << "payload";
    const auto gpu_e_all = Download<float>(de_all, n + offset);
    const float* gpu_e = gpu_e_all.data() + offset;
    EXPECT_EQ(FirstDifference(gpu_e, cpu_e.data(), 4 * n, 4), "")
        << "error buffer";

    // Decode of the CPU's payload into a poisoned output.
    std::vector<float> cpu_out(n);
    ASSERT_TRUE(
        compress::Decode(spec, cpu_payload, absl::MakeSpan(cpu_out)).ok());
    kernels::DeviceBuffer in = Upload(cpu_payload);
    kernels::DeviceBuffer out = Poisoned(4 * (n + offset));
    ASSERT_TRUE(kernels::Decode(*ctx_, spec, in.as<uint8_t>(), n,
                                out.as<float>() + offset)
                    .ok());
    ASSERT_TRUE(ctx_->Synchronize().ok());
    const auto gpu_out = Download<float>(out, n + offset);
    EXPECT_EQ(
        FirstDifference(gpu_out.data() + offset, cpu_out.data(), 4 * n, 4), "")
        << "decode";
  }

  std::vector<size_t> Sizes(uint32_t block) {
    return {0,
            1,
            7,
            block - 1,
            block,
            block + 1,
            3 * size_t{block} + 5,
            17 * size_t{block} + 9};
  }

  std::unique_ptr<kernels::Context> ctx_;
};

TEST_F(KernelsTest, DeviceIsDescribed) {
  auto device = kernels::DeviceDescription();
  ASSERT_TRUE(device.ok());
  std::printf("GPU: %s\n", device->c_str());
}

TEST_F(KernelsTest, Sign1EncodeAndDecodeMatchTheCpu) {
  for (compress::ScaleKind scale :
       {compress::ScaleKind::kL2, compress::ScaleKind::kL1}) {
    for (FeedbackArgs fb : {FeedbackArgs{FeedbackKind::kNone, 1.0f},
                            FeedbackArgs{FeedbackKind::kEf, 1.0f},
                            FeedbackArgs{FeedbackKind::kEma, 0.3f}}) {
      CodecSpec spec;
      spec.kind = CodecKind::kSign1;
      spec.block_elems = 256;
      spec.scale = scale;
      for (size_t n : Sizes(spec.block_elems)) CheckEncode(spec, fb, n, 11 + n);
    }
  }
}

// The paths beside the staged and vectorized encode kernels (sign1, int8,
// int4): arrays that are not 16-byte aligned, and blocks too large to stage
// in shared memory.
TEST_F(KernelsTest, UnalignedArraysAndLargeBlocksMatchTheCpu) {
  for (FeedbackArgs fb : {FeedbackArgs{FeedbackKind::kEf, 1.0f},
                          FeedbackArgs{FeedbackKind::kEma, 0.3f}}) {
    CodecSpec spec;
    spec.kind = CodecKind::kSign1;
    spec.block_elems = 256;
    for (size_t n : Sizes(spec.block_elems))
      CheckEncode(spec, fb, n, 5 + n, /*offset=*/1);
    spec.block_elems = 16384;  // 64 KiB of u, 128 KiB with EMA's e
    for (size_t n : {size_t{16383}, size_t{16384} * 3 + 17})
      CheckEncode(spec, fb, n, 3 + n);
  }
  // The same for int8 and int4 (stochastic rounding too).
  for (CodecKind kind : {CodecKind::kInt8, CodecKind::kInt4}) {
    for (FeedbackArgs fb : {FeedbackArgs{FeedbackKind::kEf, 1.0f},
                            FeedbackArgs{FeedbackKind::kEma, 0.3f}}) {
      CodecSpec spec;
      spec.kind = kind;
      spec.rounding = compress::Rounding::kStochastic;
      spec.block_elems = 256;
      for (size_t n : Sizes(spec.block_elems))
        CheckEncode(spec, fb, n, 7 + n, /*offset=*/1);
      spec.block_elems = 16384;
      for (size_t n : {size_t{16383}, size_t{16384} * 2 + 9})
        CheckEncode(spec, fb, n, 5 + n);
    }
  }
}

TEST_F(KernelsTest, IntEncodeAndDecodeMatchTheCpu) {
  for (CodecKind kind : {CodecKind::kInt8, CodecKind::kInt4}) {
    for (compress::Rounding rounding :
         {compress::Rounding::kNearestEven, compress::Rounding::kStochastic}) {
      for (FeedbackArgs fb : {FeedbackArgs{FeedbackKind::kNone, 1.0f},
                              FeedbackArgs{FeedbackKind::kEf, 1.0f},
                              FeedbackArgs{FeedbackKind::kEma, 0.25f}}) {
        CodecSpec spec;
        spec.kind = kind;
        spec.block_elems = 64;
        spec.rounding = rounding;
        for (size_t n : Sizes(spec.block_elems))
          CheckEncode(spec, fb, n, 29 + n);
      }
    }
  }
}

TEST_F(KernelsTest, HalfAndBfloat16MatchTheCpu) {
  for (CodecKind kind : {CodecKind::kFp16, CodecKind::kBf16}) {
    for (FeedbackArgs fb : {FeedbackArgs{FeedbackKind::kNone, 1.0f},
                            FeedbackArgs{FeedbackKind::kEf, 1.0f},
                            FeedbackArgs{FeedbackKind::kEma, 0.5f}}) {
      CodecSpec spec;
      spec.kind = kind;
      for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{100003}})
        CheckEncode(spec, fb, n, 5 + n);
    }
  }
  // Special values: overflow to infinity, subnormals, NaN, signed zeros.
  CodecSpec spec;
  spec.kind = CodecKind::kFp16;
  for (CodecKind kind : {CodecKind::kFp16, CodecKind::kBf16}) {
    spec.kind = kind;
    const std::vector<float> specials = {
        0.0f,
        -0.0f,
        65504.0f,
        65520.0f,
        1e-7f,
        -3e-8f,
        6.1e-5f,
        std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::quiet_NaN(),
        3.4e38f};
    std::vector<uint8_t> cpu(2 * specials.size());
    ASSERT_TRUE(compress::Encode(spec, specials, {}, absl::MakeSpan(cpu)).ok());
    kernels::DeviceBuffer dx = Upload(specials);
    kernels::DeviceBuffer payload = Poisoned(cpu.size());
    ASSERT_TRUE(kernels::EncodeWithError(*ctx_, spec, dx.as<float>(), nullptr,
                                         specials.size(), {}, {},
                                         payload.as<uint8_t>())
                    .ok());
    const auto gpu = Download<uint8_t>(payload, cpu.size());
    EXPECT_EQ(FirstDifference(gpu.data(), cpu.data(), cpu.size(), 2), "")
        << compress::CodecName(kind);
  }
}

TEST_F(KernelsTest, SixtyFourMebibytesMatchTheCpu) {
  const size_t n =
      (size_t{64} << 20) / 4 + 3;  // 64 MiB of floats and a partial block
  CodecSpec spec;
  spec.kind = CodecKind::kSign1;
  spec.block_elems = 2048;
  CheckEncode(spec, {FeedbackKind::kEf, 1.0f}, n, 99);
  spec.kind = CodecKind::kInt4;
  spec.rounding = compress::Rounding::kStochastic;
  CheckEncode(spec, {FeedbackKind::kEma, 0.1f}, n, 98);
}

TEST_F(KernelsTest, UpdatesMatchTheCpu) {
  const compress::KernelTable& cpu = compress::ScalarKernels();
  compress::AdamScalars s;
  s.lr = 0.01f;
  s.weight_decay = 0.01f;
  s.bias_correction1 = 1.0f - 0.9f * 0.9f * 0.9f;
  s.bias_correction2 = 1.0f - 0.999f * 0.999f * 0.999f;
  // bound_update's clamp (DESIGN 2.1): with v = (0.01 r)^2 most ratios of
  // the frozen update exceed it.
  s.max_ratio = 3.1622777f;
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000003}}) {
    SCOPED_TRACE(n);
    const std::vector<float> g = RandomValues(n, 1, 1.0f),
                             x0 = RandomValues(n, 2, 1.0f),
                             m0 = RandomValues(n, 3, 0.1f);
    std::vector<float> v0 = RandomValues(n, 4, 0.01f);
    for (float& v : v0) v = v * v;
    // Adam.
    std::vector<float> x = x0, m = m0, v = v0;
    cpu.adam_update(s, g.data(), x.data(), m.data(), v.data(), n);
    kernels::DeviceBuffer dg = Upload(g), dx = Upload(x0), dm = Upload(m0),
                          dv = Upload(v0);
    ASSERT_TRUE(kernels::AdamUpdate(*ctx_, s, dg.as<float>(), dx.as<float>(),
                                    dm.as<float>(), dv.as<float>(), n)
                    .ok());
    ASSERT_TRUE(ctx_->Synchronize().ok());
    EXPECT_EQ(
        FirstDifference(Download<float>(dx, n).data(), x.data(), 4 * n, 4), "")
        << "adam x";
    EXPECT_EQ(
        FirstDifference(Download<float>(dm, n).data(), m.data(), 4 * n, 4), "")
        << "adam m";
    EXPECT_EQ(
        FirstDifference(Download<float>(dv, n).data(), v.data(), 4 * n, 4), "")
        << "adam v";
    // Frozen (1-bit Adam compression phase), plain and fused with a sign1
    // decode.
    x = x0;
    m = m0;
    cpu.frozen_update(s, g.data(), x.data(), m.data(), v0.data(), n,
                      /*mask=*/false);
    kernels::DeviceBuffer fx = Upload(x0), fm = Upload(m0), fv = Upload(v0);
    ASSERT_TRUE(kernels::FrozenUpdate(*ctx_, s, /*mask=*/false, dg.as<float>(),
                                      fx.as<float>(), fm.as<float>(),
                                      fv.as<float>(), n)
                    .ok());
    ASSERT_TRUE(ctx_->Synchronize().ok());
    EXPECT_EQ(
        FirstDifference(Download<float>(fx, n).data(), x.data(), 4 * n, 4), "")
        << "frozen x";
    EXPECT_EQ(
        FirstDifference(Download<float>(fm, n).data(), m.data(), 4 * n, 4), "")
        << "frozen m";

    CodecSpec spec;
    spec.kind = CodecKind::kSign1;
    spec.block_elems = 1024;
    std::vector<uint8_t> reply(compress::PayloadBytes(spec, n));
    ASSERT_TRUE(compress::Encode(spec, g, {}, absl::MakeSpan(reply)).ok());
    std::vector<float> c(n);
    ASSERT_TRUE(compress::Decode(spec, reply, absl::MakeSpan(c)).ok());
    x = x0;
    m = m0;
    cpu.frozen_update(s, c.data(), x.data(), m.data(), v0.data(), n,
                      /*mask=*/false);
    kernels::DeviceBuffer dreply = Upload(reply), rx = Upload(x0),
                          rm = Poisoned(4 * n);
    ASSERT_TRUE(kernels::DecodeFrozenUpdate(
                    *ctx_, spec, dreply.as<uint8_t>(), n, s, /*mask=*/false,
                    rx.as<float>(), rm.as<float>(), fv.as<float>())
                    .ok());
    ASSERT_TRUE(ctx_->Synchronize().ok());
    EXPECT_EQ(
        FirstDifference(Download<float>(rx, n).data(), x.data(), 4 * n, 4), "")
        << "fused x";
    EXPECT_EQ(
        FirstDifference(Download<float>(rm, n).data(), m.data(), 4 * n, 4), "")
        << "fused m";
    // Local momentum.
    std::vector<float> out(n);
    cpu.momentum(0.9f, m0.data(), g.data(), out.data(), n);
    kernels::DeviceBuffer dm0 = Upload(m0), dout = Poisoned(4 * n);
    ASSERT_TRUE(kernels::Momentum(*ctx_, 0.9f, dm0.as<float>(), dg.as<float>(),
                                  dout.as<float>(), n)
                    .ok());
    ASSERT_TRUE(ctx_->Synchronize().ok());
    EXPECT_EQ(
        FirstDifference(Download<float>(dout, n).data(), out.data(), 4 * n, 4),
        "")
        << "momentum";
  }
}

// Gradient clipping (design.md 2.6): the sum of squares in the CPU's
// segment order, byte for byte, and the scale.
TEST_F(KernelsTest, ClippingMatchesTheCpu) {
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{255}, size_t{257}, size_t{1000003}}) {
    SCOPED_TRACE(n);
    const std::vector<float> g = RandomValues(n, 9, 3.0f);
    const double cpu = compress::GradientSumOfSquares(g);
    const size_t segments = std::max<size_t>(
        1, (n + compress::kSumSegment - 1) / compress::kSumSegment);
    auto sums = kernels::DeviceBuffer::Allocate(8 * segments);
    auto host = kernels::PinnedBuffer::Allocate(8 * segments);
    ASSERT_TRUE(sums.ok() && host.ok());
    kernels::DeviceBuffer dg = Upload(g);
    auto gpu =
        kernels::SumOfSquares(*ctx_, dg.as<float>(), n, sums->as<double>(),
                              reinterpret_cast<double*>(host->data()));
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    EXPECT_EQ(std::memcmp(&*gpu, &cpu, 8), 0) << *gpu << " vs " << cpu;
    const float k = compress::ClipScale(cpu, 0.5f);
    std::vector<float> scaled(n);
    for (size_t j = 0; j < n; ++j) scaled[j] = g[j] * k;
    kernels::DeviceBuffer out = Poisoned(4 * n);
    ASSERT_TRUE(
        kernels::Scale(*ctx_, k, dg.as<float>(), out.as<float>(), n).ok());
    ASSERT_TRUE(ctx_->Synchronize().ok());
    EXPECT_EQ(FirstDifference(Download<float>(out, n).data(), scaled.data(),
                              4 * n, 4),
              "")
        << "scaled";
  }
}

// zero_one_adam's element loops (design.md 2.7) against compress/'s: the
// variance step, the local step (with and without writing x), the sync
// message (and its lr_sum = 0 case) and the sync update (masked), some
// ratios past the bound, some v exactly 0.
TEST_F(KernelsTest, ZeroOneAdamMatchesTheCpu) {
  compress::AdamScalars s;
  s.lr = 0.01f;
  s.weight_decay = 0.01f;
  s.bias_correction1 = 1.0f - 0.9f * 0.9f;
  s.bias_correction2 = 1.0f - 0.999f * 0.999f;
  s.max_ratio = 3.1622777f;
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000003}}) {
    SCOPED_TRACE(n);
    const std::vector<float> g = RandomValues(n, 1, 1.0f),
                             x0 = RandomValues(n, 2, 1.0f),
                             m0 = RandomValues(n, 3, 0.1f),
                             u0 = RandomValues(n, 5, 0.1f);
    std::vector<float> v0 = RandomValues(n, 4, 0.01f);
    for (size_t j = 0; j < n; ++j) v0[j] = j % 13 == 0 ? 0.0f : v0[j] * v0[j];
    const auto same = [&](const kernels::DeviceBuffer& d,
                          const std::vector<float>& cpu, const char* what) {
      EXPECT_EQ(
          FirstDifference(Download<float>(d, n).data(), cpu.data(), 4 * n, 4),
          "")
          << what;
    };
    {  // variance step
      std::vector<float> x = x0, m = m0, v = v0;
      compress::ZeroOneVarianceStep(s, g, absl::MakeSpan(x), absl::MakeSpan(m),
                                    absl::MakeSpan(v));
      kernels::DeviceBuffer dg = Upload(g), dx = Upload(x0), dm = Upload(m0),
                            dv = Upload(v0);
      ASSERT_TRUE(kernels::ZeroOneVarianceUpdate(*ctx_, s, dg.as<float>(),
                                                 dx.as<float>(), dm.as<float>(),
                                                 dv.as<float>(), n)
                      .ok());
      ASSERT_TRUE(ctx_->Synchronize().ok());
      same(dx, x, "variance x");
      same(dm, m, "variance m");
      same(dv, v, "variance v");
    }
    for (bool write_x : {true, false}) {  // local step
      std::vector<float> x = x0, m = m0, u = u0;
      compress::ZeroOneLocalStep(s, g, absl::MakeSpan(x), absl::MakeSpan(m),
                                 absl::MakeSpan(u), v0, write_x);
      kernels::DeviceBuffer dg = Upload(g), dx = Upload(x0), dm = Upload(m0),
                            du = Upload(u0), dv = Upload(v0);
      ASSERT_TRUE(kernels::ZeroOneLocalStep(
                      *ctx_, s, dg.as<float>(), dx.as<float>(), dm.as<float>(),
                      du.as<float>(), dv.as<float>(), n, write_x)
                      .ok());
      ASSERT_TRUE(ctx_->Synchronize().ok());
      same(dx, x, "local x");
      same(dm, m, "local m");
      same(du, u, "local u");
    }
    for (float lr_sum : {0.0f, 0.03f}) {  // sync message
      std::vector<float> out(n);
      compress::ZeroOneSyncMessage(s, lr_sum, u0, m0, v0, absl::MakeSpan(out));
      kernels::DeviceBuffer du = Upload(u0), dm = Upload(m0), dv = Upload(v0),
                            dout = Poisoned(4 * n);
      ASSERT_TRUE(kernels::ZeroOneSyncMessage(*ctx_, s, lr_sum, du.as<float>(),
                                              dm.as<float>(), dv.as<float>(),
                                              dout.as<float>(), n)
                      .ok());
      ASSERT_TRUE(ctx_->Synchronize().ok());
      same(dout, out, "sync message");
    }
    for (bool mask :
         {false, true}) {  // sync update, from an anchor and in place
      for (bool in_place : {false, true}) {
        std::vector<float> w = g, x = x0, m = m0;
        const std::vector<float> anchor = in_place ? x0 : u0;
        if (mask) compress::SelectByVariance(v0, absl::MakeSpan(w));
        compress::ZeroOneSyncStep(s, w, anchor, absl::MakeSpan(x),
                                  absl::MakeSpan(m), v0);
        kernels::DeviceBuffer dw = Upload(g), da = Upload(anchor),
                              dx = Upload(x0), dm = Upload(m0), dv = Upload(v0);
        ASSERT_TRUE(kernels::ZeroOneSyncUpdate(
                        *ctx_, s, mask, dw.as<float>(),
                        in_place ? dx.as<float>() : da.as<float>(),
                        dx.as<float>(), dm.as<float>(), dv.as<float>(), n)
                        .ok());
        ASSERT_TRUE(ctx_->Synchronize().ok());
        same(dx, x, "sync x");
        same(dm, m, "sync m");
      }
    }
  }
}

// onebit_lamb (design.md 2.8) against compress/: the moments of a warmup
// reply (and the last one, which copies v'), of a masked compression reply,
// then the layer totals from the GPU's segments and the x update, over
// layers that cross partitions and pieces of many segments.
TEST_F(KernelsTest, OneBitLambMatchesTheCpu) {
  compress::AlgorithmConfig c;
  c.optimizer = compress::OptimizerKind::kOneBitLamb;
  c.layout = {300007, /*shards=*/2, /*block_elems=*/256,
              /*partition_elems=*/65536};
  c.layers = {10, 1000, 200000, 99, 98898};
  c.freeze_step = 4;
  c.adam.weight_decay = 0.01f;
  auto layout = compress::Layout::Create(c.layout);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const size_t n = c.layout.dim;
  const std::vector<compress::LayerPiece> pieces =
      compress::LayerPieces(c, *layout, {0, n});
  // Through the engine's door: the layer kernels of c's optimizer.
  ASSERT_TRUE(kernels::HasLayerKernels(c));
  auto segments = kernels::LayerKernelsFor(c, pieces);
  ASSERT_TRUE(segments.ok()) << segments.status();
  const std::vector<float> g = RandomValues(n, 1, 1.0f),
                           x0 = RandomValues(n, 2, 1.0f),
                           m0 = RandomValues(n, 3, 0.1f),
                           vf0 = RandomValues(n, 6, 0.01f);
  std::vector<float> v0 = RandomValues(n, 4, 0.01f), vf_sq(n);
  for (size_t j = 0; j < n; ++j) {
    v0[j] = j % 13 == 0 ? 0.0f : v0[j] * v0[j];
    vf_sq[j] = vf0[j] * vf0[j];
  }
  // Steps 2 (warmup), 3 (the last warmup step) and 6 (compression, masked).
  for (int64_t step : {2, 3, 6}) {
    SCOPED_TRACE(step);
    const compress::ReplyRule rule = compress::PlanReply(c, step);
    ASSERT_TRUE(rule.lamb);
    std::vector<float> decoded = g, x = x0, m = m0, v = v0, vf = vf_sq;
    compress::ApplyRule(rule, absl::MakeSpan(decoded), absl::MakeSpan(x),
                        absl::MakeSpan(m), absl::MakeSpan(v), {},
                        absl::MakeSpan(vf));
    kernels::DeviceBuffer dg = Upload(g), dx = Upload(x0), dm = Upload(m0),
                          dv = Upload(v0), dvf = Upload(vf_sq);
    ASSERT_TRUE(kernels::LambMoments(*ctx_, rule, dg.as<float>(),
                                     dm.as<float>(), dv.as<float>(),
                                     dvf.as<float>(), n)
                    .ok());
    ASSERT_TRUE(ctx_->Synchronize().ok());
    EXPECT_EQ(
        FirstDifference(Download<float>(dm, n).data(), m.data(), 4 * n, 4), "")
        << "m";
    EXPECT_EQ(
        FirstDifference(Download<float>(dv, n).data(), v.data(), 4 * n, 4), "")
        << "v";
    EXPECT_EQ(
        FirstDifference(Download<float>(dvf, n).data(), vf.data(), 4 * n, 4),
        "")
        << "v'";
    // The totals: the CPU's, from the GPU's pieces.
    const compress::LayerRule& layers = *compress::OptimizerOf(c).Layers();
    const std::vector<double> totals = compress::LayerTotalsOf(
        c, layers, *layout, {rule}, {0, n}, x, m, v, vf);
    auto piece_stats =
        (*segments)->PieceStats(*ctx_, rule, dx.as<float>(), dm.as<float>(),
                                dv.as<float>(), dvf.as<float>());
    ASSERT_TRUE(piece_stats.ok()) << piece_stats.status();
    const std::vector<double> cpu_pieces = compress::PieceStats(
        layers, pieces,
        compress::SegmentStatsOf(layers, rule, pieces, {0, n}, x, m, v, vf));
    ASSERT_EQ(piece_stats->size(), cpu_pieces.size());
    EXPECT_EQ(std::memcmp(piece_stats->data(), cpu_pieces.data(),
                          8 * cpu_pieces.size()),
              0)
        << "the pieces' statistics";
    const std::vector<double> gpu_totals =
        compress::LayerTotals(c, layers, pieces, *piece_stats);
    ASSERT_EQ(gpu_totals.size(), totals.size());
    for (size_t i = 0; i < totals.size(); ++i) {
      EXPECT_EQ(std::memcmp(&gpu_totals[i], &totals[i], 8), 0)
          << "total " << i << ": " << gpu_totals[i] << " vs " << totals[i];
    }
    // The x update with the commit's steps.
    const std::vector<float> state = compress::FlattenLambLayers(
        std::vector<compress::LambLayerState>(c.layers.size()));
    const std::vector<double> commit =
        compress::LayerCommit(c, layers, {rule}, totals, state);
    compress::MoveLayersX(c, layers, rule, commit, {0, n}, 0, n,
                          absl::MakeSpan(x), m, v);
    ASSERT_TRUE((*segments)
                    ->MoveX(*ctx_, rule, commit, dx.as<float>(), dm.as<float>(),
                            dv.as<float>())
                    .ok());
    EXPECT_EQ(
        FirstDifference(Download<float>(dx, n).data(), x.data(), 4 * n, 4), "")
        << "x";
  }
}

// Which optimizers' layer rules have GPU kernels (kernels/layers.h): the
// CUDA engine's choice, host code alone, so it runs without a GPU too.
TEST(LayerKernelsTest, OnlyALayerRuleWithKernelsHasThem) {
  for (compress::OptimizerKind kind :
       {compress::OptimizerKind::kOneBitAdam, compress::OptimizerKind::kAdam,
        compress::OptimizerKind::kZeroOneAdam,
        compress::OptimizerKind::kOneBitLamb,
        compress::OptimizerKind::kDiloco}) {
    compress::AlgorithmConfig c;
    c.optimizer = kind;
    const compress::Optimizer& optimizer = compress::OptimizerOf(c);
    SCOPED_TRACE(optimizer.name());
    EXPECT_EQ(kernels::HasLayerKernels(c),
              kind == compress::OptimizerKind::kOneBitLamb);
    if (optimizer.Layers() == nullptr) {
      EXPECT_EQ(kernels::LayerKernelsFor(c, {}).status().code(),
                absl::StatusCode::kUnimplemented);
    }
  }
}

// DESIGN 2.1's zero-variance mask: where v is exactly 0, the encode sends +0
// and keeps +0 error (against compress::ErrorFeedback::Compress with its
// mask), and the update applies +0 (against compress::SelectByVariance and
// the frozen update), on the staged and the half-warp (unaligned) kernels.
TEST_F(KernelsTest, ZeroVarianceMaskMatchesTheCpu) {
  CodecSpec spec;
  spec.kind = CodecKind::kSign1;
  spec.block_elems = 256;
  compress::AdamScalars s;
  s.lr = 0.01f;
  s.weight_decay = 0.01f;
  s.bias_correction1 = 0.5f;
  s.bias_correction2 = 0.25f;
  // Block 16384 with EMA stages too much for shared memory: the half-warp
  // kernel.
  for (const auto& [block, offset] :
       {std::pair<uint32_t, size_t>{256, 0}, {256, 1}, {16384, 0}}) {
    spec.block_elems = block;
    for (FeedbackArgs fb : {FeedbackArgs{FeedbackKind::kEf, 1.0f},
                            FeedbackArgs{FeedbackKind::kEma, 0.3f}}) {
      for (size_t n :
           {size_t{7}, size_t{256}, 3 * size_t{256} + 5, size_t{100003}}) {
        SCOPED_TRACE(absl::StrCat("n=", n, " block=", block, " offset=", offset,
                                  " feedback=", static_cast<int>(fb.kind)));
        const std::vector<float> x = RandomValues(n, 5 + n, 2.0f);
        std::vector<float> e = RandomValues(n, 6 + n, 0.5f);
        std::vector<float> v = RandomValues(n, 7 + n, 0.1f);
        for (size_t j = 0; j < n; ++j) {
          v[j] = v[j] * v[j];
          if (j % 7 == 3 || (j >= 256 && j < 512))
            v[j] = 0.0f;  // scattered, and one whole block
        }
        const compress::RoundingKey key{1, 2, 3, 0};
        std::vector<uint8_t> cpu_payload(compress::PayloadBytes(spec, n));
        compress::ErrorFeedback cpu_error(
            {fb.kind, fb.beta, compress::ErrorStorage::kFp32}, n,
            spec.block_elems);
        ASSERT_TRUE(cpu_error.Restore(e).ok());
        ASSERT_TRUE(
            cpu_error.Compress(spec, 0, x, key, absl::MakeSpan(cpu_payload), v)
                .ok());
        std::vector<float> cpu_e(n);
        cpu_error.Read(0, absl::MakeSpan(cpu_e));

        std::vector<float> px(offset, 0.0f), pe(offset, 0.0f), pv(offset, 1.0f);
        px.insert(px.end(), x.begin(), x.end());
        pe.insert(pe.end(), e.begin(), e.end());
        pv.insert(pv.end(), v.begin(), v.end());
        kernels::DeviceBuffer dx = Upload(px), de = Upload(pe), dv = Upload(pv);
        kernels::DeviceBuffer payload = Poisoned(cpu_payload.size());
        ASSERT_TRUE(kernels::EncodeWithError(
                        *ctx_, spec, dx.as<float>() + offset,
                        de.as<float>() + offset, n, fb, key,
                        payload.as<uint8_t>(), dv.as<float>() + offset)
                        .ok());
        EXPECT_EQ(FirstDifference(
                      Download<uint8_t>(payload, cpu_payload.size()).data(),
                      cpu_payload.data(), cpu_payload.size(), 1),
                  "")
            << "payload";
        const auto gpu_e = Download<float>(de, n + offset);
        EXPECT_EQ(
            FirstDifference(gpu_e.data() + offset, cpu_e.data(), 4 * n, 4), "")
            << "error";

        // The update from this payload as a reply.
        std::vector<float> c(n);
        ASSERT_TRUE(
            compress::Decode(spec, cpu_payload, absl::MakeSpan(c)).ok());
        compress::SelectByVariance(v, absl::MakeSpan(c));
        std::vector<float> cx = x, cm(n);
        compress::ScalarKernels().frozen_update(s, c.data(), cx.data(),
                                                cm.data(), v.data(), n,
                                                /*mask=*/false);
        kernels::DeviceBuffer reply = Upload(cpu_payload), rx = Upload(px),
                              rm = Poisoned(4 * (n + offset));
        ASSERT_TRUE(kernels::DecodeFrozenUpdate(
                        *ctx_, spec, reply.as<uint8_t>(), n, s, /*mask=*/true,
                        rx.as<float>() + offset, rm.as<float>() + offset,
                        dv.as<float>() + offset)
                        .ok());
        ASSERT_TRUE(ctx_->Synchronize().ok());
        EXPECT_EQ(
            FirstDifference(Download<float>(rx, n + offset).data() + offset,
                            cx.data(), 4 * n, 4),
            "")
            << "fused x";
        EXPECT_EQ(
            FirstDifference(Download<float>(rm, n + offset).data() + offset,
                            cm.data(), 4 * n, 4),
            "")
            << "fused m";
        // The unfused update from decoded values (other codecs' replies).
        std::vector<float> raw(n);
        ASSERT_TRUE(
            compress::Decode(spec, cpu_payload, absl::MakeSpan(raw)).ok());
        kernels::DeviceBuffer draw = Upload(raw), ux = Upload(x),
                              um = Poisoned(4 * n), uv = Upload(v);
        ASSERT_TRUE(kernels::FrozenUpdate(*ctx_, s, /*mask=*/true,
                                          draw.as<float>(), ux.as<float>(),
                                          um.as<float>(), uv.as<float>(), n)
                        .ok());
        ASSERT_TRUE(ctx_->Synchronize().ok());
        EXPECT_EQ(
            FirstDifference(Download<float>(ux, n).data(), cx.data(), 4 * n, 4),
            "")
            << "x";
        EXPECT_EQ(
            FirstDifference(Download<float>(um, n).data(), cm.data(), 4 * n, 4),
            "")
            << "m";
      }
    }
  }
  // Other codecs take the mask on the CPU only.
  CodecSpec int4;
  int4.kind = CodecKind::kInt4;
  int4.block_elems = 256;
  kernels::DeviceBuffer x = Upload(std::vector<float>(16, 1.0f)),
                        v = Upload(std::vector<float>(16, 0.0f));
  kernels::DeviceBuffer out = Poisoned(compress::PayloadBytes(int4, 16));
  EXPECT_EQ(kernels::EncodeWithError(*ctx_, int4, x.as<float>(), nullptr, 16,
                                     {}, {}, out.as<uint8_t>(), v.as<float>())
                .code(),
            absl::StatusCode::kUnimplemented);
}

// 1-bit Adam's local momentum b1*m + (1-b1)*g formed inside the encode
// (fused into sign1 where the block is staged; through the scratch array for
// large blocks, unaligned arrays and other codecs) against compress/'s
// LocalMomentum followed by ErrorFeedback::Compress, with and without the
// zero-variance mask.
TEST_F(KernelsTest, MomentumFusedIntoTheEncodeMatchesTheCpu) {
  struct Case {
    CodecKind kind;
    uint32_t block;
    size_t offset;
    FeedbackArgs fb;
    bool mask;
  };
  const Case cases[] = {
      {CodecKind::kSign1, 256, 0, {FeedbackKind::kEf, 1.0f}, false},
      {CodecKind::kSign1, 256, 0, {FeedbackKind::kEf, 1.0f}, true},
      {CodecKind::kSign1, 256, 1, {FeedbackKind::kEma, 0.3f}, true},
      {CodecKind::kSign1, 16384, 0, {FeedbackKind::kEma, 0.3f}, true},
      {CodecKind::kInt4, 256, 0, {FeedbackKind::kEma, 0.3f}, false},
  };
  const float beta1 = 0.9f;
  for (const Case& c : cases) {
    for (size_t n : {size_t{7}, size_t{1000}, size_t{16384} * 2 + 5}) {
      SCOPED_TRACE(absl::StrCat("codec ", compress::CodecName(c.kind),
                                " block ", c.block, " offset ", c.offset,
                                " mask ", c.mask, " n ", n));
      CodecSpec spec;
      spec.kind = c.kind;
      spec.block_elems = c.block;
      const std::vector<float> g = RandomValues(n, 40 + n, 1.0f),
                               m = RandomValues(n, 41 + n, 0.5f);
      const std::vector<float> e = RandomValues(n, 42 + n, 0.2f);
      std::vector<float> v = RandomValues(n, 43 + n, 0.1f);
      for (size_t j = 0; j < n; ++j) v[j] = j % 5 == 1 ? 0.0f : v[j] * v[j];
      const compress::RoundingKey key{3, 4, 5, 0};
      std::vector<float> local(n);
      compress::LocalMomentum(beta1, m, g, absl::MakeSpan(local));
      compress::ErrorFeedback cpu_error(
          {c.fb.kind, c.fb.beta, compress::ErrorStorage::kFp32}, n, c.block);
      ASSERT_TRUE(cpu_error.Restore(e).ok());
      std::vector<uint8_t> cpu_payload(compress::PayloadBytes(spec, n));
      ASSERT_TRUE(cpu_error
                      .Compress(spec, 0, local, key,
                                absl::MakeSpan(cpu_payload),
                                c.mask ? absl::MakeConstSpan(v)
                                       : absl::Span<const float>())
                      .ok());
      std::vector<float> cpu_e(n);
      cpu_error.Read(0, absl::MakeSpan(cpu_e));

      const auto padded = [&](const std::vector<float>& a) {
        std::vector<float> out(c.offset, 0.0f);
        out.insert(out.end(), a.begin(), a.end());
        return out;
      };
      kernels::DeviceBuffer dg = Upload(padded(g)), dm = Upload(padded(m)),
                            de = Upload(padded(e)), dv = Upload(padded(v)),
                            scratch = Poisoned(4 * (n + c.offset));
      kernels::DeviceBuffer payload = Poisoned(cpu_payload.size());
      ASSERT_TRUE(
          kernels::EncodeWithError(
              *ctx_, spec, dg.as<float>() + c.offset, de.as<float>() + c.offset,
              n, c.fb, key, payload.as<uint8_t>(),
              c.mask ? dv.as<float>() + c.offset : nullptr,
              dm.as<float>() + c.offset, beta1, scratch.as<float>() + c.offset)
              .ok());
      EXPECT_EQ(
          FirstDifference(Download<uint8_t>(payload, cpu_payload.size()).data(),
                          cpu_payload.data(), cpu_payload.size(), 1),
          "")
          << "payload";
      const auto gpu_e = Download<float>(de, n + c.offset);
      EXPECT_EQ(
          FirstDifference(gpu_e.data() + c.offset, cpu_e.data(), 4 * n, 4), "")
          << "error";
    }
  }
}

TEST_F(KernelsTest, SyntheticGradientMatchesTheCpuFormula) {
  // worker/synthetic_workload.cc: grad = a*(x - t) + noise*(2u - 1).
  const size_t n = 100003;
  const std::vector<float> a = RandomValues(n, 1, 1.0f),
                           t = RandomValues(n, 2, 1.0f),
                           x = RandomValues(n, 3, 1.0f);
  std::vector<float> expected(n);
  compress::FillDraws({42, 17, 3, 0}, expected.data(), n);
  double loss = 0.0;
  for (size_t j = 0; j < n; ++j) {
    const float d = x[j] - t[j];
    expected[j] = a[j] * d + 0.25f * (2.0f * expected[j] - 1.0f);
    loss += 0.5 * double{a[j]} * double{d} * double{d};
  }
  kernels::DeviceBuffer da = Upload(a), dt = Upload(t), dx = Upload(x),
                        grad = Poisoned(4 * n);
  auto got = kernels::SyntheticGradient(*ctx_, 42, 17, 3, 0.25f, da.as<float>(),
                                        dt.as<float>(), dx.as<float>(),
                                        grad.as<float>(), n);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_NEAR(*got, loss / n, 1e-9 * std::abs(loss / n));
  EXPECT_EQ(FirstDifference(Download<float>(grad, n).data(), expected.data(),
                            4 * n, 4),
            "");
  // Dead elements (synthetic { dead_every }): +0 there, the rest unchanged.
  for (size_t j = 0; j < n; j += 3) expected[j] = 0.0f;
  kernels::DeviceBuffer dead = Poisoned(4 * n);
  ASSERT_TRUE(kernels::SyntheticGradient(
                  *ctx_, 42, 17, 3, 0.25f, da.as<float>(), dt.as<float>(),
                  dx.as<float>(), dead.as<float>(), n, /*dead_every=*/3)
                  .ok());
  EXPECT_EQ(FirstDifference(Download<float>(dead, n).data(), expected.data(),
                            4 * n, 4),
            "")
      << "dead";
}

TEST_F(KernelsTest, NonFiniteInputIsRefusedLikeTheCpu) {
  std::vector<float> x = RandomValues(1000, 3, 1.0f);
  x[517] = std::numeric_limits<float>::infinity();
  kernels::DeviceBuffer dx = Upload(x);
  for (CodecKind kind :
       {CodecKind::kSign1, CodecKind::kInt8, CodecKind::kInt4}) {
    CodecSpec spec;
    spec.kind = kind;
    spec.block_elems = 128;
    kernels::DeviceBuffer payload =
        Poisoned(compress::PayloadBytes(spec, x.size()));
    const absl::Status s =
        kernels::EncodeWithError(*ctx_, spec, dx.as<float>(), nullptr, x.size(),
                                 {}, {}, payload.as<uint8_t>());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    std::vector<uint8_t> cpu(compress::PayloadBytes(spec, x.size()));
    EXPECT_EQ(compress::Encode(spec, x, {}, absl::MakeSpan(cpu)).message(),
              s.message());
  }
  // Encoding again after the error works: the flag and the stream are clean.
  CodecSpec spec;
  spec.kind = CodecKind::kSign1;
  spec.block_elems = 128;
  x[517] = 1.0f;
  kernels::DeviceBuffer clean = Upload(x);
  kernels::DeviceBuffer payload =
      Poisoned(compress::PayloadBytes(spec, x.size()));
  EXPECT_TRUE(kernels::EncodeWithError(*ctx_, spec, clean.as<float>(), nullptr,
                                       x.size(), {}, {}, payload.as<uint8_t>())
                  .ok());
}

TEST_F(KernelsTest, TopkAndMisalignedPayloadsAreRefused) {
  CodecSpec spec;
  spec.kind = CodecKind::kTopK;
  spec.block_elems = 16;
  kernels::DeviceBuffer payload = Poisoned(64);
  EXPECT_EQ(kernels::Decode(*ctx_, spec, payload.as<uint8_t>(), 4,
                            payload.as<float>())
                .code(),
            absl::StatusCode::kUnimplemented);
  spec.kind = CodecKind::kSign1;
  EXPECT_EQ(kernels::Decode(*ctx_, spec, payload.as<uint8_t>() + 1, 4,
                            payload.as<float>())
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(KernelsTest, MlpOperationsMatchTheCpu) {
  worker::HostMlpOps host;
  const int rows = 37, cols = 13;
  const size_t n = static_cast<size_t>(rows) * cols;
  const auto compare_exact = [&](const kernels::DeviceBuffer& got,
                                 const std::vector<float>& want,
                                 const char* what) {
    ASSERT_TRUE(ctx_->Synchronize().ok());
    EXPECT_EQ(FirstDifference(Download<float>(got, want.size()).data(),
                              want.data(), 4 * want.size(), 4),
              "")
        << what;
  };
  {
    const std::vector<float> bias = RandomValues(cols, 1, 1.0f);
    std::vector<float> want(n);
    ASSERT_TRUE(host.BroadcastRows(bias.data(), rows, cols, want.data()).ok());
    kernels::DeviceBuffer dbias = Upload(bias), out = Poisoned(4 * n);
    ASSERT_TRUE(kernels::BroadcastRows(*ctx_, dbias.as<float>(), rows, cols,
                                       out.as<float>())
                    .ok());
    compare_exact(out, want, "broadcast rows");
  }
  {
    const std::vector<float> z = RandomValues(n, 2, 1.0f);  // with exact zeros
    std::vector<float> want = z;
    ASSERT_TRUE(host.Relu(want.data(), n).ok());
    kernels::DeviceBuffer dz = Upload(z);
    ASSERT_TRUE(kernels::Relu(*ctx_, dz.as<float>(), n).ok());
    compare_exact(dz, want, "relu");
    const std::vector<float> da = RandomValues(n, 3, 1.0f);
    std::vector<float> want_da = da;
    ASSERT_TRUE(host.ReluBackward(want.data(), want_da.data(), n).ok());
    kernels::DeviceBuffer dda = Upload(da);
    ASSERT_TRUE(
        kernels::ReluBackward(*ctx_, dz.as<float>(), dda.as<float>(), n).ok());
    compare_exact(dda, want_da, "relu backward");
  }
  {
    const std::vector<float> in = RandomValues(n, 4, 1.0f);
    std::vector<float> want(cols);
    ASSERT_TRUE(host.ColumnSums(in.data(), rows, cols, want.data()).ok());
    kernels::DeviceBuffer din = Upload(in), out = Poisoned(4 * cols);
    ASSERT_TRUE(
        kernels::ColumnSums(*ctx_, din.as<float>(), rows, cols, out.as<float>())
            .ok());
    compare_exact(out, want, "column sums");
  }
  {
    const std::vector<float> logits = RandomValues(n, 5, 4.0f);
    std::vector<uint32_t> labels(rows);
    for (int r = 0; r < rows; ++r)
      labels[r] = static_cast<uint32_t>((r * 7) % cols);
    std::vector<float> want(n);
    auto want_loss = host.SoftmaxCrossEntropy(logits.data(), labels.data(),
                                              rows, cols, want.data());
    ASSERT_TRUE(want_loss.ok());
    kernels::DeviceBuffer dlogits = Upload(logits), dlabels = Upload(labels),
                          out = Poisoned(4 * n), row_loss = Poisoned(8 * rows);
    auto got_loss = kernels::SoftmaxCrossEntropy(
        *ctx_, dlogits.as<float>(), dlabels.as<uint32_t>(), rows, cols,
        out.as<float>(), row_loss.as<double>());
    ASSERT_TRUE(got_loss.ok()) << got_loss.status();
    EXPECT_NEAR(*got_loss, *want_loss, 1e-12 * std::abs(*want_loss));
    const auto got = Download<float>(out, n);
    for (size_t j = 0; j < n; ++j) {
      ASSERT_NEAR(got[j], want[j], 1e-9f + 1e-6f * std::abs(want[j]))
          << "softmax dz " << j;
    }
  }
  // The three products of worker/mlp_backprop.cc's passes (column-major).
  auto blas = kernels::Blas::Create(*ctx_);
  ASSERT_TRUE(blas.ok()) << blas.status();
  const int in_width = 29, out_width = 11;
  struct Product {
    bool ta, tb;
    int m, n, k, lda, ldb, ldc;
    float beta;
  };
  for (const Product& p :
       {Product{false, false, out_width, rows, in_width, out_width, in_width,
                out_width, 1.0f},  // forward
        Product{false, true, out_width, in_width, rows, out_width, in_width,
                out_width, 0.0f},  // weight gradient
        Product{true, false, in_width, rows, out_width, out_width, out_width,
                in_width, 0.0f}}) {  // input gradient
    SCOPED_TRACE(absl::StrCat("trans_a=", p.ta, " trans_b=", p.tb));
    const size_t a_size = static_cast<size_t>(p.lda) * (p.ta ? p.m : p.k);
    const size_t b_size = static_cast<size_t>(p.ldb) * (p.tb ? p.k : p.n);
    const size_t c_size = static_cast<size_t>(p.ldc) * p.n;
    const std::vector<float> a = RandomValues(a_size, 6, 1.0f),
                             b = RandomValues(b_size, 7, 1.0f);
    std::vector<float> want = RandomValues(c_size, 8, 1.0f);
    kernels::DeviceBuffer da = Upload(a), db = Upload(b), dc = Upload(want);
    ASSERT_TRUE(host.Gemm(p.ta, p.tb, p.m, p.n, p.k, a.data(), p.lda, b.data(),
                          p.ldb, p.beta, want.data(), p.ldc)
                    .ok());
    ASSERT_TRUE((*blas)
                    ->Gemm(p.ta, p.tb, p.m, p.n, p.k, da.as<float>(), p.lda,
                           db.as<float>(), p.ldb, p.beta, dc.as<float>(), p.ldc)
                    .ok());
    ASSERT_TRUE(ctx_->Synchronize().ok());
    const auto got = Download<float>(dc, c_size);
    for (size_t j = 0; j < c_size; ++j)
      ASSERT_NEAR(got[j], want[j], 1e-3f) << "element " << j;
  }
}

}  // namespace
}  // namespace morse
