// libmorse: worker/session.h and compress/simulator.h behind the C ABI of
// capi.h. Each function turns an absl::Status into its canonical code and
// keeps the message for morse_last_error(); no C++ exception crosses.
#include "worker/python/capi.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "compress/boundary.h"
#include "compress/optimizer.h"
#include "compress/optimizers/diloco.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "compress/step_plan.h"
#include "compress/trace.h"
#include "proto/job_config.h"
#include "proto/process_memory.h"
#include "proto/security.h"
#include "proto/wire.h"
#include "worker/engine/engine.h"
#include "worker/session.h"
#include "worker/stage_link.h"

struct morse_session {
  std::unique_ptr<morse::worker::Session> session;
  uint64_t dim = 0;
  // The optimizer's own arrays (compress::Optimizer::State): their names
  // live here for morse_session_state_array.
  std::vector<morse::compress::StateArray> arrays;
  uint64_t commit_values = 0;  // Optimizer::CommitDoubles
  // Its local interval's arrays (Optimizer::IntervalState), the same way.
  std::vector<morse::compress::StateArray> interval_arrays;
};

struct morse_simulator {
  std::unique_ptr<morse::compress::Simulator> simulator;
  uint64_t dim = 0;
};

struct morse_link {
  std::unique_ptr<morse::worker::StageLink> link;
  morse::worker::StageFrame received;
};

struct morse_boundary {
  std::unique_ptr<morse::compress::BoundaryCodec> codec;
  std::string payload;
};

namespace {

thread_local std::string last_error;

int Fail(const absl::Status& s) {
  last_error =
      absl::StrCat(absl::StatusCodeToString(s.code()), ": ", s.message());
  return static_cast<int>(s.code());
}

int Done(const absl::Status& s) { return s.ok() ? 0 : Fail(s); }

// Runs `f` (returning absl::Status), turning a stray C++ exception into
// INTERNAL rather than letting it unwind through C.
template <class F>
int Guard(F&& f) {
  try {
    return Done(f());
  } catch (const std::exception& e) {
    return Fail(
        absl::InternalError(absl::StrCat("unexpected exception: ", e.what())));
  }
}

absl::Status NotNull(const void* p, const char* what) {
  if (p == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(what, " is null"));
  return absl::OkStatus();
}

absl::StatusOr<morse::proto::SecurityOptions> ParseSecurity(const char* text) {
  morse::proto::SecurityOptions o;
  if (text == nullptr) return o;
  for (absl::string_view line :
       absl::StrSplit(text, '\n', absl::SkipWhitespace())) {
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("security option '", line, "' is not key=value"));
    }
    const absl::string_view key =
        absl::StripAsciiWhitespace(line.substr(0, eq));
    const std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
    if (key == "insecure") {
      o.insecure = value == "1" || value == "true" || value == "True";
    } else if (key == "refresh_seconds") {
      if (!absl::SimpleAtoi(value, &o.refresh_seconds) ||
          o.refresh_seconds <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "refresh_seconds must be a positive integer, not '", value, "'"));
      }
    } else if (key == "tls_ca") {
      o.tls_ca = value;
    } else if (key == "tls_cert") {
      o.tls_cert = value;
    } else if (key == "tls_key") {
      o.tls_key = value;
    } else if (key == "tls_server_name") {
      o.tls_server_name = value;
    } else if (key == "token_file") {
      o.token_file = value;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown security option '", key, "'"));
    }
  }
  return o;
}

absl::Status CheckSession(morse_session* s) {
  return NotNull(s, "the session");
}

// `count` learning rates and weight decays from the caller's arrays (none
// for 0).
// `moments`: null, or 3 * count floats (each one's beta1, beta2, eps).
// `first_steps`: null (all 0), or count steps from which each one's
// parameters train.
absl::StatusOr<std::vector<morse::compress::StepHyper>> StepHypers(
    uint32_t count, const float* lr, const float* weight_decay,
    const float* moments, const int64_t* first_steps) {
  std::vector<morse::compress::StepHyper> hypers;
  if (count == 0 && (moments != nullptr || first_steps != nullptr)) {
    return absl::InvalidArgumentError(
        "betas and eps, or first steps, without lr and weight_decay");
  }
  if (count == 0) return hypers;
  if (absl::Status st = NotNull(lr, "lr"); !st.ok()) return st;
  if (absl::Status st = NotNull(weight_decay, "weight_decay"); !st.ok())
    return st;
  for (uint32_t i = 0; i < count; ++i) {
    hypers.push_back(morse::compress::StepHyper{lr[i], weight_decay[i]});
    if (moments != nullptr) {
      hypers.back().moments = morse::compress::StepMoments{
          moments[3 * i], moments[3 * i + 1], moments[3 * i + 2]};
    }
    if (first_steps != nullptr) hypers.back().first_step = first_steps[i];
  }
  return hypers;
}

}  // namespace

extern "C" {

int morse_capi_version(void) { return MORSE_CAPI_VERSION; }

// Before any gRPC object of this library exists (see TuneGrpcForReconnects;
// a process that initialized gRPC earlier keeps its own setting).
__attribute__((constructor)) static void MorseTuneGrpc() {
  morse::proto::TuneGrpcForReconnects();
}

const char* morse_last_error(void) { return last_error.c_str(); }

int morse_cuda_device(char* buf, uint64_t size) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(buf, "buf"); !s.ok()) return s;
    auto description = morse::worker::DescribeCuda();
    if (!description.ok()) return description.status();
    if (size == 0) return absl::InvalidArgumentError("buf has no room");
    const size_t n = std::min<size_t>(description->size(), size - 1);
    std::memcpy(buf, description->data(), n);
    buf[n] = '\0';
    return absl::OkStatus();
  });
}

int morse_job_block_elems(const char* base, const char* overrides,
                          uint32_t* out) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    auto job = morse::proto::ParseJobConfigWithOverrides(
        base ? base : "", overrides ? overrides : "");
    if (!job.ok()) return job.status();
    *out = job->algorithm.layout.block_elems;
    return absl::OkStatus();
  });
}

int morse_session_create(const char* base, const char* overrides, uint32_t rank,
                         const char* servers, float* x, uint64_t dim,
                         const char* security, morse_session** out) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    if (absl::Status s = NotNull(x, "x"); !s.ok()) return s;
    if (absl::Status s = NotNull(servers, "servers"); !s.ok()) return s;
    auto job = morse::proto::ParseJobConfigWithOverrides(
        base ? base : "", overrides ? overrides : "");
    if (!job.ok()) return job.status();
    auto options = ParseSecurity(security);
    if (!options.ok()) return options.status();
    std::vector<std::string> addresses =
        absl::StrSplit(servers, ',', absl::SkipEmpty());
    // MORSE_COMPUTE_THREADS: the session's compute pool (encodes, reply
    // applies and the optimizer's passes on the CPU; 0 or unset: none).
    int compute_threads = 0;
    if (const char* threads = std::getenv("MORSE_COMPUTE_THREADS");
        threads != nullptr && *threads != '\0' &&
        !(absl::SimpleAtoi(threads, &compute_threads) && compute_threads >= 0 &&
          compute_threads <= 1024)) {
      return absl::InvalidArgumentError(
          absl::StrCat("MORSE_COMPUTE_THREADS=", threads,
                       ": a number of threads in [0, 1024]"));
    }
    // MORSE_MALLOC: "daemon" (or unset) sets malloc up as the daemons do
    // (a session's 4 MiB payloads stay mapped between steps), "default"
    // leaves glibc's settings; once per process, at its first session.
    const char* malloc_mode = std::getenv("MORSE_MALLOC");
    const std::string mode = malloc_mode != nullptr ? malloc_mode : "";
    if (!mode.empty() && mode != "daemon" && mode != "default") {
      return absl::InvalidArgumentError(absl::StrCat(
          "MORSE_MALLOC=", mode, ": daemon (the default) or default"));
    }
    if (mode != "default") {
      static const bool kept = morse::proto::KeepLargeBuffersMapped();
      (void)kept;
    }
    auto session = morse::worker::Session::Connect(
        *job, rank, std::move(addresses), *options, absl::MakeSpan(x, dim),
        compute_threads);
    if (!session.ok()) return session.status();
    // MORSE_TRACE=FILE ("{rank}" becomes the rank): this process's step
    // timeline, written at exit.
    if (const char* trace = std::getenv("MORSE_TRACE");
        trace != nullptr && *trace != '\0' && !morse::trace::Enabled()) {
      if (absl::Status s = morse::trace::Start(
              morse::trace::ExpandPath(trace, std::to_string(rank)),
              absl::StrCat("rank ", rank));
          !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("MORSE_TRACE: ", s.message()));
      }
    }
    const morse::compress::AlgorithmConfig& algorithm =
        (*session)->job().algorithm;
    const morse::compress::Optimizer& optimizer =
        morse::compress::OptimizerOf(algorithm);
    *out = new morse_session{
        *std::move(session), dim, optimizer.State(algorithm),
        optimizer.CommitDoubles(algorithm), optimizer.IntervalState(algorithm)};
    return absl::OkStatus();
  });
}

void morse_session_destroy(morse_session* s) { delete s; }

int morse_session_start(morse_session* s, int resume, const char* checkpoint,
                        int64_t* first_step) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    auto step = s->session->Start(resume != 0, checkpoint ? checkpoint : "");
    if (!step.ok()) return step.status();
    if (first_step != nullptr) *first_step = *step;
    return absl::OkStatus();
  });
}

int morse_session_wait_all_joined(morse_session* s) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    return s->session->WaitAllJoined();
  });
}

int morse_session_use_cuda(morse_session* s, float* x_device,
                           float* grad_device) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(x_device, "x_device"); !st.ok()) return st;
    if (absl::Status st = NotNull(grad_device, "grad_device"); !st.ok())
      return st;
    if (s->session->engine().kind() != "cpu") {
      return absl::FailedPreconditionError("the session already uses a GPU");
    }
    return s->session->MoveTo("cuda", {x_device, grad_device});
  });
}

int morse_session_set_step_hyper(morse_session* s, uint32_t count,
                                 const float* lr, const float* weight_decay,
                                 const float* moments,
                                 const int64_t* first_steps) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    auto hypers = StepHypers(count, lr, weight_decay, moments, first_steps);
    if (!hypers.ok()) return hypers.status();
    return s->session->SetStepHyper(*std::move(hypers));
  });
}

int morse_session_set_buffers(morse_session* s, const void* data,
                              uint64_t size) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (size > 0) {
      if (absl::Status st = NotNull(data, "data"); !st.ok()) return st;
    }
    if (size > morse::proto::kMaxBufferBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("module buffers of ", size, " bytes; at most ",
                       morse::proto::kMaxBufferBytes));
    }
    s->session->SetStepBuffers(
        std::string(static_cast<const char*>(data), size));
    return absl::OkStatus();
  });
}

int morse_session_set_defer_apply(morse_session* s, int defer) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    s->session->SetDeferApply(defer != 0);
    return absl::OkStatus();
  });
}

int morse_session_set_step_clipping(morse_session* s, int on) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    return s->session->SetStepClipping(on != 0);
  });
}

int morse_session_clip(morse_session* s, float max_norm,
                       double* sum_of_squares) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(sum_of_squares, "sum_of_squares"); !st.ok())
      return st;
    absl::StatusOr<double> sum = s->session->ClipAt(max_norm);
    if (!sum.ok()) return sum.status();
    *sum_of_squares = *sum;
    return absl::OkStatus();
  });
}

int morse_session_clip_pieces(morse_session* s, const uint64_t* ends,
                              const float* scales, uint64_t n) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (n > 0) {
      if (absl::Status st = NotNull(ends, "ends"); !st.ok()) return st;
      if (absl::Status st = NotNull(scales, "scales"); !st.ok()) return st;
    }
    morse::compress::ClipPieces pieces(n);
    for (uint64_t i = 0; i < n; ++i) pieces[i] = {ends[i], scales[i]};
    return s->session->ClipPiecesAt(std::move(pieces));
  });
}

int morse_session_clips_locally(morse_session* s, int* locally) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(locally, "locally"); !st.ok()) return st;
    *locally = s->session->clips_locally() ? 1 : 0;
    return absl::OkStatus();
  });
}

int morse_session_check_first_step(morse_session* s, int64_t first_step) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    morse::compress::StepHyper hyper;
    hyper.first_step = first_step;
    return morse::compress::CheckStepHyper(s->session->job().algorithm, hyper);
  });
}

int morse_session_average_norm(morse_session* s, double norm_type,
                               double* norm) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(norm, "norm"); !st.ok()) return st;
    absl::StatusOr<double> got = s->session->AverageNorm(norm_type);
    if (!got.ok()) return got.status();
    *norm = *got;
    return absl::OkStatus();
  });
}

int morse_session_average_gradient(morse_session* s, float* out, uint64_t dim) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(out, "out"); !st.ok()) return st;
    return s->session->AverageGradient(absl::MakeSpan(out, dim));
  });
}

int morse_session_clipped_average(morse_session* s, float* out, uint64_t dim) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(out, "out"); !st.ok()) return st;
    return s->session->ClippedAverage(absl::MakeSpan(out, dim));
  });
}

int morse_session_amend(morse_session* s, const float* gradient, uint64_t dim) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(gradient, "gradient"); !st.ok()) return st;
    return s->session->AmendAt(std::vector<float>(gradient, gradient + dim));
  });
}

int morse_session_received_buffers(morse_session* s, void* out,
                                   uint64_t capacity, uint64_t* size) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(size, "size"); !st.ok()) return st;
    const std::string& got = s->session->received_buffers();
    *size = got.size();
    if (capacity > 0) {
      if (absl::Status st = NotNull(out, "out"); !st.ok()) return st;
      std::memcpy(out, got.data(), std::min<uint64_t>(capacity, got.size()));
    }
    return absl::OkStatus();
  });
}

int morse_session_begin(morse_session* s, const float* grad, uint64_t dim) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(grad, "grad"); !st.ok()) return st;
    return s->session->Begin(absl::MakeConstSpan(grad, dim));
  });
}

int morse_session_begin_device(morse_session* s) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    return s->session->BeginFromEngine();
  });
}

int morse_session_send_partitions(morse_session* s, const uint32_t* partitions,
                                  uint32_t count, void* stream) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (count > 0 && partitions == nullptr)
      return absl::InvalidArgumentError("no partition array");
    // A device session always waits: NULL is the legacy default stream,
    // PyTorch's default stream's handle (skipping it let the encodes read
    // gradients backward() had not finished writing).
    if (s->session->engine().kind() == "cpu") {
      if (stream != nullptr) {
        return absl::FailedPreconditionError(
            "the session keeps its model on the host (morse_session_use_cuda)");
      }
    } else if (absl::Status st = s->session->engine().WaitFor(stream);
               !st.ok()) {
      return st;
    }
    for (uint32_t i = 0; i < count; ++i) {
      if (absl::Status st = s->session->SendPartition(partitions[i]); !st.ok())
        return st;
    }
    return absl::OkStatus();
  });
}

int morse_session_finish(morse_session* s, morse_step_traffic* traffic) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    morse::worker::StepTraffic t;
    absl::Status st = s->session->Finish(&t);
    if (traffic != nullptr) {
      *traffic = {t.payload_up, t.payload_down, t.encode_seconds,
                  t.apply_seconds, static_cast<uint64_t>(t.retries)};
    }
    return st;
  });
}

int morse_session_partitions(morse_session* s, uint64_t* ranges,
                             uint64_t capacity, uint64_t* count) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    const auto& partitions = s->session->layout().partitions();
    if (count != nullptr) *count = partitions.size();
    if (capacity > 0 && ranges == nullptr)
      return absl::InvalidArgumentError("ranges is null");
    for (uint64_t i = 0; i < std::min<uint64_t>(capacity, partitions.size());
         ++i) {
      ranges[2 * i] = partitions[i].range.begin;
      ranges[2 * i + 1] = partitions[i].range.end;
    }
    return absl::OkStatus();
  });
}

int morse_session_idle(morse_session* s, int64_t step, uint32_t partition,
                       int* idle) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    const auto& partitions = s->session->layout().partitions();
    if (partition >= partitions.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("partition ", partition, " of ", partitions.size()));
    }
    if (idle == nullptr) return absl::InvalidArgumentError("idle is null");
    *idle = morse::compress::Idle(s->session->job().algorithm, step,
                                  partitions[partition].range.begin)
                ? 1
                : 0;
    return absl::OkStatus();
  });
}

int morse_session_merge_outer(morse_session* s, int64_t step, float* local,
                              uint64_t dim) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(local, "local"); !st.ok()) return st;
    const morse::compress::AlgorithmConfig& algorithm =
        s->session->job().algorithm;
    if (morse::compress::OptimizerOf(algorithm).InnerSteps(algorithm) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("merge_outer is for an optimizer with inner steps "
                       "(diloco); this job's optimizer is ",
                       morse::compress::OptimizerOf(algorithm).name()));
    }
    if (dim != s->session->layout().spec().dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("local holds ", dim, " values, the model ",
                       s->session->layout().spec().dim));
    }
    if (step < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", step, ": an outer step, at least 0"));
    }
    if (step >= s->session->step()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "outer step ", step, " has not completed (the session is at step ",
          s->session->step(), ")"));
    }
    if (s->session->step_in_flight()) {
      return absl::FailedPreconditionError(
          "a step is in progress: merge after finish()");
    }
    if (absl::Status st = s->session->SyncHost(); !st.ok()) return st;
    morse::compress::MergeOuter(algorithm, s->session->layout(), step,
                                s->session->replica().x(),
                                absl::MakeSpan(local, dim));
    return absl::OkStatus();
  });
}

int morse_session_inner_steps_before(morse_session* s, int64_t step,
                                     int64_t* inner_steps) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(inner_steps, "inner_steps"); !st.ok())
      return st;
    const morse::compress::AlgorithmConfig& algorithm =
        s->session->job().algorithm;
    if (morse::compress::OptimizerOf(algorithm).InnerSteps(algorithm) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "inner_steps_before is for an optimizer with inner steps (diloco); "
          "this job's optimizer is ",
          morse::compress::OptimizerOf(algorithm).name()));
    }
    if (step < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("step ", step, ": an outer step, at least 0"));
    }
    *inner_steps = morse::compress::InnerStepsBefore(algorithm, step);
    return absl::OkStatus();
  });
}

int64_t morse_session_step(morse_session* s) {
  return s == nullptr ? -1 : s->session->step();
}

int64_t morse_session_exchanged_step(morse_session* s) {
  return s == nullptr ? -1 : s->session->exchanged_step();
}

int morse_session_grad_sum_of_squares(morse_session* s, double* value,
                                      int* present) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(value, "value"); !st.ok()) return st;
    if (absl::Status st = NotNull(present, "present"); !st.ok()) return st;
    std::optional<double> sum = s->session->grad_sum_of_squares();
    *present = sum.has_value() ? 1 : 0;
    *value = sum.value_or(0.0);
    return absl::OkStatus();
  });
}

int morse_session_checksum(morse_session* s, uint64_t* checksum) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(checksum, "checksum"); !st.ok()) return st;
    if (absl::Status st = s->session->SyncHost(); !st.ok()) return st;
    *checksum = s->session->replica().Checksum();
    return absl::OkStatus();
  });
}

int morse_session_get_state(morse_session* s, int64_t* step, float* m, float* v,
                            float* error) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    for (const void* p :
         {static_cast<const void*>(step), static_cast<const void*>(m),
          static_cast<const void*>(v), static_cast<const void*>(error)}) {
      if (absl::Status st = NotNull(p, "a state array"); !st.ok()) return st;
    }
    if (absl::Status st = s->session->SyncHost(); !st.ok()) return st;
    const morse::compress::Replica& r = s->session->replica();
    *step = s->session->step();
    std::copy(r.m().begin(), r.m().end(), m);
    std::copy(r.v().begin(), r.v().end(), v);
    s->session->error().Read(0, absl::MakeSpan(error, s->dim));
    return absl::OkStatus();
  });
}

// Session::Restore from the C ABI's arrays of s->dim floats (m, v and
// error required, server_error optional) and the rank's own state or its
// local interval (each optional), after the session's check.
static absl::Status RestoreFrom(
    morse_session* s, int64_t step, const float* m, const float* v,
    const float* error, const float* server_error,
    const morse::worker::Session::OwnState* own = nullptr,
    const morse::worker::Session::IntervalState* interval = nullptr) {
  for (const void* p :
       {static_cast<const void*>(m), static_cast<const void*>(v),
        static_cast<const void*>(error)}) {
    if (absl::Status st = NotNull(p, "a state array"); !st.ok()) return st;
  }
  return s->session->Restore(
      step, absl::MakeConstSpan(m, s->dim), absl::MakeConstSpan(v, s->dim),
      absl::MakeConstSpan(error, s->dim),
      server_error == nullptr ? absl::Span<const float>()
                              : absl::MakeConstSpan(server_error, s->dim),
      own, interval);
}

int morse_session_set_state(morse_session* s, int64_t step, const float* m,
                            const float* v, const float* error,
                            const float* server_error) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    return RestoreFrom(s, step, m, v, error, server_error);
  });
}

int morse_session_state_arrays(morse_session* s, uint32_t* count,
                               uint64_t* commit_values) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(count, "count"); !st.ok()) return st;
    if (absl::Status st = NotNull(commit_values, "commit_values"); !st.ok())
      return st;
    *count = static_cast<uint32_t>(s->arrays.size());
    *commit_values = s->commit_values;
    return absl::OkStatus();
  });
}

// Array i of `arrays` (the session's state or interval arrays): its name,
// length and whether it has one value per parameter.
static int ArrayInfo(morse_session* s,
                     const std::vector<morse::compress::StateArray>* arrays,
                     uint32_t i, const char** name, uint64_t* values,
                     int* per_element) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    for (const void* p :
         {static_cast<const void*>(name), static_cast<const void*>(values),
          static_cast<const void*>(per_element)}) {
      if (absl::Status st = NotNull(p, "an output"); !st.ok()) return st;
    }
    if (i >= arrays->size()) {
      return absl::OutOfRangeError(
          absl::StrCat("array ", i, " of ", arrays->size()));
    }
    const morse::compress::StateArray& array = (*arrays)[i];
    *name = array.name.c_str();
    *values = array.per_element ? s->dim : array.floats;
    *per_element = array.per_element ? 1 : 0;
    return absl::OkStatus();
  });
}

// The `count` arrays the caller gives (set_own_state's, set_interval's),
// `listed` in order (the session's state or interval arrays), as named
// arrays: INVALID_ARGUMENT for another count or a null array.
static absl::Status ReadArrays(
    morse_session* s, const std::vector<morse::compress::StateArray>& listed,
    const float* const* arrays, uint32_t count, const char* what,
    std::vector<morse::compress::NamedState>* out) {
  if (count != listed.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(count, " ", what, " arrays given; the optimizer keeps ",
                     listed.size()));
  }
  if (count > 0) {
    if (absl::Status st = NotNull(arrays, "arrays"); !st.ok()) return st;
  }
  for (uint32_t i = 0; i < count; ++i) {
    if (absl::Status st = NotNull(arrays[i], "a state array"); !st.ok())
      return st;
    const uint64_t n = listed[i].per_element ? s->dim : listed[i].floats;
    out->push_back({listed[i].name, {arrays[i], arrays[i] + n}});
  }
  return absl::OkStatus();
}

int morse_session_state_array(morse_session* s, uint32_t i, const char** name,
                              uint64_t* values, int* per_element) {
  return ArrayInfo(s, s == nullptr ? nullptr : &s->arrays, i, name, values,
                   per_element);
}

int morse_session_interval_arrays(morse_session* s, uint32_t* count) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(count, "count"); !st.ok()) return st;
    *count = static_cast<uint32_t>(s->interval_arrays.size());
    return absl::OkStatus();
  });
}

int morse_session_interval_array(morse_session* s, uint32_t i,
                                 const char** name, uint64_t* values,
                                 int* per_element) {
  return ArrayInfo(s, s == nullptr ? nullptr : &s->interval_arrays, i, name,
                   values, per_element);
}

int morse_session_get_interval(morse_session* s, float* const* arrays,
                               uint32_t count, int64_t* last_local_step,
                               float* shards_m, float* server_error) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(last_local_step, "last_local_step"); !st.ok())
      return st;
    if (count != s->interval_arrays.size() || count == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          count, " interval arrays asked for; the optimizer keeps ",
          s->interval_arrays.size()));
    }
    if (absl::Status st = NotNull(arrays, "arrays"); !st.ok()) return st;
    if ((shards_m == nullptr) != (server_error == nullptr)) {
      return absl::InvalidArgumentError(
          "shards_m and server_error are asked for together");
    }
    auto interval = s->session->SavedInterval();
    if (!interval.ok()) return interval.status();
    for (uint32_t i = 0; i < count; ++i) {
      if (absl::Status st = NotNull(arrays[i], "an interval array"); !st.ok())
        return st;
    }
    if (shards_m != nullptr) {
      if (absl::Status st =
              s->session->ShardsAtSync(absl::MakeSpan(shards_m, s->dim),
                                       absl::MakeSpan(server_error, s->dim));
          !st.ok())
        return st;
    }
    for (uint32_t i = 0; i < count; ++i) {
      const std::vector<float>& values = interval->arrays[i].values;
      std::copy(values.begin(), values.end(), arrays[i]);
    }
    *last_local_step = interval->last_local_step;
    return absl::OkStatus();
  });
}

int morse_session_set_interval(morse_session* s, int64_t step, const float* m,
                               const float* v, const float* error,
                               const float* server_error, const float* shards_m,
                               const float* const* arrays, uint32_t count,
                               int64_t last_local_step) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    morse::worker::Session::IntervalState interval;
    if (absl::Status st = ReadArrays(s, s->interval_arrays, arrays, count,
                                     "interval", &interval.arrays);
        !st.ok())
      return st;
    interval.last_local_step = last_local_step;
    if (shards_m != nullptr)
      interval.shards_m.assign(shards_m, shards_m + s->dim);
    return RestoreFrom(s, step, m, v, error, server_error, nullptr, &interval);
  });
}

int morse_session_get_own_state(morse_session* s, float* const* arrays,
                                uint32_t count, double* commit,
                                uint64_t* commit_values) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(commit_values, "commit_values"); !st.ok())
      return st;
    if (count != s->arrays.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(count, " state arrays asked for; the optimizer keeps ",
                       s->arrays.size()));
    }
    if (count > 0) {
      if (absl::Status st = NotNull(arrays, "arrays"); !st.ok()) return st;
    }
    if (s->commit_values > 0) {
      if (absl::Status st = NotNull(commit, "commit"); !st.ok()) return st;
    }
    auto state = s->session->SavedOwn();
    if (!state.ok()) return state.status();
    for (uint32_t i = 0; i < count; ++i) {
      if (absl::Status st = NotNull(arrays[i], "a state array"); !st.ok())
        return st;
      const std::vector<float>& values = state->arrays[i].values;
      std::copy(values.begin(), values.end(), arrays[i]);
    }
    *commit_values = state->commit.size();
    std::copy(state->commit.begin(), state->commit.end(), commit);
    return absl::OkStatus();
  });
}

int morse_session_set_own_state(morse_session* s, int64_t step, const float* m,
                                const float* v, const float* error,
                                const float* server_error,
                                const float* const* arrays, uint32_t count,
                                const double* commit, uint64_t commit_values) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (commit_values > 0) {
      if (absl::Status st = NotNull(commit, "commit"); !st.ok()) return st;
    }
    morse::worker::Session::OwnState own;
    if (absl::Status st =
            ReadArrays(s, s->arrays, arrays, count, "state", &own.arrays);
        !st.ok())
      return st;
    if (commit_values > 0) own.commit.assign(commit, commit + commit_values);
    return RestoreFrom(s, step, m, v, error, server_error, &own);
  });
}

int morse_session_reload_model(morse_session* s) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    return s->session->ReloadModel();
  });
}

int morse_session_holds_shards_model(morse_session* s, int* holds) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(holds, "holds"); !st.ok()) return st;
    absl::StatusOr<bool> same = s->session->HoldsShardsModel();
    if (!same.ok()) return same.status();
    *holds = *same ? 1 : 0;
    return absl::OkStatus();
  });
}

int morse_session_server_error(morse_session* s, float* out) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(out, "out"); !st.ok()) return st;
    return s->session->ServerError(absl::MakeSpan(out, s->dim));
  });
}

int morse_session_save_checkpoint(morse_session* s, const char* path) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(path, "path"); !st.ok()) return st;
    if (absl::Status st = s->session->SyncHost(); !st.ok()) return st;
    return s->session->SaveCheckpoint(path);
  });
}

int morse_session_checkpoint_every(morse_session* s, uint32_t* every_steps) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(every_steps, "every_steps"); !st.ok())
      return st;
    *every_steps = s->session->job().checkpoint_every_steps;
    return absl::OkStatus();
  });
}

int morse_session_members(morse_session* s, uint32_t* ranks, uint32_t capacity,
                          uint32_t* count) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(count, "count"); !st.ok()) return st;
    if (capacity > 0) {
      if (absl::Status st = NotNull(ranks, "ranks"); !st.ok()) return st;
    }
    const std::vector<uint32_t> members = s->session->members();
    *count = static_cast<uint32_t>(members.size());
    for (uint32_t i = 0; i < members.size() && i < capacity; ++i)
      ranks[i] = members[i];
    return absl::OkStatus();
  });
}

int morse_simulator_create(const char* base, const char* overrides,
                           const float* x0, uint64_t dim,
                           morse_simulator** out) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = NotNull(out, "out"); !st.ok()) return st;
    if (absl::Status st = NotNull(x0, "x0"); !st.ok()) return st;
    auto job = morse::proto::ParseJobConfigWithOverrides(
        base ? base : "", overrides ? overrides : "");
    if (!job.ok()) return job.status();
    auto simulator = morse::compress::Simulator::Create(
        job->algorithm, absl::MakeConstSpan(x0, dim));
    if (!simulator.ok()) return simulator.status();
    *out = new morse_simulator{
        std::make_unique<morse::compress::Simulator>(*std::move(simulator)),
        dim};
    return absl::OkStatus();
  });
}

void morse_simulator_destroy(morse_simulator* sim) { delete sim; }

int morse_simulator_step(morse_simulator* sim, const float* const* gradients,
                         uint32_t workers, uint64_t dim) {
  return morse_simulator_step_without(sim, gradients, workers, dim, nullptr, 0);
}

int morse_simulator_step_without(morse_simulator* sim,
                                 const float* const* gradients,
                                 uint32_t workers, uint64_t dim,
                                 const uint32_t* absent, uint32_t count) {
  return morse_simulator_step_hyper(sim, gradients, workers, dim, absent, count,
                                    nullptr, nullptr, 0, nullptr, nullptr);
}

int morse_simulator_step_hyper(morse_simulator* sim,
                               const float* const* gradients, uint32_t workers,
                               uint64_t dim, const uint32_t* absent,
                               uint32_t count, const float* lr,
                               const float* weight_decay, uint32_t hypers,
                               const float* moments,
                               const int64_t* first_steps) {
  return Guard([&]() -> absl::Status {
    auto step_hypers =
        StepHypers(hypers, lr, weight_decay, moments, first_steps);
    if (!step_hypers.ok()) return step_hypers.status();
    if (count > 0) {
      if (absl::Status st = NotNull(absent, "absent"); !st.ok()) return st;
    }
    if (absl::Status st = NotNull(sim, "the simulator"); !st.ok()) return st;
    if (absl::Status st = NotNull(gradients, "gradients"); !st.ok()) return st;
    std::vector<absl::Span<const float>> views;
    for (uint32_t w = 0; w < workers; ++w) {
      if (absl::Status st = NotNull(gradients[w], "a gradient"); !st.ok())
        return st;
      views.push_back(absl::MakeConstSpan(gradients[w], dim));
    }
    morse::compress::Absent left_out;
    if (count > 0) {
      left_out.assign(sim->simulator->layout().partitions().size(),
                      std::vector<uint32_t>(absent, absent + count));
    }
    return sim->simulator->Step(views, *step_hypers, left_out);
  });
}

int morse_simulator_checksum(morse_simulator* sim, uint64_t* checksum) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = NotNull(sim, "the simulator"); !st.ok()) return st;
    if (absl::Status st = NotNull(checksum, "checksum"); !st.ok()) return st;
    const auto& s = *sim->simulator;
    *checksum = morse::compress::StateChecksum({s.x(), s.m(), s.v()});
    return absl::OkStatus();
  });
}

int morse_simulator_worker_checksum(morse_simulator* sim, uint32_t rank,
                                    uint64_t* checksum) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = NotNull(sim, "the simulator"); !st.ok()) return st;
    if (absl::Status st = NotNull(checksum, "checksum"); !st.ok()) return st;
    const auto& s = *sim->simulator;
    if (rank >= s.worker_count()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, " of ", s.worker_count(), " workers"));
    }
    *checksum = morse::compress::StateChecksum(
        {s.worker_x(rank), s.worker_m(rank), s.v()});
    return absl::OkStatus();
  });
}

int morse_simulator_x(morse_simulator* sim, float* x, uint64_t dim) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = NotNull(sim, "the simulator"); !st.ok()) return st;
    if (absl::Status st = NotNull(x, "x"); !st.ok()) return st;
    if (dim != sim->dim)
      return absl::InvalidArgumentError(
          absl::StrCat("x has ", dim, " floats, not ", sim->dim));
    std::copy(sim->simulator->x().begin(), sim->simulator->x().end(), x);
    return absl::OkStatus();
  });
}

int morse_simulator_replace_x(morse_simulator* sim, const float* x,
                              uint64_t dim) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = NotNull(sim, "the simulator"); !st.ok()) return st;
    if (absl::Status st = NotNull(x, "x"); !st.ok()) return st;
    return sim->simulator->ReplaceX(absl::MakeConstSpan(x, dim));
  });
}

int morse_simulator_replace_worker_x(morse_simulator* sim, uint32_t rank,
                                     const float* x, uint64_t dim) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = NotNull(sim, "the simulator"); !st.ok()) return st;
    if (absl::Status st = NotNull(x, "x"); !st.ok()) return st;
    return sim->simulator->ReplaceWorkerX(rank, absl::MakeConstSpan(x, dim));
  });
}

// ---------------------------------------------------------------- pipeline

int morse_link_listen(const char* address, const char* security,
                      morse_link** out) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    if (absl::Status s = NotNull(address, "address"); !s.ok()) return s;
    auto options = ParseSecurity(security);
    if (!options.ok()) return options.status();
    auto link = morse::worker::StageLink::Listen(address, *options);
    if (!link.ok()) return link.status();
    *out = new morse_link{*std::move(link), {}};
    return absl::OkStatus();
  });
}

int morse_link_connect(const char* address, const char* security,
                       double timeout_seconds, morse_link** out) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    if (absl::Status s = NotNull(address, "address"); !s.ok()) return s;
    auto options = ParseSecurity(security);
    if (!options.ok()) return options.status();
    auto link = morse::worker::StageLink::Connect(
        address, *options, absl::Seconds(timeout_seconds));
    if (!link.ok()) return link.status();
    *out = new morse_link{*std::move(link), {}};
    return absl::OkStatus();
  });
}

int morse_link_address(morse_link* link, char* buf, uint64_t size) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(link, "the link"); !s.ok()) return s;
    if (buf == nullptr || size == 0)
      return absl::InvalidArgumentError("buf has no room");
    const std::string& a = link->link->address();
    const size_t n = std::min<size_t>(a.size(), size - 1);
    std::memcpy(buf, a.data(), n);
    buf[n] = '\0';
    return absl::OkStatus();
  });
}

int morse_link_accept(morse_link* link, double timeout_seconds) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(link, "the link"); !s.ok()) return s;
    return link->link->Accept(absl::Seconds(timeout_seconds));
  });
}

int morse_link_send(morse_link* link, uint32_t kind, const char* meta,
                    const void* payload, uint64_t payload_size,
                    const void* extra, uint64_t extra_size, const char* error) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(link, "the link"); !s.ok()) return s;
    if ((payload == nullptr && payload_size != 0) ||
        (extra == nullptr && extra_size != 0)) {
      return absl::InvalidArgumentError("a null buffer with a non-zero size");
    }
    morse::worker::StageFrame frame;
    frame.kind = kind;
    if (meta != nullptr) frame.meta = meta;
    if (payload_size != 0)
      frame.payload.assign(static_cast<const char*>(payload), payload_size);
    if (extra_size != 0)
      frame.extra.assign(static_cast<const char*>(extra), extra_size);
    if (error != nullptr) frame.error = error;
    return link->link->Send(frame);
  });
}

int morse_link_receive(morse_link* link, double timeout_seconds, uint32_t* kind,
                       uint64_t* meta_size, uint64_t* payload_size,
                       uint64_t* extra_size, uint64_t* error_size) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(link, "the link"); !s.ok()) return s;
    auto frame = link->link->Receive(absl::Seconds(timeout_seconds));
    if (!frame.ok()) return frame.status();
    link->received = *std::move(frame);
    if (kind) *kind = link->received.kind;
    if (meta_size) *meta_size = link->received.meta.size();
    if (payload_size) *payload_size = link->received.payload.size();
    if (extra_size) *extra_size = link->received.extra.size();
    if (error_size) *error_size = link->received.error.size();
    return absl::OkStatus();
  });
}

int morse_link_frame(morse_link* link, void* meta, void* payload, void* extra,
                     void* error) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(link, "the link"); !s.ok()) return s;
    const morse::worker::StageFrame& f = link->received;
    const std::pair<void*, const std::string*> parts[] = {{meta, &f.meta},
                                                          {payload, &f.payload},
                                                          {extra, &f.extra},
                                                          {error, &f.error}};
    for (const auto& [to, from] : parts) {
      if (from->empty()) continue;
      if (to == nullptr)
        return absl::InvalidArgumentError("a null buffer for a non-empty part");
      std::memcpy(to, from->data(), from->size());
    }
    return absl::OkStatus();
  });
}

int morse_link_traffic(morse_link* link, uint64_t* bytes_sent,
                       uint64_t* bytes_received) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(link, "the link"); !s.ok()) return s;
    if (bytes_sent) *bytes_sent = link->link->bytes_sent();
    if (bytes_received) *bytes_received = link->link->bytes_received();
    return absl::OkStatus();
  });
}

void morse_link_destroy(morse_link* link) { delete link; }

int morse_boundary_create(const char* spec, morse_boundary** out) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    if (absl::Status s = NotNull(spec, "spec"); !s.ok()) return s;
    auto parsed = morse::compress::ParseBoundarySpec(spec);
    if (!parsed.ok()) return parsed.status();
    *out = new morse_boundary{
        std::make_unique<morse::compress::BoundaryCodec>(*parsed), {}};
    return absl::OkStatus();
  });
}

void morse_boundary_destroy(morse_boundary* b) { delete b; }

namespace {

// mode 1 and 2 (inference): the codec, or fp32.
morse::compress::CodecSpec InferenceCodec(const morse_boundary* b, int mode) {
  if (mode == 1) return b->codec->spec().codec;
  return morse::compress::CodecSpec{morse::compress::CodecKind::kFp32};
}

absl::Status CheckMode(int mode) {
  if (mode < 0 || mode > 2)
    return absl::InvalidArgumentError(
        absl::StrCat("mode ", mode, " is not 0, 1 or 2"));
  return absl::OkStatus();
}

}  // namespace

int morse_boundary_encode(morse_boundary* b, const float* x, uint64_t n,
                          uint64_t rows, const int64_t* samples, uint32_t slot,
                          int mode, uint64_t* size) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(b, "the boundary"); !s.ok()) return s;
    if (absl::Status s = CheckMode(mode); !s.ok()) return s;
    if (x == nullptr && n != 0) return absl::InvalidArgumentError("x is null");
    absl::Status s =
        mode == 0
            ? b->codec->Encode(absl::MakeConstSpan(x, n), rows,
                               samples ? absl::MakeConstSpan(samples, rows)
                                       : absl::Span<const int64_t>(),
                               slot, &b->payload)
            : morse::compress::BoundaryCodec::EncodeStateless(
                  InferenceCodec(b, mode), absl::MakeConstSpan(x, n),
                  &b->payload);
    if (!s.ok()) return s;
    if (size) *size = b->payload.size();
    return absl::OkStatus();
  });
}

int morse_boundary_payload(morse_boundary* b, void* out, uint64_t capacity) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(b, "the boundary"); !s.ok()) return s;
    if (capacity < b->payload.size() ||
        (out == nullptr && !b->payload.empty())) {
      return absl::InvalidArgumentError(
          absl::StrCat("the payload needs ", b->payload.size(), " bytes"));
    }
    if (!b->payload.empty())
      std::memcpy(out, b->payload.data(), b->payload.size());
    return absl::OkStatus();
  });
}

int morse_boundary_decode(morse_boundary* b, const void* payload, uint64_t size,
                          uint64_t rows, const int64_t* samples, int mode,
                          float* out, uint64_t n) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(b, "the boundary"); !s.ok()) return s;
    if (absl::Status s = CheckMode(mode); !s.ok()) return s;
    if ((payload == nullptr && size != 0) || (out == nullptr && n != 0)) {
      return absl::InvalidArgumentError("a null buffer with a non-zero size");
    }
    const absl::string_view bytes(static_cast<const char*>(payload), size);
    if (mode != 0) {
      return morse::compress::BoundaryCodec::DecodeStateless(
          InferenceCodec(b, mode), bytes, absl::MakeSpan(out, n));
    }
    return b->codec->Decode(bytes, rows,
                            samples ? absl::MakeConstSpan(samples, rows)
                                    : absl::Span<const int64_t>(),
                            absl::MakeSpan(out, n));
  });
}

int morse_boundary_save(morse_boundary* b, void* out, uint64_t capacity,
                        uint64_t* size) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(b, "the boundary"); !s.ok()) return s;
    const std::string state = b->codec->SaveState();
    if (size) *size = state.size();
    if (capacity == 0) return absl::OkStatus();
    if (out == nullptr) return absl::InvalidArgumentError("out is null");
    std::memcpy(out, state.data(), std::min<uint64_t>(capacity, state.size()));
    return absl::OkStatus();
  });
}

int morse_boundary_load(morse_boundary* b, const void* state, uint64_t size) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(b, "the boundary"); !s.ok()) return s;
    if (state == nullptr && size != 0)
      return absl::InvalidArgumentError("state is null");
    return b->codec->LoadState(
        absl::string_view(static_cast<const char*>(state), size));
  });
}

int morse_boundary_samples_seen(morse_boundary* b, uint64_t* count) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(b, "the boundary"); !s.ok()) return s;
    if (count) *count = b->codec->samples_seen();
    return absl::OkStatus();
  });
}

}  // extern "C"
