#include "compress/boundary.h"

#include <cmath>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace morse::compress {
namespace {

constexpr char kStateMagic[] = "MBND1";

bool AllFinite(absl::Span<const float> v) {
  for (float f : v) {
    if (!std::isfinite(f)) return false;
  }
  return true;
}

template <class T>
void Put(std::string* out, const T& value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(T));
}

void PutFloats(std::string* out, const std::vector<float>& v) {
  Put<uint64_t>(out, v.size());
  out->append(reinterpret_cast<const char*>(v.data()),
              v.size() * sizeof(float));
}

// Reads a state written by SaveState, front to back.
class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  template <class T>
  bool Get(T* value) {
    if (in_.size() < sizeof(T)) return false;
    std::memcpy(value, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return true;
  }
  bool GetFloats(std::vector<float>* v) {
    uint64_t n = 0;
    if (!Get(&n) || n > in_.size() / sizeof(float)) return false;
    v->resize(n);
    std::memcpy(v->data(), in_.data(), n * sizeof(float));
    in_.remove_prefix(n * sizeof(float));
    return true;
  }
  bool GetString(std::string* s) {
    uint32_t n = 0;
    if (!Get(&n) || n > in_.size()) return false;
    s->assign(in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }
  bool done() const { return in_.empty(); }

 private:
  absl::string_view in_;
};

}  // namespace

absl::StatusOr<BoundarySpec> ParseBoundarySpec(absl::string_view text) {
  BoundarySpec spec;
  absl::string_view rest = text;
  const size_t plus = rest.find('+');
  if (plus != absl::string_view::npos) {
    const absl::string_view feedback = rest.substr(plus + 1);
    if (feedback == "ef") {
      spec.feedback = BoundaryFeedback::kEf;
    } else if (feedback == "aq") {
      spec.feedback = BoundaryFeedback::kAqSgd;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("boundary '", text, "': unknown feedback '", feedback,
                       "'; expected ef or aq"));
    }
    rest = rest.substr(0, plus);
  }
  const size_t slash = rest.find('/');
  if (slash != absl::string_view::npos) {
    if (!absl::SimpleAtoi(rest.substr(slash + 1), &spec.codec.block_elems)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "boundary '", text, "': the block after '/' is not a number"));
    }
    rest = rest.substr(0, slash);
  }
  const size_t colon = rest.find(':');
  absl::string_view name = rest.substr(0, colon);
  auto kind = ParseCodecKind(name);
  if (!kind.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("boundary '", text, "': ", kind.status().message()));
  }
  if (*kind == CodecKind::kSign1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "boundary '", text,
        "': sign1 is for optimizer state; a boundary takes fp32, fp16, bf16, "
        "int8, int4 or topk:RATIO"));
  }
  spec.codec.kind = *kind;
  if (*kind == CodecKind::kTopK) {
    if (colon == absl::string_view::npos ||
        !absl::SimpleAtod(rest.substr(colon + 1), &spec.codec.topk_ratio)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "boundary '", text, "': topk needs its ratio, e.g. topk:0.1"));
    }
  } else if (colon != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("boundary '", text, "': only topk takes ':RATIO'"));
  }
  if (absl::Status s = ValidateCodecSpec(spec.codec); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("boundary '", text, "': ", s.message()));
  }
  return spec;
}

std::string BoundarySpecName(const BoundarySpec& spec) {
  std::string name(CodecName(spec.codec.kind));
  if (spec.codec.kind == CodecKind::kTopK)
    absl::StrAppend(&name, ":", spec.codec.topk_ratio);
  if (spec.codec.block_elems != kDefaultBlockElems)
    absl::StrAppend(&name, "/", spec.codec.block_elems);
  if (spec.feedback == BoundaryFeedback::kEf) absl::StrAppend(&name, "+ef");
  if (spec.feedback == BoundaryFeedback::kAqSgd) absl::StrAppend(&name, "+aq");
  return name;
}

size_t BoundaryPayloadBytes(const BoundarySpec& spec, size_t rows, size_t cols,
                            size_t fresh) {
  if (spec.feedback != BoundaryFeedback::kAqSgd)
    return PayloadBytes(spec.codec, rows * cols);
  const size_t stale = (rows - fresh) * cols;
  return rows + fresh * cols * sizeof(float) +
         (stale == 0 ? 0 : PayloadBytes(spec.codec, stale));
}

absl::Status BoundaryCodec::CheckShape(
    absl::Span<const float> x, size_t rows,
    absl::Span<const int64_t> samples) const {
  if (rows == 0 || x.size() % rows != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a boundary tensor of ", x.size(), " values cannot have ",
                     rows, " rows"));
  }
  if (spec_.feedback != BoundaryFeedback::kAqSgd) return absl::OkStatus();
  if (samples.size() != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("AQ-SGD needs one sample index per row: ", rows, " rows, ",
                     samples.size(), " indices"));
  }
  std::set<int64_t> unique(samples.begin(), samples.end());
  if (unique.size() != rows) {
    return absl::InvalidArgumentError(
        "AQ-SGD: a sample index appears twice in one micro-batch");
  }
  const size_t cols = x.size() / rows;
  if (aq_cols_ != 0 && cols != aq_cols_) {
    return absl::InvalidArgumentError(
        absl::StrCat("AQ-SGD: rows of ", cols,
                     " values where this boundary's buffers hold ", aq_cols_));
  }
  return absl::OkStatus();
}

absl::Status BoundaryCodec::Encode(absl::Span<const float> x, size_t rows,
                                   absl::Span<const int64_t> samples,
                                   uint32_t slot, std::string* payload) {
  if (absl::Status s = CheckShape(x, rows, samples); !s.ok()) return s;
  const RoundingKey key;
  switch (spec_.feedback) {
    case BoundaryFeedback::kNone:
      return EncodeStateless(spec_.codec, x, payload);
    case BoundaryFeedback::kEf: {
      std::vector<float> error(x.size(), 0.0f);
      auto it = errors_.find(slot);
      if (it != errors_.end() && it->second.size() == x.size())
        error = it->second;
      payload->assign(PayloadBytes(spec_.codec, x.size()), '\0');
      absl::Status s = EncodeWithError(
          spec_.codec, x, absl::MakeSpan(error),
          FeedbackArgs{FeedbackKind::kEf, 1.0f}, key,
          absl::MakeSpan(reinterpret_cast<uint8_t*>(payload->data()),
                         payload->size()));
      if (!s.ok()) return s;
      errors_[slot] = std::move(error);
      return absl::OkStatus();
    }
    case BoundaryFeedback::kAqSgd:
      break;
  }
  // AQ-SGD.
  if (!AllFinite(x))
    return absl::InvalidArgumentError("AQ-SGD: a non-finite activation");
  const size_t cols = x.size() / rows;
  std::vector<uint8_t> fresh(rows);
  size_t fresh_count = 0;
  std::vector<float> delta;
  for (size_t r = 0; r < rows; ++r) {
    auto it = aq_.find(samples[r]);
    fresh[r] = it == aq_.end();
    fresh_count += fresh[r];
    if (fresh[r]) continue;
    for (size_t c = 0; c < cols; ++c)
      delta.push_back(x[r * cols + c] - it->second[c]);
  }
  payload->clear();
  payload->append(reinterpret_cast<const char*>(fresh.data()), rows);
  for (size_t r = 0; r < rows; ++r) {
    if (fresh[r])
      payload->append(reinterpret_cast<const char*>(&x[r * cols]),
                      cols * sizeof(float));
  }
  std::vector<float> change(delta.size());
  if (!delta.empty()) {
    const size_t at = payload->size();
    payload->resize(at + PayloadBytes(spec_.codec, delta.size()));
    auto part = absl::MakeSpan(reinterpret_cast<uint8_t*>(payload->data()) + at,
                               payload->size() - at);
    if (absl::Status s = compress::Encode(spec_.codec, delta, key, part);
        !s.ok())
      return s;
    // The sender adds what the receiver will decode, not what it meant to send.
    if (absl::Status s =
            compress::Decode(spec_.codec, part, absl::MakeSpan(change));
        !s.ok())
      return s;
  }
  aq_cols_ = cols;
  size_t k = 0;
  for (size_t r = 0; r < rows; ++r) {
    std::vector<float>& b = aq_[samples[r]];
    if (fresh[r]) {
      b.assign(x.begin() + r * cols, x.begin() + (r + 1) * cols);
      continue;
    }
    for (size_t c = 0; c < cols; ++c) b[c] += change[k++];
  }
  return absl::OkStatus();
}

absl::Status BoundaryCodec::Decode(absl::string_view payload, size_t rows,
                                   absl::Span<const int64_t> samples,
                                   absl::Span<float> out) {
  if (absl::Status s = CheckShape(out, rows, samples); !s.ok()) return s;
  if (spec_.feedback != BoundaryFeedback::kAqSgd)
    return DecodeStateless(spec_.codec, payload, out);
  const size_t cols = out.size() / rows;
  if (payload.size() < rows)
    return absl::InvalidArgumentError(
        "AQ-SGD: payload shorter than its row flags");
  size_t fresh_count = 0;
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t flag = static_cast<uint8_t>(payload[r]);
    if (flag > 1)
      return absl::InvalidArgumentError(
          "AQ-SGD: a row flag is neither 0 nor 1");
    const bool seen = aq_.count(samples[r]) != 0;
    if (flag == seen) {
      return absl::FailedPreconditionError(absl::StrCat(
          "AQ-SGD: the sender ", flag ? "has no" : "has a",
          " buffer for sample ", samples[r], " and this end ",
          seen ? "has one" : "has none",
          "; the two ends' buffers are out of step "
          "(restore both stages from the same step's checkpoints)"));
    }
    fresh_count += flag;
  }
  const size_t want = BoundaryPayloadBytes(spec_, rows, cols, fresh_count);
  if (payload.size() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("AQ-SGD: payload of ", payload.size(), " bytes where ",
                     want, " were expected"));
  }
  std::vector<float> full(fresh_count * cols);
  if (!full.empty())
    std::memcpy(full.data(), payload.data() + rows,
                full.size() * sizeof(float));
  if (!AllFinite(full))
    return absl::InvalidArgumentError("AQ-SGD: a non-finite activation");
  std::vector<float> change((rows - fresh_count) * cols);
  if (!change.empty()) {
    const absl::string_view part =
        payload.substr(rows + full.size() * sizeof(float));
    absl::Status s = compress::Decode(
        spec_.codec,
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(part.data()),
                            part.size()),
        absl::MakeSpan(change));
    if (!s.ok()) return s;
  }
  aq_cols_ = cols;
  size_t f = 0, k = 0;
  for (size_t r = 0; r < rows; ++r) {
    std::vector<float>& b = aq_[samples[r]];
    if (payload[r]) {
      b.assign(full.begin() + f * cols, full.begin() + (f + 1) * cols);
      ++f;
    } else {
      for (size_t c = 0; c < cols; ++c) b[c] += change[k++];
    }
    std::memcpy(&out[r * cols], b.data(), cols * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status BoundaryCodec::EncodeStateless(const CodecSpec& codec,
                                            absl::Span<const float> x,
                                            std::string* payload) {
  payload->assign(PayloadBytes(codec, x.size()), '\0');
  if (codec.kind == CodecKind::kFp32 && !AllFinite(x)) {
    return absl::InvalidArgumentError(
        "a non-finite value in a boundary tensor");
  }
  return compress::Encode(
      codec, x, RoundingKey{},
      absl::MakeSpan(reinterpret_cast<uint8_t*>(payload->data()),
                     payload->size()));
}

absl::Status BoundaryCodec::DecodeStateless(const CodecSpec& codec,
                                            absl::string_view payload,
                                            absl::Span<float> out) {
  return compress::Decode(
      codec,
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()),
                          payload.size()),
      out);
}

const std::vector<float>* BoundaryCodec::SampleBuffer(int64_t sample) const {
  auto it = aq_.find(sample);
  return it == aq_.end() ? nullptr : &it->second;
}

const std::vector<float>* BoundaryCodec::SlotError(uint32_t slot) const {
  auto it = errors_.find(slot);
  return it == errors_.end() ? nullptr : &it->second;
}

std::string BoundaryCodec::SaveState() const {
  std::string out(kStateMagic);
  const std::string name = BoundarySpecName(spec_);
  Put<uint32_t>(&out, name.size());
  out += name;
  Put<uint64_t>(&out, errors_.size());
  for (const auto& [slot, e] : errors_) {
    Put<uint32_t>(&out, slot);
    PutFloats(&out, e);
  }
  Put<uint64_t>(&out, aq_cols_);
  Put<uint64_t>(&out, aq_.size());
  for (const auto& [sample, b] : aq_) {
    Put<int64_t>(&out, sample);
    PutFloats(&out, b);
  }
  return out;
}

absl::Status BoundaryCodec::LoadState(absl::string_view state) {
  if (state.substr(0, sizeof(kStateMagic) - 1) != kStateMagic) {
    return absl::DataLossError("not a boundary state (bad magic)");
  }
  Reader in(state.substr(sizeof(kStateMagic) - 1));
  std::string name;
  if (!in.GetString(&name))
    return absl::DataLossError("boundary state truncated");
  if (name != BoundarySpecName(spec_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("boundary state saved for '", name, "', loaded into '",
                     BoundarySpecName(spec_), "'"));
  }
  std::map<uint32_t, std::vector<float>> errors;
  std::map<int64_t, std::vector<float>> aq;
  uint64_t count = 0, cols = 0;
  if (!in.Get(&count)) return absl::DataLossError("boundary state truncated");
  for (uint64_t i = 0; i < count; ++i) {
    uint32_t slot = 0;
    std::vector<float> e;
    if (!in.Get(&slot) || !in.GetFloats(&e))
      return absl::DataLossError("boundary state truncated");
    if (!AllFinite(e))
      return absl::DataLossError("boundary state: a non-finite error value");
    errors[slot] = std::move(e);
  }
  if (!in.Get(&cols) || !in.Get(&count))
    return absl::DataLossError("boundary state truncated");
  for (uint64_t i = 0; i < count; ++i) {
    int64_t sample = 0;
    std::vector<float> b;
    if (!in.Get(&sample) || !in.GetFloats(&b))
      return absl::DataLossError("boundary state truncated");
    if (b.size() != cols || !AllFinite(b)) {
      return absl::DataLossError(absl::StrCat("boundary state: sample ", sample,
                                              "'s buffer is malformed"));
    }
    aq[sample] = std::move(b);
  }
  if (!in.done())
    return absl::DataLossError("boundary state: bytes after its end");
  errors_ = std::move(errors);
  aq_ = std::move(aq);
  aq_cols_ = cols;
  return absl::OkStatus();
}

}  // namespace morse::compress
