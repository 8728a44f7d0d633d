// _morse: the Python face of the worker library (worker/session.h) and of
// the simulator, for the `morse` package. Arrays cross as numpy views of the
// caller's memory (the buffer protocol), never copied; blocking calls
// release the GIL; an absl::Status error becomes morse.MorseError with the
// canonical code name in `.code`.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compress/replica.h"
#include "compress/simulator.h"
#include "proto/job_config.h"
#include "proto/security.h"
#include "worker/session.h"

namespace py = pybind11;

namespace morse::python {
namespace {

struct MorseError : std::runtime_error {
  MorseError(const absl::Status& s)
      : std::runtime_error(absl::StrCat(absl::StatusCodeToString(s.code()), ": ", s.message())) {}
};

void Check(const absl::Status& s) {
  if (!s.ok()) throw MorseError(s);
}

template <class T>
T Check(absl::StatusOr<T> s) {
  if (!s.ok()) throw MorseError(s.status());
  return *std::move(s);
}

// A float32, C-contiguous numpy array as a span over its memory.
absl::Span<float> FloatSpan(py::array array, const char* what, bool writable) {
  py::buffer_info info = array.request(writable);
  if (info.format != py::format_descriptor<float>::format()) {
    throw py::type_error(absl::StrCat(what, " must be float32"));
  }
  if (!(array.flags() & py::array::c_style)) throw py::value_error(absl::StrCat(what, " must be contiguous"));
  return {static_cast<float*>(info.ptr), static_cast<size_t>(info.size)};
}

py::array_t<float> Copy(absl::Span<const float> values) {
  py::array_t<float> out(values.size());
  std::copy(values.begin(), values.end(), out.mutable_data());
  return out;
}

proto::JobSpec Job(const std::string& base, const std::string& overrides) {
  return Check(proto::ParseJobConfigWithOverrides(base, overrides));
}

// Credentials from a dict with the keys of the worker's flags: tls_ca,
// tls_cert, tls_key, tls_server_name, token_file (paths or names), insecure
// (bool), refresh_seconds (int).
proto::SecurityOptions Security(const py::dict& d) {
  proto::SecurityOptions o;
  for (const auto& [key, value] : d) {
    const std::string k = py::str(key);
    if (k == "insecure") o.insecure = value.cast<bool>();
    else if (k == "refresh_seconds") o.refresh_seconds = value.cast<int>();
    else if (k == "tls_ca") o.tls_ca = value.cast<std::string>();
    else if (k == "tls_cert") o.tls_cert = value.cast<std::string>();
    else if (k == "tls_key") o.tls_key = value.cast<std::string>();
    else if (k == "tls_server_name") o.tls_server_name = value.cast<std::string>();
    else if (k == "token_file") o.token_file = value.cast<std::string>();
    else throw py::value_error(absl::StrCat("unknown security option '", k, "'"));
  }
  return o;
}

class PySession {
 public:
  PySession(const std::string& base, const std::string& overrides, uint32_t rank,
            std::vector<std::string> servers, py::array x, const py::dict& security)
      : x_(x) {
    const proto::JobSpec job = Job(base, overrides);
    absl::Span<float> storage = FloatSpan(x, "parameters", true);
    const proto::SecurityOptions options = Security(security);
    py::gil_scoped_release release;
    session_ = Check(worker::Session::Connect(job, rank, std::move(servers), options, storage));
  }

  int64_t Start(bool resume, const std::string& checkpoint) {
    py::gil_scoped_release release;
    return Check(session_->Start(resume, checkpoint));
  }
  void WaitAllJoined() {
    py::gil_scoped_release release;
    Check(session_->WaitAllJoined());
  }
  void Begin(py::array grad) {
    grad_ = grad;  // keep the memory alive for the step
    absl::Span<float> g = FloatSpan(grad, "gradient", false);
    Check(session_->Begin(g));
  }
  void SendPartition(uint32_t partition) {
    py::gil_scoped_release release;
    Check(session_->SendPartition(partition));
  }
  py::dict Finish() {
    worker::StepTraffic traffic;
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = session_->Finish(&traffic);
    }
    grad_ = py::none();
    Check(s);
    py::dict d;
    d["bytes_up"] = traffic.payload_up;
    d["bytes_down"] = traffic.payload_down;
    d["encode_seconds"] = traffic.encode_seconds;
    d["apply_seconds"] = traffic.apply_seconds;
    d["retries"] = traffic.retries;
    return d;
  }
  py::dict Step(py::array grad) {
    Begin(grad);
    return Finish();
  }
  std::vector<std::pair<uint64_t, uint64_t>> Partitions() const {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (const auto& p : session_->layout().partitions()) out.emplace_back(p.range.begin, p.range.end);
    return out;
  }
  int64_t step() const { return session_->step(); }
  std::string checksum() const { return absl::StrCat(absl::Hex(session_->replica().Checksum(), absl::kZeroPad16)); }
  py::tuple GetState() const {
    std::vector<float> error(session_->replica().m().size());
    session_->error().Read(0, absl::MakeSpan(error));
    return py::make_tuple(session_->step(), Copy(session_->replica().m()), Copy(session_->replica().v()),
                          Copy(error));
  }
  void SetState(int64_t step, py::array m, py::array v, py::array error) {
    Check(session_->Restore(step, FloatSpan(m, "m", false), FloatSpan(v, "v", false),
                            FloatSpan(error, "error", false)));
  }
  void SaveCheckpoint(const std::string& path) const { Check(session_->SaveCheckpoint(path)); }

 private:
  py::array x_;  // the parameters' memory, kept alive
  py::object grad_ = py::none();
  std::unique_ptr<worker::Session> session_;
};

class PySimulator {
 public:
  PySimulator(const std::string& base, const std::string& overrides, py::array x0) {
    const proto::JobSpec job = Job(base, overrides);
    simulator_ = std::make_unique<compress::Simulator>(
        Check(compress::Simulator::Create(job.algorithm, FloatSpan(x0, "x0", false))));
  }
  void Step(std::vector<py::array> gradients) {
    std::vector<absl::Span<const float>> views;
    for (auto& g : gradients) views.push_back(FloatSpan(g, "gradient", false));
    Check(simulator_->Step(views));
  }
  std::string checksum() const {
    return absl::StrCat(absl::Hex(compress::StateChecksum({simulator_->x(), simulator_->m(), simulator_->v()}),
                                  absl::kZeroPad16));
  }
  py::array_t<float> x() const { return Copy(simulator_->x()); }

 private:
  std::unique_ptr<compress::Simulator> simulator_;
};

}  // namespace

PYBIND11_MODULE(_morse, m) {
  m.doc() = "Morse worker library (see the morse package)";
  static py::exception<MorseError> error(m, "MorseError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const MorseError& e) {
      error(e.what());
    }
  });
  py::class_<PySession>(m, "Session")
      .def(py::init<const std::string&, const std::string&, uint32_t, std::vector<std::string>, py::array,
                    const py::dict&>(),
           py::arg("base_config"), py::arg("overrides"), py::arg("rank"), py::arg("servers"), py::arg("x"),
           py::arg("security"))
      .def("start", &PySession::Start, py::arg("resume") = false, py::arg("checkpoint") = "")
      .def("wait_all_joined", &PySession::WaitAllJoined)
      .def("begin", &PySession::Begin)
      .def("send_partition", &PySession::SendPartition)
      .def("finish", &PySession::Finish)
      .def("step", &PySession::Step)
      .def("partitions", &PySession::Partitions)
      .def_property_readonly("step_index", &PySession::step)
      .def("checksum", &PySession::checksum)
      .def("get_state", &PySession::GetState)
      .def("set_state", &PySession::SetState)
      .def("save_checkpoint", &PySession::SaveCheckpoint);
  py::class_<PySimulator>(m, "Simulator")
      .def(py::init<const std::string&, const std::string&, py::array>())
      .def("step", &PySimulator::Step)
      .def("checksum", &PySimulator::checksum)
      .def("x", &PySimulator::x);
}

}  // namespace morse::python
