// libmorse: worker/session.h and compress/simulator.h behind the C ABI of
// capi.h. Each function turns an absl::Status into its canonical code and
// keeps the message for morse_last_error(); no C++ exception crosses.
#include "worker/python/capi.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "proto/job_config.h"
#include "proto/security.h"
#include "proto/wire.h"
#include "worker/engine/engine.h"
#include "worker/session.h"

struct morse_session {
  std::unique_ptr<morse::worker::Session> session;
  uint64_t dim = 0;
};

struct morse_simulator {
  std::unique_ptr<morse::compress::Simulator> simulator;
  uint64_t dim = 0;
};

namespace {

thread_local std::string last_error;

int Fail(const absl::Status& s) {
  last_error = absl::StrCat(absl::StatusCodeToString(s.code()), ": ", s.message());
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
    return Fail(absl::InternalError(absl::StrCat("unexpected exception: ", e.what())));
  }
}

absl::Status NotNull(const void* p, const char* what) {
  if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, " is null"));
  return absl::OkStatus();
}

absl::StatusOr<morse::proto::SecurityOptions> ParseSecurity(const char* text) {
  morse::proto::SecurityOptions o;
  if (text == nullptr) return o;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipWhitespace())) {
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("security option '", line, "' is not key=value"));
    }
    const absl::string_view key = absl::StripAsciiWhitespace(line.substr(0, eq));
    const std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
    if (key == "insecure") {
      o.insecure = value == "1" || value == "true" || value == "True";
    } else if (key == "refresh_seconds") {
      if (!absl::SimpleAtoi(value, &o.refresh_seconds) || o.refresh_seconds <= 0) {
        return absl::InvalidArgumentError(absl::StrCat("refresh_seconds must be a positive integer, not '",
                                                       value, "'"));
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
      return absl::InvalidArgumentError(absl::StrCat("unknown security option '", key, "'"));
    }
  }
  return o;
}

absl::Status CheckSession(morse_session* s) { return NotNull(s, "the session"); }

}  // namespace

extern "C" {

int morse_capi_version(void) { return MORSE_CAPI_VERSION; }

// Before any gRPC object of this library exists (see TuneGrpcForReconnects;
// a process that initialized gRPC earlier keeps its own setting).
__attribute__((constructor)) static void MorseTuneGrpc() { morse::proto::TuneGrpcForReconnects(); }

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

int morse_session_create(const char* base, const char* overrides, uint32_t rank, const char* servers,
                         float* x, uint64_t dim, const char* security, morse_session** out) {
  return Guard([&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    if (absl::Status s = NotNull(x, "x"); !s.ok()) return s;
    if (absl::Status s = NotNull(servers, "servers"); !s.ok()) return s;
    auto job = morse::proto::ParseJobConfigWithOverrides(base ? base : "", overrides ? overrides : "");
    if (!job.ok()) return job.status();
    auto options = ParseSecurity(security);
    if (!options.ok()) return options.status();
    std::vector<std::string> addresses = absl::StrSplit(servers, ',', absl::SkipEmpty());
    auto session = morse::worker::Session::Connect(*job, rank, std::move(addresses), *options,
                                                   absl::MakeSpan(x, dim));
    if (!session.ok()) return session.status();
    *out = new morse_session{*std::move(session), dim};
    return absl::OkStatus();
  });
}

void morse_session_destroy(morse_session* s) { delete s; }

int morse_session_start(morse_session* s, int resume, const char* checkpoint, int64_t* first_step) {
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

int morse_session_use_cuda(morse_session* s, float* x_device, float* grad_device) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(x_device, "x_device"); !st.ok()) return st;
    if (absl::Status st = NotNull(grad_device, "grad_device"); !st.ok()) return st;
    if (s->session->engine().kind() != "cpu") {
      return absl::FailedPreconditionError("the session already uses a GPU");
    }
    return s->session->MoveTo("cuda", {x_device, grad_device});
  });
}

int morse_session_set_step_hyper(morse_session* s, int set, float lr, float weight_decay) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (set == 0) return s->session->SetStepHyper(std::nullopt);
    return s->session->SetStepHyper(morse::compress::StepHyper{lr, weight_decay});
  });
}

int morse_session_set_buffers(morse_session* s, const void* data, uint64_t size) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (size > 0) {
      if (absl::Status st = NotNull(data, "data"); !st.ok()) return st;
    }
    if (size > morse::proto::kMaxBufferBytes) {
      return absl::InvalidArgumentError(absl::StrCat("module buffers of ", size, " bytes; at most ",
                                                     morse::proto::kMaxBufferBytes));
    }
    s->session->SetStepBuffers(std::string(static_cast<const char*>(data), size));
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

int morse_session_received_buffers(morse_session* s, void* out, uint64_t capacity, uint64_t* size) {
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

int morse_session_send_partition(morse_session* s, uint32_t partition) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    return s->session->SendPartition(partition);
  });
}

int morse_session_send_partition_on_stream(morse_session* s, uint32_t partition, void* stream) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (s->session->engine().kind() == "cpu") {
      return absl::FailedPreconditionError("the session keeps its model on the host (morse_session_use_cuda)");
    }
    if (absl::Status st = s->session->engine().WaitFor(stream); !st.ok()) return st;
    return s->session->SendPartition(partition);
  });
}

int morse_session_finish(morse_session* s, morse_step_traffic* traffic) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    morse::worker::StepTraffic t;
    absl::Status st = s->session->Finish(&t);
    if (traffic != nullptr) {
      *traffic = {t.payload_up, t.payload_down, t.encode_seconds, t.apply_seconds,
                  static_cast<uint64_t>(t.retries)};
    }
    return st;
  });
}

int morse_session_partitions(morse_session* s, uint64_t* ranges, uint64_t capacity, uint64_t* count) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    const auto& partitions = s->session->layout().partitions();
    if (count != nullptr) *count = partitions.size();
    if (capacity > 0 && ranges == nullptr) return absl::InvalidArgumentError("ranges is null");
    for (uint64_t i = 0; i < std::min<uint64_t>(capacity, partitions.size()); ++i) {
      ranges[2 * i] = partitions[i].range.begin;
      ranges[2 * i + 1] = partitions[i].range.end;
    }
    return absl::OkStatus();
  });
}

int64_t morse_session_step(morse_session* s) { return s == nullptr ? -1 : s->session->step(); }

int morse_session_checksum(morse_session* s, uint64_t* checksum) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    if (absl::Status st = NotNull(checksum, "checksum"); !st.ok()) return st;
    if (absl::Status st = s->session->SyncHost(); !st.ok()) return st;
    *checksum = s->session->replica().Checksum();
    return absl::OkStatus();
  });
}

int morse_session_get_state(morse_session* s, int64_t* step, float* m, float* v, float* error) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    for (const void* p : {static_cast<const void*>(step), static_cast<const void*>(m),
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

int morse_session_set_state(morse_session* s, int64_t step, const float* m, const float* v,
                            const float* error, const float* server_error) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = CheckSession(s); !st.ok()) return st;
    for (const void* p : {static_cast<const void*>(m), static_cast<const void*>(v),
                          static_cast<const void*>(error)}) {
      if (absl::Status st = NotNull(p, "a state array"); !st.ok()) return st;
    }
    return s->session->Restore(
        step, absl::MakeConstSpan(m, s->dim), absl::MakeConstSpan(v, s->dim),
        absl::MakeConstSpan(error, s->dim),
        server_error == nullptr ? absl::Span<const float>() : absl::MakeConstSpan(server_error, s->dim));
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

int morse_simulator_create(const char* base, const char* overrides, const float* x0, uint64_t dim,
                           morse_simulator** out) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = NotNull(out, "out"); !st.ok()) return st;
    if (absl::Status st = NotNull(x0, "x0"); !st.ok()) return st;
    auto job = morse::proto::ParseJobConfigWithOverrides(base ? base : "", overrides ? overrides : "");
    if (!job.ok()) return job.status();
    auto simulator = morse::compress::Simulator::Create(job->algorithm, absl::MakeConstSpan(x0, dim));
    if (!simulator.ok()) return simulator.status();
    *out = new morse_simulator{std::make_unique<morse::compress::Simulator>(*std::move(simulator)), dim};
    return absl::OkStatus();
  });
}

void morse_simulator_destroy(morse_simulator* sim) { delete sim; }

int morse_simulator_step(morse_simulator* sim, const float* const* gradients, uint32_t workers, uint64_t dim) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = NotNull(sim, "the simulator"); !st.ok()) return st;
    if (absl::Status st = NotNull(gradients, "gradients"); !st.ok()) return st;
    std::vector<absl::Span<const float>> views;
    for (uint32_t w = 0; w < workers; ++w) {
      if (absl::Status st = NotNull(gradients[w], "a gradient"); !st.ok()) return st;
      views.push_back(absl::MakeConstSpan(gradients[w], dim));
    }
    return sim->simulator->Step(views);
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

int morse_simulator_worker_checksum(morse_simulator* sim, uint32_t rank, uint64_t* checksum) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = NotNull(sim, "the simulator"); !st.ok()) return st;
    if (absl::Status st = NotNull(checksum, "checksum"); !st.ok()) return st;
    const auto& s = *sim->simulator;
    if (rank >= s.worker_count()) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of ", s.worker_count(), " workers"));
    }
    *checksum = morse::compress::StateChecksum({s.worker_x(rank), s.worker_m(rank), s.v()});
    return absl::OkStatus();
  });
}

int morse_simulator_x(morse_simulator* sim, float* x, uint64_t dim) {
  return Guard([&]() -> absl::Status {
    if (absl::Status st = NotNull(sim, "the simulator"); !st.ok()) return st;
    if (absl::Status st = NotNull(x, "x"); !st.ok()) return st;
    if (dim != sim->dim) return absl::InvalidArgumentError(absl::StrCat("x has ", dim, " floats, not ", sim->dim));
    std::copy(sim->simulator->x().begin(), sim->simulator->x().end(), x);
    return absl::OkStatus();
  });
}

}  // extern "C"
