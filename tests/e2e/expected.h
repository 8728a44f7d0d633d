// What an end-to-end job of the synthetic workload must report: the
// simulator fed every worker's gradients, and the checksums of x, m, v a
// worker (all of it) and each shard (its range) hold after every step.
#ifndef MORSE_TESTS_E2E_EXPECTED_H_
#define MORSE_TESTS_E2E_EXPECTED_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "compress/simulator.h"
#include "proto/job_config.h"

namespace morse::testing {

struct Expected {
  std::vector<std::string> model;  // per step, all of x, m, v
  // [rank][step]: each worker's own x, m, v (model except after
  // zero_one_adam's local steps, where each worker moves on its own).
  std::vector<std::vector<std::string>> worker;
  // [shard][i]: the mirror after the i-th step that exchanged (every step
  // but zero_one_adam's local ones), and which steps those were.
  std::vector<std::vector<std::string>> shard;
  std::vector<int64_t> exchanged_steps;
};

// Runs the simulator on the synthetic workload's gradients and records the
// checksums a worker and each shard should report after every step;
// `absent`: the membership log, the ranks each step's partitions left out
// (design.md 4, "Membership"), as the replies said.
Expected Simulate(const proto::JobSpec& job,
                  const std::map<int64_t, compress::Absent>& absent = {});

// A shard's state log (morse-server --state_log: a line per exchanged step,
// no replays) has exactly `expected`'s steps and mirror checksums of shard
// `shard`.
void ExpectStateLogMatches(const std::string& state_log,
                           const Expected& expected, uint32_t shard);

}  // namespace morse::testing

#endif  // MORSE_TESTS_E2E_EXPECTED_H_
