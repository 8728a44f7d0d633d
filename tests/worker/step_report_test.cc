// What morse-worker reports per step: the JSON line of every step, the
// progress line averaged over each log_every interval (also after a
// resume), and the Prometheus series.
#include "worker/step_report.h"

#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace morse::worker {
namespace {

StepRecord Record(int64_t step, double loss) {
  StepRecord r;
  r.step = step;
  r.phase = step < 2 ? "warmup" : "compression";
  r.up = step < 2 ? compress::CodecKind::kFp32 : compress::CodecKind::kSign1;
  r.down = r.up;
  r.loss = loss;
  r.step_seconds = 0.5;
  r.comm_seconds = 0.25;
  r.traffic.payload_up = 1000;
  r.traffic.payload_down = 2000;
  r.wire_up = 1100;
  if (step == 3) r.checksum = 0xabcdef;
  return r;
}

TEST(StepReportTest, AJsonLinePerStepAndAProgressLinePerInterval) {
  std::ostringstream jsonl;
  std::vector<std::string> lines;
  StepReport report({7, /*steps=*/5, /*first_step=*/0, /*log_every=*/2,
                     /*samples_per_step=*/32, &jsonl,
                     [&](const std::string& l) { lines.push_back(l); }});
  for (int64_t step = 0; step < 5; ++step) {
    StepRecord r = Record(step, step + 1.0);
    if (step == 1) r.inner_step_seconds = 0.25;  // diloco's, when measured
    report.Record(r);
  }
  std::istringstream in(jsonl.str());
  std::vector<std::string> json;
  for (std::string l; std::getline(in, l);) json.push_back(l);
  ASSERT_EQ(json.size(), 5u);
  EXPECT_NE(json[0].find("{\"step\":0,"), std::string::npos) << json[0];
  EXPECT_NE(json[0].find("\"phase\":\"warmup\",\"loss\":1,"), std::string::npos)
      << json[0];
  EXPECT_NE(
      json[2].find("\"bytes_up\":1000,\"bytes_down\":2000,\"wire_up\":1100"),
      std::string::npos);
  EXPECT_NE(json[3].find("\"checksum\":\"0000000000abcdef\"}"),
            std::string::npos)
      << json[3];
  EXPECT_EQ(json[2].find("checksum"), std::string::npos);
  EXPECT_NE(json[1].find(",\"inner_step_seconds\":0.250000"), std::string::npos)
      << json[1];
  EXPECT_EQ(json[0].find("inner_step_seconds"), std::string::npos);
  // Intervals [0,1], [2,3] and the last step alone: mean losses 1.5, 3.5, 5.
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_NE(lines[0].find("worker 7: step 2/5 warmup      loss 1.5000 | 64 "
                          "samples/s | up 1.0 KB down 2.0 KB"),
            std::string::npos)
      << lines[0];
  EXPECT_NE(lines[0].find("comm 50%"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("step 4/5 compression loss 3.5000"),
            std::string::npos)
      << lines[1];
  EXPECT_NE(lines[2].find("step 5/5 compression loss 5.0000"),
            std::string::npos)
      << lines[2];
}

TEST(StepReportTest, AResumedWorkerAveragesOnlyItsOwnSteps) {
  std::vector<std::string> lines;
  StepReport report({0, 10, /*first_step=*/3, 4, 1, nullptr,
                     [&](const std::string& l) { lines.push_back(l); }});
  report.Record(Record(
      3, 8.0));  // step 4 ends the interval [0, 3], of which it ran one step
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("step 4/10 compression loss 8.0000"),
            std::string::npos)
      << lines[0];
}

TEST(WorkerMetricsTest, EveryStepUpdatesTheSeries) {
  WorkerMetrics metrics(std::make_shared<prometheus::Registry>(), 3);
  metrics.Step(Record(0, 2.0));
  metrics.Step(Record(2, 1.5));
  metrics.SetErrorNorm(0.75);
  const std::string text =
      prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
  EXPECT_NE(text.find("morse_worker_steps_total{rank=\"3\"} 2"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("morse_worker_payload_bytes_total{codec=\"fp32\","
                      "direction=\"up\",rank=\"3\"} 1000"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("morse_worker_payload_bytes_total{codec=\"sign1\","
                      "direction=\"down\",rank=\"3\"} 2000"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("morse_worker_wire_bytes_total{direction=\"up\","
                      "rank=\"3\"} 2200"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("morse_worker_wire_bytes_total{direction=\"down\","
                      "rank=\"3\"} 0"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("morse_worker_loss{rank=\"3\"} 1.5"), std::string::npos)
      << text;
  EXPECT_NE(text.find("morse_worker_error_buffer_norm{rank=\"3\"} 0.75"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("morse_worker_step_seconds_count{rank=\"3\"} 2"),
            std::string::npos)
      << text;
}

}  // namespace
}  // namespace morse::worker
