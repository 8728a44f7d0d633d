#include "tests/e2e/expected.h"

#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"

namespace morse::testing {

void ExpectStateLogMatches(const std::string& state_log,
                           const Expected& expected, uint32_t shard) {
  const auto sums = JsonField(state_log, "mirror_checksum");
  const auto steps = JsonField(state_log, "step");
  ASSERT_EQ(sums.size(), expected.shard[shard].size()) << "shard " << shard;
  ASSERT_EQ(steps.size(), sums.size()) << "shard " << shard;
  for (size_t i = 0; i < sums.size(); ++i) {
    const int64_t step = expected.exchanged_steps[i];
    ASSERT_EQ(steps[i], std::to_string(step))
        << "shard " << shard << " logged another step";
    ASSERT_EQ(sums[i], expected.shard[shard][i])
        << "shard " << shard << " mirror differs at step " << step;
  }
}

}  // namespace morse::testing
