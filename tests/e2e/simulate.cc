#include <algorithm>

#include "absl/strings/str_format.h"
#include "compress/optimizers/diloco.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "compress/step_plan.h"
#include "compress/update_rules.h"
#include "gtest/gtest.h"
#include "tests/e2e/expected.h"
#include "worker/workload.h"

namespace morse::testing {

Expected Simulate(const proto::JobSpec& job,
                  const std::map<int64_t, compress::Absent>& absent) {
  const uint64_t dim = job.algorithm.layout.dim;
  auto sim =
      compress::Simulator::Create(job.algorithm, std::vector<float>(dim, 0.0f));
  EXPECT_TRUE(sim.ok()) << sim.status();
  // Each worker's (a node's local ranks with local_ranks > 1).
  std::vector<std::unique_ptr<worker::Workload>> workloads;
  for (uint32_t r = 0; r < job.workers(); ++r)
    workloads.push_back(*worker::MakeWorkload(job, r));
  std::vector<std::vector<float>> grads(job.workers(), std::vector<float>(dim));
  Expected expected;
  expected.shard.resize(job.shards());
  expected.worker.resize(job.workers());
  const auto hex = [](uint64_t v) { return absl::StrFormat("%016x", v); };
  // diloco (design.md 2.11): each worker's inner Adam, written out here.
  const compress::AlgorithmConfig& a = job.algorithm;
  const bool diloco = a.optimizer == compress::OptimizerKind::kDiloco;
  std::vector<std::vector<float>> inner_m(job.workers(), grads[0]),
      inner_v(inner_m), local(inner_m), inner_grad(inner_m);
  compress::LrSchedule inner_lr = a.lr;
  // Streaming (fragments F > 1): sync_every / F inner steps per outer step,
  // and only what the last step synced starts again from x.
  const int64_t period = a.diloco.sync_every / a.diloco.fragments;
  inner_lr.total_steps *= period;
  const compress::Layout layout = *compress::Layout::Create(a.layout);
  for (int64_t step = 0; step < job.steps; ++step) {
    for (uint32_t r = 0; r < job.workers(); ++r) {
      if (!diloco) {
        EXPECT_TRUE(
            workloads[r]
                ->Gradient(step, sim->worker_x(r), absl::MakeSpan(grads[r]))
                .ok());
        continue;
      }
      if (step == 0) {
        std::fill(inner_m[r].begin(), inner_m[r].end(), 0.0f);
        std::fill(inner_v[r].begin(), inner_v[r].end(), 0.0f);
      }
      for (int64_t h = 0; h < period; ++h) {
        // The outer parameters of the step before, merged before inner
        // step overlap_steps (compress::MergeOuter: the synced partitions
        // become them, or a mix by diloco.mixing); all of x before the
        // first.
        if (h == (step == 0 ? 0 : a.diloco.overlap_steps))
          compress::MergeOuter(a, layout, step - 1, sim->x(),
                               absl::MakeSpan(local[r]));
        const int64_t t = step * period + h;
        EXPECT_TRUE(workloads[r]
                        ->Gradient(t, local[r], absl::MakeSpan(inner_grad[r]))
                        .ok());
        compress::AdamStep(compress::MakeAdamScalars(
                               a.adam, compress::LearningRate(inner_lr, t),
                               t + 1, a.bias_correction),
                           inner_grad[r], absl::MakeSpan(local[r]),
                           absl::MakeSpan(inner_m[r]),
                           absl::MakeSpan(inner_v[r]));
      }
      for (uint64_t j = 0; j < dim; ++j)
        grads[r][j] = sim->x()[j] - local[r][j];
    }
    std::vector<absl::Span<const float>> views(grads.begin(), grads.end());
    const auto out = absent.find(step);
    const absl::Status stepped = sim->Step(
        views, {}, out != absent.end() ? out->second : compress::Absent());
    EXPECT_TRUE(stepped.ok()) << stepped;
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
