#include "proto/job_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "compress/codec.h"
#include "compress/optimizer.h"
#include "compress/replica.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "proto/morse.pb.h"

namespace morse::proto {
namespace {

// ema feedback's weight of the newest error when the config gives none
// (docs/config.md: Morse's choice, what docs/convergence.md measures).
constexpr float kDefaultEmaBeta = 0.5f;

using compress::CodecKind;
using compress::CodecSpec;
using compress::FeedbackKind;
using compress::FeedbackSpec;

absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("config field '", field, "': ", why));
}

// An optimizer's own section of the JobConfig (design.md 5, the optimizer
// seam: compress/ knows no proto, so its readers live here, one per
// section). Read into the algorithm when the job's optimizer is
// `optimizer`; refused when set for another (`set` names the field set,
// or none).
struct OptimizerSection {
  absl::string_view optimizer;  // compress::Optimizer::name()
  const char* (*set)(const v1::JobConfig& c);
  absl::Status (*read)(const v1::JobConfig& c, compress::AlgorithmConfig& a);
};

const char* LambSet(const v1::JobConfig& c) {
  if (c.has_onebit_lamb()) return "onebit_lamb";
  // (Only onebit_lamb's coefficients are per layer.)
  if (c.has_synthetic() && c.synthetic().layer_elems() > 0)
    return "synthetic.layer_elems";
  return nullptr;
}

absl::Status ReadLamb(const v1::JobConfig& c, compress::AlgorithmConfig& a) {
  const v1::OneBitLambConfig& l = c.onebit_lamb();
  if (l.has_max_coeff()) a.lamb.max_coeff = l.max_coeff();
  if (l.has_min_coeff()) a.lamb.min_coeff = l.min_coeff();
  if (l.has_coeff_beta()) a.lamb.coeff_beta = l.coeff_beta();
  if (l.has_factor_max()) a.lamb.factor_max = l.factor_max();
  if (l.has_factor_min()) a.lamb.factor_min = l.factor_min();
  if (l.has_factor_threshold()) a.lamb.factor_threshold = l.factor_threshold();
  return absl::OkStatus();
}

const char* ZeroOneSet(const v1::JobConfig& c) {
  return c.has_zero_one_adam() ? "zero_one_adam" : nullptr;
}

absl::Status ReadZeroOne(const v1::JobConfig& c, compress::AlgorithmConfig& a) {
  const v1::ZeroOneAdamConfig& z = c.zero_one_adam();
  if (z.has_var_freeze_step()) a.zero_one.var_freeze_step = z.var_freeze_step();
  if (z.has_var_update_scaler())
    a.zero_one.var_update_scaler = z.var_update_scaler();
  if (z.has_local_step_scaler())
    a.zero_one.local_step_scaler = z.local_step_scaler();
  if (z.has_local_step_clipper())
    a.zero_one.local_step_clipper = z.local_step_clipper();
  if (c.freeze_step() != 0) {
    return Invalid("freeze_step",
                   "is onebit_adam's; zero_one_adam freezes v at "
                   "zero_one_adam.var_freeze_step");
  }
  return absl::OkStatus();
}

const char* DilocoSet(const v1::JobConfig& c) {
  return c.has_diloco() ? "diloco" : nullptr;
}

absl::Status ReadDiloco(const v1::JobConfig& c, compress::AlgorithmConfig& a) {
  const v1::DilocoConfig& d = c.diloco();
  if (d.has_sync_every()) a.diloco.sync_every = d.sync_every();
  if (d.has_outer_lr()) a.diloco.outer_lr = d.outer_lr();
  if (d.has_outer_momentum()) a.diloco.outer_momentum = d.outer_momentum();
  if (d.has_nesterov()) a.diloco.nesterov = d.nesterov();
  if (d.has_fragments()) a.diloco.fragments = d.fragments();
  if (d.has_overlap_steps()) a.diloco.overlap_steps = d.overlap_steps();
  if (d.has_warmup_steps()) a.diloco.warmup_steps = d.warmup_steps();
  if (d.has_warmup_sync_every())
    a.diloco.warmup_sync_every = d.warmup_sync_every();
  a.diloco.mixing =
      d.has_mixing() ? d.mixing() : (a.diloco.overlap_steps > 0 ? 0.5f : 0.0f);
  if (c.freeze_step() != 0 || c.has_warmup_codec()) {
    return Invalid(c.freeze_step() != 0 ? "freeze_step" : "warmup_codec",
                   "is onebit_adam's; diloco has no warmup (every step is "
                   "an outer step in up_codec and down_codec)");
  }
  return absl::OkStatus();
}

constexpr OptimizerSection kOptimizerSections[] = {
    {"onebit_lamb", LambSet, ReadLamb},
    {"zero_one_adam", ZeroOneSet, ReadZeroOne},
    {"diloco", DilocoSet, ReadDiloco},
};

absl::StatusOr<CodecSpec> ToCodec(const v1::CodecConfig& c,
                                  absl::string_view field,
                                  CodecKind default_kind, uint32_t block) {
  CodecSpec spec;
  spec.block_elems = block;
  spec.kind = default_kind;
  if (!c.codec().empty()) {
    auto kind = compress::ParseCodecKind(c.codec());
    if (!kind.ok()) return Invalid(field, kind.status().message());
    spec.kind = *kind;
  }
  if (!c.scale().empty()) {
    auto scale = compress::ParseScaleKind(c.scale());
    if (!scale.ok()) return Invalid(field, scale.status().message());
    spec.scale = *scale;
  }
  spec.rounding = c.stochastic() ? compress::Rounding::kStochastic
                                 : compress::Rounding::kNearestEven;
  if (c.topk_ratio() != 0) spec.topk_ratio = c.topk_ratio();
  if (absl::Status s = compress::ValidateCodecSpec(spec); !s.ok())
    return Invalid(field, s.message());
  return spec;
}

absl::StatusOr<FeedbackSpec> ToFeedback(const v1::FeedbackConfig& f,
                                        absl::string_view field,
                                        FeedbackKind default_kind) {
  FeedbackSpec spec;
  spec.kind = default_kind;
  if (f.mode() == "none") {
    spec.kind = FeedbackKind::kNone;
  } else if (f.mode() == "ef") {
    spec.kind = FeedbackKind::kEf;
  } else if (f.mode() == "ema") {
    spec.kind = FeedbackKind::kEma;
  } else if (!f.mode().empty()) {
    return Invalid(
        field, absl::StrCat("mode '", f.mode(), "' is not none, ef or ema"));
  }
  if (spec.kind == FeedbackKind::kEma)
    spec.beta = f.has_beta() ? f.beta() : kDefaultEmaBeta;
  if (spec.kind != FeedbackKind::kEma && f.has_beta()) {
    return Invalid(field,
                   absl::StrCat("beta is the weight of ema feedback; mode '",
                                f.mode(), "' has none"));
  }
  if (f.storage() == "int8") {
    spec.storage = compress::ErrorStorage::kInt8;
  } else if (!f.storage().empty() && f.storage() != "fp32") {
    return Invalid(
        field, absl::StrCat("storage '", f.storage(), "' is not fp32 or int8"));
  }
  if (absl::Status s = compress::ValidateFeedbackSpec(spec); !s.ok())
    return Invalid(field, s.message());
  return spec;
}

absl::StatusOr<JobSpec> FromProto(const v1::JobConfig& c) {
  JobSpec job;
  job.name = c.name().empty() ? "morse" : c.name();
  compress::AlgorithmConfig& a = job.algorithm;
  if (c.workers() == 0 || c.workers() > kMaxWorkers) {
    return Invalid("workers", absl::StrCat(c.workers(), " is not in [1, ",
                                           kMaxWorkers, "]"));
  }
  if (c.shards() == 0 || c.shards() > kMaxShards) {
    return Invalid(
        "shards", absl::StrCat(c.shards(), " is not in [1, ", kMaxShards, "]"));
  }
  const bool external = c.workload_case() == v1::JobConfig::kExternal;
  if (c.steps() < 0 || (c.steps() == 0 && !external))
    return Invalid("steps", "must be positive");
  a.workers = c.workers();
  job.steps = c.steps();
  job.min_workers = c.has_min_workers() ? c.min_workers() : c.workers();
  if (job.min_workers == 0 || job.min_workers > c.workers()) {
    return Invalid("min_workers",
                   absl::StrCat(job.min_workers,
                                " is not in [1, workers = ", c.workers(), "]"));
  }

  job.local_ranks = c.local_ranks() == 0 ? 1 : c.local_ranks();
  if (uint64_t{job.local_ranks} * c.workers() > kMaxWorkers) {
    return Invalid(
        "local_ranks",
        absl::StrCat(job.local_ranks, " local ranks on each of ", c.workers(),
                     " workers are more than ", kMaxWorkers, " ranks"));
  }
  if (job.local_ranks > 1 && external) {
    return Invalid("local_ranks",
                   absl::StrCat(job.local_ranks,
                                " with an external model: the PyTorch binding "
                                "forms nodes itself (morse-run "
                                "--node-aggregation)"));
  }

  switch (c.workload_case()) {
    case v1::JobConfig::kSynthetic:
      job.workload = WorkloadKind::kSynthetic;
      job.synthetic.dim = c.synthetic().dim();
      if (c.synthetic().noise() != 0)
        job.synthetic.noise = c.synthetic().noise();
      job.synthetic.dead_every = c.synthetic().dead_every();
      if (job.synthetic.dim == 0)
        return Invalid("synthetic.dim", "must be positive");
      a.layout.dim = job.synthetic.dim;
      if (const uint64_t l = c.synthetic().layer_elems(); l > 0) {
        if (job.synthetic.dim / l > kMaxLayers) {
          return Invalid(
              "synthetic.layer_elems",
              absl::StrCat("makes more than ", kMaxLayers, " layers"));
        }
        for (uint64_t at = 0; at < job.synthetic.dim; at += l)
          a.layers.push_back(std::min(l, job.synthetic.dim - at));
      }
      break;
    case v1::JobConfig::kMlp: {
      job.workload = WorkloadKind::kMlp;
      const v1::MlpWorkload& m = c.mlp();
      job.mlp.train_path = m.train_path();
      job.mlp.test_path = m.test_path();
      if (!m.format().empty()) job.mlp.format = m.format();
      if (m.hidden_size() > 0)
        job.mlp.hidden.assign(m.hidden().begin(), m.hidden().end());
      if (m.batch_size() != 0) job.mlp.batch_size = m.batch_size();
      job.mlp.features = m.features();
      job.mlp.classes = m.classes();
      if (job.mlp.train_path.empty())
        return Invalid("mlp.train_path", "is required");
      if (job.mlp.format != "csv" && job.mlp.format != "libsvm") {
        return Invalid("mlp.format", absl::StrCat("'", job.mlp.format,
                                                  "' is not csv or libsvm"));
      }
      if (job.mlp.features == 0)
        return Invalid("mlp.features",
                       "is required (servers size the model from it)");
      if (job.mlp.classes < 2)
        return Invalid("mlp.classes", "is required and at least 2");
      for (uint32_t h : job.mlp.hidden) {
        if (h == 0) return Invalid("mlp.hidden", "widths must be positive");
      }
      a.layout.dim = MlpParameterCount(job.mlp);
      a.layers = MlpLayerSizes(job.mlp);
      break;
    }
    case v1::JobConfig::kExternal:
      job.workload = WorkloadKind::kExternal;
      job.external.dim = c.external().dim();
      job.external.shapes_fingerprint = c.external().shapes_fingerprint();
      job.external.shapes = c.external().shapes();
      job.external.generation = c.external().generation();
      a.layout.dim = job.external.dim;
      if (c.external().layers_size() > static_cast<int>(kMaxLayers)) {
        return Invalid("external.layers",
                       absl::StrCat("more than ", kMaxLayers, " layers"));
      }
      a.layers.assign(c.external().layers().begin(),
                      c.external().layers().end());
      if (c.external().groups_size() > static_cast<int>(kMaxLayers)) {
        return Invalid("external.groups",
                       absl::StrCat("more than ", kMaxLayers, " groups"));
      }
      if (c.external().groups_size() > 1) {
        uint64_t end = 0;
        for (uint64_t size : c.external().groups()) {
          if (size == 0 || size > job.external.dim - end) {
            return Invalid(
                "external.groups",
                absl::StrCat("group sizes must be positive and add up to "
                             "dim (",
                             job.external.dim, ")"));
          }
          end += size;
          if (end < job.external.dim) a.layout.cuts.push_back(end);
        }
        if (end != job.external.dim) {
          return Invalid("external.groups",
                         absl::StrCat("group sizes add up to ", end,
                                      ", not dim (", job.external.dim, ")"));
        }
      }
      break;
    default:
      return Invalid("workload",
                     "set synthetic { ... }, mlp { ... } or external { ... }");
  }

  const compress::Optimizer* optimizer = compress::FindOptimizer(
      c.optimizer().empty() ? "onebit_adam" : c.optimizer());
  if (optimizer == nullptr) {
    return Invalid("optimizer", absl::StrCat("'", c.optimizer(), "' is not ",
                                             compress::OptimizerNames()));
  }
  if (!a.layout.cuts.empty() && !optimizer->HyperByPartition()) {
    return Invalid(
        "external.groups",
        absl::StrCat(optimizer->name(),
                     " applies one lr and weight_decay to the whole model; "
                     "parameter groups with their own are for adam, "
                     "onebit_adam, zero_one_adam and onebit_lamb"));
  }
  a.optimizer = optimizer->kind();
  for (const OptimizerSection& section : kOptimizerSections) {
    if (optimizer->name() == section.optimizer) {
      if (absl::Status s = section.read(c, a); !s.ok()) return s;
    } else if (const char* field = section.set(c); field != nullptr) {
      return Invalid(field, absl::StrCat("is set but the optimizer is not ",
                                         section.optimizer));
    }
  }
  // onebit_adam and zero_one_adam compress with error feedback by default
  // and have a frozen v to mask and bound.
  const bool onebit = optimizer->FreezesVariance();

  const v1::AdamConfig& adam = c.adam();
  if (adam.has_beta1()) a.adam.beta1 = adam.beta1();
  if (adam.has_beta2()) a.adam.beta2 = adam.beta2();
  if (adam.has_eps()) a.adam.eps = adam.eps();
  a.adam.weight_decay = adam.weight_decay();
  a.bias_correction = !adam.has_bias_correction() || adam.bias_correction();
  a.mask_zero_variance = !c.has_mask_zero_variance() || c.mask_zero_variance();
  if (!onebit && c.has_mask_zero_variance() && c.mask_zero_variance()) {
    return Invalid("mask_zero_variance",
                   "only onebit_adam and zero_one_adam freeze v (DESIGN 2.1); "
                   "adam has nothing to mask");
  }
  a.bound_update = !c.has_bound_update() || c.bound_update();
  if (!onebit && c.has_bound_update() && c.bound_update()) {
    return Invalid(
        "bound_update",
        "only the frozen-variance updates of onebit_adam and zero_one_adam are "
        "bounded (DESIGN 2.1); adam's update is plain Adam");
  }
  if (absl::Status s = compress::ValidateAdamHyper(a.adam); !s.ok())
    return Invalid("adam", s.message());
  a.clip_grad_norm = c.clip_grad_norm();
  if (!(a.clip_grad_norm >= 0.0f) || !std::isfinite(a.clip_grad_norm)) {
    return Invalid("clip_grad_norm",
                   "must be finite and not negative (0: no clipping)");
  }

  const v1::LrConfig& lr = c.lr();
  if (lr.schedule().empty() || lr.schedule() == "constant") {
    a.lr.kind = compress::LrSchedule::Kind::kConstant;
  } else if (lr.schedule() == "cosine") {
    a.lr.kind = compress::LrSchedule::Kind::kCosine;
  } else {
    return Invalid("lr.schedule", absl::StrCat("'", lr.schedule(),
                                               "' is not constant or cosine"));
  }
  a.lr.base_lr = lr.lr();
  if (external && job.external.dim == 0 && lr.lr() == 0) {
    a.lr.base_lr =
        1.0f;  // a server's base config: the workers' Join brings the real one
  }
  a.lr.warmup_steps = lr.warmup_steps();
  a.lr.total_steps = c.steps();
  if (a.lr.kind == compress::LrSchedule::Kind::kCosine && c.steps() == 0) {
    return Invalid("lr.schedule", "cosine needs steps");
  }
  a.lr.min_lr = lr.min_lr();
  if (absl::Status s = compress::ValidateLrSchedule(a.lr); !s.ok())
    return Invalid("lr", s.message());

  a.freeze_step = c.freeze_step();
  // Unset: 2048, or smaller for a model too small to give every shard a
  // block of 2048 (compress::DefaultBlockElems).
  const uint32_t block = c.has_block_elems() ? c.block_elems()
                                             : compress::DefaultBlockElems(
                                                   a.layout.dim, c.shards());
  a.layout.shards = c.shards();
  a.layout.block_elems = block;
  // Unset: chosen from the model's size (DESIGN 3); a server's base config
  // for an external model, whose size comes with the first Join, takes the
  // largest that choice can be.
  a.layout.partition_elems =
      c.has_partition_elems()
          ? c.partition_elems()
          : compress::DefaultPartitionElems(a.layout.dim, c.shards(), block);
  compress::LayoutSpec probe = a.layout;
  if (probe.dim == 0)
    probe.dim = uint64_t{probe.block_elems} * probe.shards;  // size comes later
  if (absl::Status s = compress::Layout::Create(probe).status(); !s.ok()) {
    return Invalid(probe.cuts.empty() ? "block_elems/partition_elems/shards"
                                      : "block_elems/partition_elems/shards/"
                                        "external.groups",
                   s.message());
  }

  auto warmup =
      ToCodec(c.warmup_codec(), "warmup_codec", CodecKind::kFp32, block);
  if (!warmup.ok()) return warmup.status();
  a.warmup_codec = *warmup;
  auto up = ToCodec(c.up_codec(), "up_codec",
                    onebit ? CodecKind::kSign1 : CodecKind::kFp32, block);
  if (!up.ok()) return up.status();
  a.up_codec = *up;
  auto down = c.has_down_codec()
                  ? ToCodec(c.down_codec(), "down_codec", up->kind, block)
                  : up;
  if (!down.ok()) return down.status();
  a.down_codec = *down;
  const FeedbackKind default_fb =
      onebit ? FeedbackKind::kEf : FeedbackKind::kNone;
  auto wfb = ToFeedback(c.worker_feedback(), "worker_feedback", default_fb);
  if (!wfb.ok()) return wfb.status();
  a.worker_feedback = *wfb;
  auto sfb = c.has_server_feedback() ? ToFeedback(c.server_feedback(),
                                                  "server_feedback", default_fb)
                                     : wfb;
  if (!sfb.ok()) return sfb.status();
  a.server_feedback = *sfb;
  a.seed = c.seed();
  compress::AlgorithmConfig checked = a;
  checked.layout = probe;
  // freeze_step gets its own message below, after the other fields' errors.
  checked.freeze_step = std::max<int64_t>(checked.freeze_step, 1);
  if (absl::Status s = compress::ValidateAlgorithmConfig(checked); !s.ok()) {
    return Invalid("job", s.message());
  }
  // A server's base config for an external model leaves the optimizer to
  // the workers' Join.
  const bool base_only = external && job.external.dim == 0;
  const bool freezes = optimizer->HasFreezeStep();
  if (freezes && base_only && a.freeze_step == 0) a.freeze_step = 1;
  if (freezes &&
      (a.freeze_step < 1 || (c.steps() > 0 && a.freeze_step > c.steps()))) {
    return Invalid(
        "freeze_step",
        absl::StrCat(a.freeze_step,
                     " is outside [1, steps]: onebit_adam and onebit_lamb need "
                     "at least one "
                     "warmup step (with none there is no variance to freeze)"));
  }

  const v1::Timeouts& t = c.timeouts();
  if (t.has_connect_seconds())
    job.connect_timeout_seconds = t.connect_seconds();
  if (t.has_step_seconds()) job.step_timeout_seconds = t.step_seconds();
  if (t.has_rpc_seconds()) job.rpc_timeout_seconds = t.rpc_seconds();
  if (t.has_recovery_seconds())
    job.recovery_timeout_seconds = t.recovery_seconds();
  for (const auto& [name, seconds] :
       {std::pair<const char*, double>{"timeouts.connect_seconds",
                                       job.connect_timeout_seconds},
        {"timeouts.step_seconds", job.step_timeout_seconds},
        {"timeouts.rpc_seconds", job.rpc_timeout_seconds},
        {"timeouts.recovery_seconds", job.recovery_timeout_seconds}}) {
    if (!std::isfinite(seconds) || !(seconds > 0) ||
        seconds > kMaxTimeoutSeconds) {
      return Invalid(
          name,
          absl::StrCat(seconds, " is not a finite number of seconds in (0, ",
                       kMaxTimeoutSeconds, "] (a week)"));
    }
  }
  if (job.elastic() &&
      job.step_timeout_seconds >= job.recovery_timeout_seconds) {
    return Invalid(
        "timeouts.step_seconds",
        absl::StrCat(job.step_timeout_seconds,
                     " s: with min_workers below workers a step completes "
                     "without its missing workers after step_seconds, which "
                     "must be less than recovery_seconds (",
                     job.recovery_timeout_seconds, " s)"));
  }
  if (t.has_straggler_seconds()) {
    const double grace = t.straggler_seconds();
    if (!job.elastic()) {
      return Invalid("timeouts.straggler_seconds",
                     "needs min_workers below workers: a step completes "
                     "without its stragglers once min_workers have pushed");
    }
    if (!std::isfinite(grace) || !(grace > 0) ||
        grace >= job.step_timeout_seconds) {
      return Invalid("timeouts.straggler_seconds",
                     absl::StrCat(grace,
                                  " is not a number of seconds in (0, "
                                  "timeouts.step_seconds = ",
                                  job.step_timeout_seconds, ")"));
    }
    job.straggler_timeout_seconds = grace;
  }
  if (c.has_channels_per_shard())
    job.channels_per_shard = c.channels_per_shard();
  if (c.has_window()) {
    if (c.window() == 0) return Invalid("window", "must be at least 1");
    job.window = c.window();
  }
  if (c.has_uploads_per_shard()) {
    if (c.uploads_per_shard() > 1024) {
      return Invalid("uploads_per_shard", "must be in [0, 1024] (0: no limit)");
    }
    job.uploads_per_shard = c.uploads_per_shard();
  }
  if (c.has_log_every()) job.log_every = c.log_every();
  if (job.channels_per_shard == 0 || job.channels_per_shard > 64) {
    return Invalid("channels_per_shard", "must be in [1, 64]");
  }
  if (job.log_every == 0) return Invalid("log_every", "must be at least 1");
  job.checkpoint_every_steps = c.checkpoint().every_steps();
  job.checkpoint_dir = c.checkpoint().dir();
  job.replay_steps =
      c.checkpoint().has_replay_steps()
          ? c.checkpoint().replay_steps()
          : (job.checkpoint_every_steps > 0 ? job.checkpoint_every_steps + 1
                                            : 0);
  c.SerializeToString(&job.config_proto);
  return job;
}

// Text format into `config`, with every error's line and column.
absl::Status ParseText(absl::string_view text, v1::JobConfig* config) {
  struct Collector : google::protobuf::io::ErrorCollector {
    std::string errors;
    void AddError(int line, int column, const std::string& message) override {
      absl::StrAppend(&errors, "line ", line + 1, ":", column + 1, ": ",
                      message, "; ");
    }
  } collector;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&collector);
  if (!parser.ParseFromString(std::string(text), config)) {
    return absl::InvalidArgumentError(
        absl::StrCat("text config: ", collector.errors));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<uint64_t> MlpLayerSizes(const MlpSpec& mlp) {
  std::vector<uint64_t> sizes;
  uint64_t in = mlp.features;
  std::vector<uint32_t> widths = mlp.hidden;
  widths.push_back(mlp.classes);
  for (uint32_t out : widths) {
    sizes.push_back(
        in * out);  // the weights, then the biases (worker/mlp_workload.cc)
    sizes.push_back(out);
    in = out;
  }
  return sizes;
}

uint64_t MlpParameterCount(const MlpSpec& mlp) {
  uint64_t count = 0, in = mlp.features;
  std::vector<uint32_t> widths = mlp.hidden;
  widths.push_back(mlp.classes);
  for (uint32_t out : widths) {
    count += in * out + out;
    in = out;
  }
  return count;
}

absl::StatusOr<JobSpec> ParseJobConfig(absl::string_view text,
                                       ConfigFormat format) {
  v1::JobConfig config;
  if (format == ConfigFormat::kJson) {
    auto status = google::protobuf::util::JsonStringToMessage(
        google::protobuf::StringPiece(text.data(), text.size()), &config);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("JSON config: ", status.message().as_string()));
    }
  } else if (absl::Status s = ParseText(text, &config); !s.ok()) {
    return s;
  }
  return FromProto(config);
}

absl::StatusOr<JobSpec> ParseJobConfigWithOverrides(
    absl::string_view base, absl::string_view overrides) {
  v1::JobConfig config;
  for (absl::string_view text : {base, overrides}) {
    v1::JobConfig part;
    if (absl::Status s = ParseText(text, &part); !s.ok()) return s;
    config.MergeFrom(part);
  }
  return FromProto(config);
}

absl::StatusOr<JobSpec> ParseJobConfigProto(absl::string_view serialized) {
  v1::JobConfig config;
  if (!config.ParseFromArray(serialized.data(),
                             static_cast<int>(serialized.size()))) {
    return absl::InvalidArgumentError(
        "the job config in the request is not a valid JobConfig");
  }
  return FromProto(config);
}

absl::StatusOr<JobSpec> LoadJobConfig(const std::string& path) {
  // A folder opens as a file with nothing in it, which would read as a
  // config of defaults and fail later on a field the user never wrote.
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot read config file '", path, "': it is a directory"));
  }
  errno = 0;
  std::ifstream in(path);
  if (!in) {
    const int error = errno;
    return absl::Status(
        error == EACCES ? absl::StatusCode::kPermissionDenied
                        : absl::StatusCode::kNotFound,
        absl::StrCat("cannot read config file '", path, "'",
                     error != 0 ? absl::StrCat(": ", std::strerror(error))
                                : std::string()));
  }
  std::stringstream text;
  text << in.rdbuf();
  const std::string body = text.str();
  const size_t first = body.find_first_not_of(" \t\r\n");
  // An empty file (a ConfigMap's key missing, a template that rendered
  // nothing) would read as defaults and fail on `workers`.
  if (first == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file '", path,
                     "' is empty: a job's config sets at least `workers` "
                     "(deploy/configs/ has examples)"));
  }
  const bool json =
      (path.size() >= 5 && path.substr(path.size() - 5) == ".json") ||
      body[first] == '{';
  auto job =
      ParseJobConfig(body, json ? ConfigFormat::kJson : ConfigFormat::kText);
  if (!job.ok()) {
    return absl::Status(job.status().code(),
                        absl::StrCat(path, ": ", job.status().message()));
  }
  return job;
}

uint64_t HostMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

absl::Status CheckFitsInMemory(uint64_t bytes, absl::string_view what,
                               uint64_t limit) {
  if (limit == 0 || bytes <= limit) return absl::OkStatus();
  const auto gib = [](uint64_t b) {
    return static_cast<double>(b) / double(uint64_t{1} << 30);
  };
  return absl::ResourceExhaustedError(absl::StrCat(
      what, " needs ", absl::SixDigits(gib(bytes)),
      " GiB of state but this host has ", absl::SixDigits(gib(limit)),
      " GiB of memory; use more shards or a smaller model"));
}

namespace {
// Saturating a * b for sizes that may be absurd.
uint64_t Times(uint64_t a, uint64_t b) {
  if (a != 0 && b > UINT64_MAX / a) return UINT64_MAX;
  return a * b;
}
uint64_t ErrorBytesPerElement(const compress::FeedbackSpec& f) {
  if (f.kind == compress::FeedbackKind::kNone) return 0;
  return f.storage == compress::ErrorStorage::kFp32 ? 4 : 1;
}

uint64_t Plus(uint64_t a, uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

// The bytes of the payloads (up: a worker's pushes; else the replies) of
// `elems` elements kept for replay_steps steps: the job's first
// replay_steps steps, the widest window (1-bit warmup and 0/1 Adam's
// variance steps, fp32, come first; local steps send nothing). From the
// payload of 2^20 elements (scales included), rounded up; past 2^16 steps
// each further step counts at the widest codec.
uint64_t KeptPayloadBytes(const JobSpec& job, uint64_t elems, bool up) {
  constexpr uint64_t kSample = uint64_t{1} << 20;
  constexpr uint64_t kWalk = uint64_t{1} << 16;
  const uint64_t window = std::min<uint64_t>(
      job.replay_steps, static_cast<uint64_t>(std::max<int64_t>(job.steps, 0)));
  uint64_t per_sample = 0, widest = 0;
  for (uint64_t step = 0; step < std::min(window, kWalk); ++step) {
    const compress::StepPlan plan =
        compress::PlanStep(job.algorithm, static_cast<int64_t>(step));
    if (!plan.exchanges) continue;
    const uint64_t bytes =
        compress::PayloadBytes(up ? plan.up : plan.down, kSample);
    per_sample += bytes;
    widest = std::max(widest, bytes);
  }
  if (window > kWalk)
    per_sample = Plus(per_sample, Times(window - kWalk, widest));
  return Times(elems / kSample + (elems % kSample != 0 ? 1 : 0), per_sample);
}

}  // namespace

uint64_t WorkerStateBytes(const JobSpec& job) {
  // x, m, v, the gradient and the optimizer's own arrays (onebit_lamb's v');
  // a node's local ranks past the first add a gradient buffer (NodeWorkload).
  const uint64_t per = 4 * 4 + (job.local_ranks > 1 ? 4 : 0) +
                       compress::StateBytesPerElement(job.algorithm) +
                       ErrorBytesPerElement(job.algorithm.worker_feedback);
  return Plus(Times(job.algorithm.layout.dim, per),
              KeptPayloadBytes(job, job.algorithm.layout.dim, /*up=*/true));
}

uint64_t ShardStateBytes(const JobSpec& job, uint64_t shard_elems) {
  const uint64_t per = 3 * 4 + compress::StateBytesPerElement(job.algorithm) +
                       ErrorBytesPerElement(job.algorithm.server_feedback);
  return Plus(Times(shard_elems, per),
              KeptPayloadBytes(job, shard_elems, /*up=*/false));
}

}  // namespace morse::proto
