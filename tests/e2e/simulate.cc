#include "absl/strings/str_format.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "gtest/gtest.h"
#include "tests/e2e/expected.h"
#include "worker/workload.h"

namespace morse::testing {

Expected Simulate(const proto::JobSpec& job) {
  const uint64_t dim = job.algorithm.layout.dim;
  auto sim =
      compress::Simulator::Create(job.algorithm, std::vector<float>(dim, 0.0f));
  EXPECT_TRUE(sim.ok()) << sim.status();
  std::vector<worker::SyntheticWorkload> workloads;
  for (uint32_t r = 0; r < job.workers(); ++r) workloads.emplace_back(job, r);
  std::vector<std::vector<float>> grads(job.workers(), std::vector<float>(dim));
  Expected expected;
  expected.shard.resize(job.shards());
  expected.worker.resize(job.workers());
  const auto hex = [](uint64_t v) { return absl::StrFormat("%016x", v); };
  for (int64_t step = 0; step < job.steps; ++step) {
    for (uint32_t r = 0; r < job.workers(); ++r) {
      EXPECT_TRUE(
          workloads[r]
              .Gradient(step, sim->worker_x(r), absl::MakeSpan(grads[r]))
              .ok());
    }
    std::vector<absl::Span<const float>> views(grads.begin(), grads.end());
    EXPECT_TRUE(sim->Step(views).ok());
    expected.model.push_back(
        hex(compress::StateChecksum({sim->x(), sim->m(), sim->v()})));
    for (uint32_t r = 0; r < job.workers(); ++r) {
      expected.worker[r].push_back(hex(compress::StateChecksum(
          {sim->worker_x(r), sim->worker_m(r), sim->v()})));
    }
    if (!compress::PlanStep(job.algorithm, step).exchanges) continue;
    expected.exchanged_steps.push_back(step);
    for (uint32_t s = 0; s < job.shards(); ++s) {
      const compress::Range r = sim->layout().shard_range(s);
      expected.shard[s].push_back(
          hex(compress::StateChecksum({sim->x().subspan(r.begin, r.size()),
                                       sim->m().subspan(r.begin, r.size()),
                                       sim->v().subspan(r.begin, r.size())})));
    }
  }
  return expected;
}

}  // namespace morse::testing
