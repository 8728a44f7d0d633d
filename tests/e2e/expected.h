// What an end-to-end job of the synthetic workload must report: the
// simulator fed every worker's gradients, and the checksums of x, m, v a
// worker (all of it) and each shard (its range) hold after every step.
#ifndef MORSE_TESTS_E2E_EXPECTED_H_
#define MORSE_TESTS_E2E_EXPECTED_H_

#include <string>
#include <vector>

#include "proto/job_config.h"

namespace morse::testing {

struct Expected {
  std::vector<std::string> model;               // per step, all of x, m, v
  std::vector<std::vector<std::string>> shard;  // [shard][step]
};

// Runs the simulator on the synthetic workload's gradients and records the
// checksums a worker and each shard should report after every step.
Expected Simulate(const proto::JobSpec& job);

}  // namespace morse::testing

#endif  // MORSE_TESTS_E2E_EXPECTED_H_
