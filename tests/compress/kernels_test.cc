// Every vector KernelTable (avx2, avx512) against the scalar reference: the
// same bytes and the same float bits, over sizes that end inside a vector,
// inside a block, and on boundaries. A table the CPU cannot run is skipped
// with a message.
#include "compress/kernels.h"

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "compress/stochastic_rounding.h"
#include "gtest/gtest.h"
#include "tests/compress/test_util.h"

namespace morse::compress {
namespace {

using testing::CorrectedAdamScalars;
using testing::FirstBitDifference;
using testing::VariedData;

constexpr size_t kBlock = 256;
const size_t kSizes[] = {
    0, 1, 7, 8, 9, 15, 16, 17, 31, 255, 256, 257, 3 * kBlock + 40, 40000};

const KernelTable* Table(const std::string& name) {
  return name == "avx2" ? Avx2Kernels() : Avx512Kernels();
}

class KernelsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    fast_ = Table(GetParam());
    if (fast_ == nullptr) GTEST_SKIP() << "this CPU cannot run " << GetParam();
  }
  const KernelTable& ref_ = ScalarKernels();
  const KernelTable* fast_ = nullptr;
};

// The zero-variance mask of n elements: 0 (both signs) at every third
// element and through a whole 40-element stretch, NaN (not 0: kept) at
// some, else positive.
std::vector<float> MaskOf(size_t n) {
  std::vector<float> v = VariedData(n, 7);
  for (size_t j = 0; j < n; ++j) {
    v[j] = std::fabs(v[j]) + 1e-3f;
    if (j % 3 == 0) v[j] = j % 2 ? -0.0f : 0.0f;
    if (j % 11 == 5) v[j] = NAN;
    if (j >= 300 && j < 340) v[j] = 0.0f;
  }
  return v;
}

TEST_P(KernelsTest, Sign1EncodeMatchesTheReference) {
  for (size_t n : kSizes) {
    const std::vector<float> mask = MaskOf(n);
    for (const float* m : {static_cast<const float*>(nullptr), mask.data()}) {
      for (ScaleKind scale : {ScaleKind::kL2, ScaleKind::kL1}) {
        for (FeedbackArgs fb : {FeedbackArgs{FeedbackKind::kNone, 1},
                                FeedbackArgs{FeedbackKind::kEf, 1},
                                FeedbackArgs{FeedbackKind::kEma, 0.25f}}) {
          const std::vector<float> x = VariedData(n, 1);
          std::vector<float> e_ref = VariedData(n, 2), e_fast = e_ref;
          const size_t blocks = (n + kBlock - 1) / kBlock;
          std::vector<float> s_ref(blocks), s_fast(blocks, -1);
          std::vector<uint8_t> b_ref((n + 7) / 8, 0xAA),
              b_fast((n + 7) / 8, 0x55);
          ASSERT_TRUE(ref_.sign1_encode(x.data(), e_ref.data(), n, kBlock,
                                        scale, fb, s_ref.data(), b_ref.data(),
                                        m));
          ASSERT_TRUE(fast_->sign1_encode(x.data(), e_fast.data(), n, kBlock,
                                          scale, fb, s_fast.data(),
                                          b_fast.data(), m));
          const std::string where = "n=" + std::to_string(n) +
                                    " scale=" + std::to_string(int(scale)) +
                                    " fb=" + std::to_string(int(fb.kind)) +
                                    (m != nullptr ? " masked" : "");
          EXPECT_EQ(FirstBitDifference(s_fast, s_ref), -1) << where;
          EXPECT_EQ(b_fast, b_ref) << where;
          EXPECT_EQ(FirstBitDifference(e_fast, e_ref), -1) << where;
        }
      }
    }
  }
}

// The fused mask gives the bits of encoding masked copies (what
// ErrorFeedback did before, and still does for other codecs): x and e +0
// where v is exactly 0, and the error +0 there after.
TEST(ScalarKernelsTest, TheFusedMaskEqualsMaskingCopies) {
  const KernelTable& k = ScalarKernels();
  for (size_t n : kSizes) {
    const std::vector<float> mask = MaskOf(n);
    for (FeedbackArgs fb : {FeedbackArgs{FeedbackKind::kNone, 1},
                            FeedbackArgs{FeedbackKind::kEf, 1},
                            FeedbackArgs{FeedbackKind::kEma, 0.25f}}) {
      const std::vector<float> x = VariedData(n, 1);
      std::vector<float> e_fused = VariedData(n, 2);
      std::vector<float> x_copy = x, e_copy = e_fused;
      for (size_t j = 0; j < n; ++j) {
        if (mask[j] != 0.0f) continue;
        x_copy[j] = 0.0f;
        if (fb.kind != FeedbackKind::kNone) e_copy[j] = 0.0f;  // else unused
      }
      const size_t blocks = (n + kBlock - 1) / kBlock;
      std::vector<float> s_fused(blocks), s_copy(blocks);
      std::vector<uint8_t> b_fused((n + 7) / 8), b_copy((n + 7) / 8);
      ASSERT_TRUE(k.sign1_encode(x.data(), e_fused.data(), n, kBlock,
                                 ScaleKind::kL2, fb, s_fused.data(),
                                 b_fused.data(), mask.data()));
      ASSERT_TRUE(k.sign1_encode(x_copy.data(), e_copy.data(), n, kBlock,
                                 ScaleKind::kL2, fb, s_copy.data(),
                                 b_copy.data(), nullptr));
      if (fb.kind != FeedbackKind::kNone) {
        for (size_t j = 0; j < n; ++j) {
          if (mask[j] == 0.0f) e_copy[j] = 0.0f;
        }
      }
      const std::string where =
          "n=" + std::to_string(n) + " fb=" + std::to_string(int(fb.kind));
      EXPECT_EQ(FirstBitDifference(s_fused, s_copy), -1) << where;
      EXPECT_EQ(b_fused, b_copy) << where;
      EXPECT_EQ(FirstBitDifference(e_fused, e_copy), -1) << where;
    }
  }
}

TEST_P(KernelsTest, IntEncodeMatchesTheReference) {
  for (size_t n : kSizes) {
    for (int bits : {8, 4}) {
      for (FeedbackArgs fb : {FeedbackArgs{FeedbackKind::kNone, 1},
                              FeedbackArgs{FeedbackKind::kEf, 1},
                              FeedbackArgs{FeedbackKind::kEma, 0.5f}}) {
        std::vector<float> x = VariedData(n, 3);
        if (n > 300)
          std::fill(x.begin() + 256, x.begin() + 300, 0.0f);  // a zero run
        std::vector<float> e_ref = VariedData(n, 4), e_fast = e_ref;
        if (n >= 2 * kBlock) {  // one all-zero block, zero error too
          std::fill(x.begin() + kBlock, x.begin() + 2 * kBlock, 0.0f);
          std::fill(e_ref.begin() + kBlock, e_ref.begin() + 2 * kBlock, 0.0f);
          e_fast = e_ref;
        }
        const size_t blocks = (n + kBlock - 1) / kBlock;
        const size_t bytes = bits == 8 ? n : (n + 1) / 2;
        std::vector<float> s_ref(blocks), s_fast(blocks, -1);
        std::vector<uint8_t> d_ref(bytes, 0xAA), d_fast(bytes, 0x55);
        ASSERT_TRUE(ref_.int_encode(bits, x.data(), e_ref.data(), n, kBlock, fb,
                                    nullptr, s_ref.data(), d_ref.data()));
        ASSERT_TRUE(fast_->int_encode(bits, x.data(), e_fast.data(), n, kBlock,
                                      fb, nullptr, s_fast.data(),
                                      d_fast.data()));
        const std::string where = "n=" + std::to_string(n) +
                                  " bits=" + std::to_string(bits) +
                                  " fb=" + std::to_string(int(fb.kind));
        EXPECT_EQ(FirstBitDifference(s_fast, s_ref), -1) << where;
        EXPECT_EQ(d_fast, d_ref) << where;
        EXPECT_EQ(FirstBitDifference(e_fast, e_ref), -1) << where;
        // Decoding both ways, and averaging three copies, agree too.
        std::vector<float> y_ref(n), y_fast(n, 42);
        ref_.int_decode(bits, s_ref.data(), d_ref.data(), n, kBlock,
                        y_ref.data());
        fast_->int_decode(bits, s_ref.data(), d_ref.data(), n, kBlock,
                          y_fast.data());
        EXPECT_EQ(FirstBitDifference(y_fast, y_ref), -1) << where;
        const float* scales[] = {s_ref.data(), s_fast.data(), s_ref.data()};
        const uint8_t* data[] = {d_ref.data(), d_fast.data(), d_ref.data()};
        ref_.int_average(bits, scales, data, 3, n, kBlock, y_ref.data());
        fast_->int_average(bits, scales, data, 3, n, kBlock, y_fast.data());
        EXPECT_EQ(FirstBitDifference(y_fast, y_ref), -1) << where;
      }
    }
  }
}

TEST_P(KernelsTest, Sign1DecodeAndAverageMatchTheReference) {
  for (size_t n : kSizes) {
    const size_t blocks = (n + kBlock - 1) / kBlock;
    std::vector<std::vector<float>> scales(4);
    std::vector<std::vector<uint8_t>> bits(4);
    for (int i = 0; i < 4; ++i) {
      const std::vector<float> x = VariedData(n, 10 + i);
      scales[i].resize(blocks);
      bits[i].resize((n + 7) / 8);
      ASSERT_TRUE(ref_.sign1_encode(x.data(), nullptr, n, kBlock,
                                    ScaleKind::kL2, {}, scales[i].data(),
                                    bits[i].data(), nullptr));
    }
    std::vector<float> y_ref(n), y_fast(n, 42);
    ref_.sign1_decode(scales[0].data(), bits[0].data(), n, kBlock,
                      y_ref.data());
    fast_->sign1_decode(scales[0].data(), bits[0].data(), n, kBlock,
                        y_fast.data());
    EXPECT_EQ(FirstBitDifference(y_fast, y_ref), -1) << n;
    const float* s[] = {scales[0].data(), scales[1].data(), scales[2].data(),
                        scales[3].data()};
    const uint8_t* b[] = {bits[0].data(), bits[1].data(), bits[2].data(),
                          bits[3].data()};
    for (size_t count : {1, 3, 4}) {
      ref_.sign1_average(s, b, count, n, kBlock, y_ref.data());
      fast_->sign1_average(s, b, count, n, kBlock, y_fast.data());
      EXPECT_EQ(FirstBitDifference(y_fast, y_ref), -1) << n << " x" << count;
    }
  }
}

TEST_P(KernelsTest, UpdateRulesMatchTheReference) {
  for (size_t n : kSizes) {
    for (bool corrected : {false, true}) {
      AdamScalars s;
      s.lr = 3e-3f;
      s.weight_decay = 0.01f;
      if (corrected) {
        s.bias_correction1 = 0.271f;
        s.bias_correction2 = 0.00299f;
        s.max_ratio =
            0.75f;  // bound_update clamps a share of the frozen ratios
      }
      const std::vector<float> g = VariedData(n, 20);
      std::vector<float> x_ref = VariedData(n, 21), m_ref = VariedData(n, 22);
      std::vector<float> v_ref = VariedData(n, 23);
      for (float& v : v_ref) v = v * v;
      std::vector<float> x_fast = x_ref, m_fast = m_ref, v_fast = v_ref;
      ref_.adam_update(s, g.data(), x_ref.data(), m_ref.data(), v_ref.data(),
                       n);
      fast_->adam_update(s, g.data(), x_fast.data(), m_fast.data(),
                         v_fast.data(), n);
      EXPECT_EQ(FirstBitDifference(x_fast, x_ref), -1) << n;
      EXPECT_EQ(FirstBitDifference(m_fast, m_ref), -1) << n;
      EXPECT_EQ(FirstBitDifference(v_fast, v_ref), -1) << n;
      ref_.frozen_update(s, g.data(), x_ref.data(), m_ref.data(), v_ref.data(),
                         n, /*mask=*/false);
      fast_->frozen_update(s, g.data(), x_fast.data(), m_fast.data(),
                           v_fast.data(), n, /*mask=*/false);
      EXPECT_EQ(FirstBitDifference(x_fast, x_ref), -1) << n;
      EXPECT_EQ(FirstBitDifference(m_fast, m_ref), -1) << n;
      // With the zero-variance mask, where some v are exactly 0.
      std::vector<float> v_masked = MaskOf(n);
      for (float& v : v_masked) v = std::isnan(v) ? 1.0f : v;
      ref_.frozen_update(s, g.data(), x_ref.data(), m_ref.data(),
                         v_masked.data(), n, /*mask=*/true);
      fast_->frozen_update(s, g.data(), x_fast.data(), m_fast.data(),
                           v_masked.data(), n, /*mask=*/true);
      EXPECT_EQ(FirstBitDifference(x_fast, x_ref), -1) << n << " masked";
      EXPECT_EQ(FirstBitDifference(m_fast, m_ref), -1) << n << " masked";
      std::vector<float> o_ref(n), o_fast(n, 42);
      ref_.momentum(0.9f, m_ref.data(), g.data(), o_ref.data(), n);
      fast_->momentum(0.9f, m_ref.data(), g.data(), o_fast.data(), n);
      EXPECT_EQ(FirstBitDifference(o_fast, o_ref), -1) << n;
    }
  }
}

// 1-bit LAMB's segment statistics and x update, in warmup and compression,
// at segment lengths that end inside a vector; zeros in v and v' (ratios up
// to 1/eps), max_ratio clamping a share of the compression ratios.
TEST_P(KernelsTest, LambLoopsMatchTheReference) {
  const size_t lengths[] = {0, 1, 7, 8, 9, 15, 16, 17, 100, 255, 256};
  for (size_t n : lengths) {
    for (bool frozen : {false, true}) {
      LambScalars s;
      s.adam.weight_decay = 0.01f;
      s.adam.bias_correction1 = 0.271f;
      s.adam.bias_correction2 = 0.00299f;
      s.adam.max_ratio = frozen ? 0.75f : s.adam.max_ratio;
      s.frozen_variance = frozen;
      s.fresh_correction2 = 0.0419f;
      const std::vector<float> m = VariedData(n, 30);
      std::vector<float> v = VariedData(n, 31), v_fresh = VariedData(n, 32);
      for (float& e : v) e = e * e;  // zeros included (VariedData's every 97th)
      for (float& e : v_fresh) e = e * e;
      for (size_t j = 11; j < n; j += 13) v_fresh[j] = 0.0f;
      const std::vector<float> x0 = VariedData(n, 33);
      const std::string where =
          "n=" + std::to_string(n) + (frozen ? " compression" : " warmup");
      double ref[3] = {-1, -1, -1}, fast[3] = {-2, -2, -2};
      ref_.lamb_segment_sums(s, x0.data(), m.data(), v.data(), v_fresh.data(),
                             n, ref);
      fast_->lamb_segment_sums(s, x0.data(), m.data(), v.data(), v_fresh.data(),
                               n, fast);
      EXPECT_EQ(std::memcmp(ref, fast, sizeof ref), 0)
          << where << ": " << ref[0] << " " << ref[1] << " " << ref[2] << " vs "
          << fast[0] << " " << fast[1] << " " << fast[2];
      std::vector<float> x_ref = x0, x_fast = x0;
      ref_.lamb_update_x(s, 3e-3f, x_ref.data(), m.data(), v.data(), n);
      fast_->lamb_update_x(s, 3e-3f, x_fast.data(), m.data(), v.data(), n);
      EXPECT_EQ(FirstBitDifference(x_fast, x_ref), -1) << where;
      if (n > 0) {
        EXPECT_NE(FirstBitDifference(x_ref, x0), -1)
            << where << ": x did not move";
      }
      // The moments from a decoded reply, masked or not, copying v' or not.
      const std::vector<float> decoded = VariedData(n, 34);
      for (bool mask : {false, true}) {
        for (bool copy_fresh : {false, true}) {
          const std::string at =
              where + (mask ? " mask" : "") + (copy_fresh ? " copy_fresh" : "");
          std::vector<float> m_ref = m, v_ref = v, f_ref = v_fresh;
          std::vector<float> m_fast = m, v_fast = v, f_fast = v_fresh;
          ref_.lamb_moments(s, copy_fresh, mask, decoded.data(), m_ref.data(),
                            v_ref.data(), f_ref.data(), n);
          fast_->lamb_moments(s, copy_fresh, mask, decoded.data(),
                              m_fast.data(), v_fast.data(), f_fast.data(), n);
          EXPECT_EQ(FirstBitDifference(m_fast, m_ref), -1) << at << " m";
          EXPECT_EQ(FirstBitDifference(v_fast, v_ref), -1) << at << " v";
          EXPECT_EQ(FirstBitDifference(f_fast, f_ref), -1) << at << " v'";
          if (n > 0) {
            EXPECT_NE(FirstBitDifference(m_ref, m), -1) << at;
          }
          for (size_t j = 0; j < n; ++j) {
            if (mask && frozen && v[j] == 0.0f) {
              ASSERT_TRUE(m_ref[j] == 0.0f && !std::signbit(m_ref[j]))
                  << at << " j=" << j;
            }
          }
        }
      }
    }
  }
}

// zero_one_adam's local step (fresh or continuing an interval, with and
// without x), sync message and masked sync, at lengths that end inside a
// vector; zeros in v (masked elements, ratios up to 1/eps), max_ratio
// clamping a share of the ratios, the sync's anchor x itself or its own.
TEST_P(KernelsTest, ZeroOneLoopsMatchTheReference) {
  const size_t lengths[] = {0, 1, 7, 8, 9, 15, 16, 17, 100, 255, 256};
  for (size_t n : lengths) {
    AdamScalars s = CorrectedAdamScalars(3e-3f);
    const std::vector<float> g = VariedData(n, 40), x0 = VariedData(n, 41),
                             m0 = VariedData(n, 42), u0 = VariedData(n, 43),
                             w = VariedData(n, 44), anchor = VariedData(n, 45);
    std::vector<float> v = VariedData(n, 46);
    for (float& e : v) e = e * e;  // zeros included (VariedData's every 97th)
    for (size_t j = 5; j < n; j += 11) v[j] = j % 2 ? -0.0f : 0.0f;
    for (bool fresh : {false, true}) {
      for (bool write_x : {false, true}) {
        const std::string where = "n=" + std::to_string(n) +
                                  (fresh ? " fresh" : "") +
                                  (write_x ? " write_x" : "");
        std::vector<float> x_ref = x0, m_ref = m0, u_ref = u0;
        std::vector<float> x_fast = x0, m_fast = m0, u_fast = u0;
        ref_.zero_one_local_step(s, g.data(), x_ref.data(), m_ref.data(),
                                 u_ref.data(), v.data(), n, fresh, write_x);
        fast_->zero_one_local_step(s, g.data(), x_fast.data(), m_fast.data(),
                                   u_fast.data(), v.data(), n, fresh, write_x);
        EXPECT_EQ(FirstBitDifference(x_fast, x_ref), -1) << where << " x";
        EXPECT_EQ(FirstBitDifference(m_fast, m_ref), -1) << where << " m";
        EXPECT_EQ(FirstBitDifference(u_fast, u_ref), -1) << where << " u";
        if (n > 0) {
          EXPECT_NE(FirstBitDifference(u_ref, u0), -1) << where;
        }
      }
    }
    std::vector<float> out_ref(n, -1), out_fast(n, -2);
    ref_.zero_one_sync_message(s, 7e-3f, u0.data(), v.data(), out_ref.data(),
                               n);
    fast_->zero_one_sync_message(s, 7e-3f, u0.data(), v.data(), out_fast.data(),
                                 n);
    EXPECT_EQ(FirstBitDifference(out_fast, out_ref), -1) << "n=" << n;
    // A sync step's local step and message in one pass: the bits of the two
    // passes, with the message's scalars the local step's (one denominator
    // for both) or its own (here another eps).
    for (int round = 0; round < 4; ++round) {
      const bool fresh = round % 2 == 1, own_eps = round >= 2;
      AdamScalars sync = s;
      if (own_eps) sync.eps = 3e-7f;
      const std::string where =
          "n=" + std::to_string(n) + (fresh ? " fresh" : "") +
          (own_eps ? " own eps" : "") + " sync local step";
      std::vector<float> x_two = x0, m_two = m0, u_two = u0, msg_two(n, -1);
      ref_.zero_one_local_step(s, g.data(), x_two.data(), m_two.data(),
                               u_two.data(), v.data(), n, fresh, false);
      ref_.zero_one_sync_message(sync, 7e-3f, u_two.data(), v.data(),
                                 msg_two.data(), n);
      for (const KernelTable* table : {&ref_, fast_}) {
        std::vector<float> m_one = m0, u_one = u0, msg_one(n, -2);
        table->zero_one_sync_local_step(s, sync, 7e-3f, g.data(), x0.data(),
                                        m_one.data(), u_one.data(), v.data(), n,
                                        fresh, msg_one.data());
        EXPECT_EQ(FirstBitDifference(m_one, m_two), -1)
            << where << " m " << table->name;
        EXPECT_EQ(FirstBitDifference(u_one, u_two), -1)
            << where << " u " << table->name;
        EXPECT_EQ(FirstBitDifference(msg_one, msg_two), -1)
            << where << " message " << table->name;
      }
      EXPECT_EQ(FirstBitDifference(x_two, x0), -1) << where << " x unwritten";
    }
    for (bool mask : {false, true}) {
      for (bool own_anchor : {false, true}) {
        const std::string where = "n=" + std::to_string(n) +
                                  (mask ? " mask" : "") +
                                  (own_anchor ? " anchor" : " anchor=x");
        std::vector<float> x_ref = x0, m_ref = m0, x_fast = x0, m_fast = m0;
        ref_.zero_one_sync_step(s, mask, w.data(),
                                own_anchor ? anchor.data() : x_ref.data(),
                                x_ref.data(), m_ref.data(), v.data(), n);
        fast_->zero_one_sync_step(s, mask, w.data(),
                                  own_anchor ? anchor.data() : x_fast.data(),
                                  x_fast.data(), m_fast.data(), v.data(), n);
        EXPECT_EQ(FirstBitDifference(x_fast, x_ref), -1) << where << " x";
        EXPECT_EQ(FirstBitDifference(m_fast, m_ref), -1) << where << " m";
        for (size_t j = 0; j < n; ++j) {
          if (mask && v[j] == 0.0f) {
            ASSERT_TRUE(m_ref[j] == 0.0f && !std::signbit(m_ref[j]))
                << where << " j=" << j;
          }
        }
      }
    }
  }
}

TEST_P(KernelsTest, FillDrawsMatchesTheScalarGenerator) {
  // Starts inside and on a group of 4, lengths inside and across batches of
  // 32, a batch whose groups carry into the counter's high word, and keys
  // with both halves of the seed set.
  const uint64_t firsts[] = {
      0, 1, 3, 4, 1000003, (uint64_t{1} << 34) - 21, (uint64_t{1} << 34) + 7};
  const size_t lengths[] = {0, 1, 3, 31, 32, 33, 100, 4099};
  for (uint64_t first : firsts) {
    for (size_t n : lengths) {
      const RoundingKey key{0x123456789abcdefull, 77, 5, first};
      std::vector<float> ref(n, -1), fast(n, -2);
      ref_.fill_draws(key, ref.data(), n);
      fast_->fill_draws(key, fast.data(), n);
      EXPECT_EQ(FirstBitDifference(fast, ref), -1)
          << "first=" << first << " n=" << n;
      for (size_t i = 0; i < n; i += 97) {
        ASSERT_EQ(ref[i], StochasticDraw(key, first + i))
            << "first=" << first << " i=" << i;
      }
    }
  }
}

TEST_P(KernelsTest, NonFiniteInputFailsLikeTheReference) {
  std::vector<float> x(100, 1.0f);
  x[40] = NAN;
  std::vector<float> scales(1);
  std::vector<uint8_t> out(100);
  EXPECT_FALSE(fast_->sign1_encode(x.data(), nullptr, 100, kBlock,
                                   ScaleKind::kL2, {}, scales.data(),
                                   out.data(), nullptr));
  EXPECT_FALSE(fast_->int_encode(8, x.data(), nullptr, 100, kBlock, {}, nullptr,
                                 scales.data(), out.data()));
}

INSTANTIATE_TEST_SUITE_P(VectorTables, KernelsTest,
                         ::testing::Values("avx2", "avx512"),
                         [](const auto& info) { return info.param; });

TEST(ActiveKernelsTest, PicksTheWidestTheCpuRuns) {
  const char* expected = Avx512Kernels() ? "avx512"
                         : Avx2Kernels() ? "avx2"
                                         : "scalar";
  if (const char* forced = std::getenv("MORSE_SIMD"); forced && *forced) {
    GTEST_SKIP() << "MORSE_SIMD=" << forced << " narrows the choice";
  }
  EXPECT_STREQ(ActiveKernels().name, expected);
}

}  // namespace
}  // namespace morse::compress
