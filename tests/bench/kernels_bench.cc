// GPU kernel bandwidth next to the device's copy bandwidth, measured in the
// same run (issue 4's benchmark):
//   build/tests/bench/kernels_bench [--mib 256] [--repeats 20]
// For each kernel: the bytes it must read and write per call (inputs read
// once, outputs written once), the best time over the repeats, the effective
// bandwidth and its ratio to a device-to-device copy of the same size
// (copy bandwidth counts the bytes read and written). Target (issue 4):
// >= 0.8 for sign1 encode and decode at >= 64 MiB. Without a GPU it says so
// and exits 0.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "compress/codec.h"
#include "kernels/codecs.h"
#include "kernels/device.h"

namespace {

using namespace morse;

double BestSeconds(kernels::Context& ctx, int repeats,
                   const std::function<absl::Status()>& run) {
  double best = 1e30;
  for (int i = 0; i < repeats + 1; ++i) {  // the first run warms up
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = run();
    if (s.ok()) s = ctx.Synchronize();
    if (!s.ok()) {
      std::fprintf(stderr, "kernels_bench: %s\n",
                   std::string(s.message()).c_str());
      std::exit(1);
    }
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    if (i > 0 && t < best) best = t;
  }
  return best;
}

kernels::DeviceBuffer Buffer(size_t bytes, uint8_t fill) {
  auto b = kernels::DeviceBuffer::Allocate(bytes);
  if (!b.ok() || !b->Fill(fill).ok()) {
    std::fprintf(
        stderr, "kernels_bench: cannot allocate %zu bytes on the GPU\n", bytes);
    std::exit(1);
  }
  return *std::move(b);
}

}  // namespace

int main(int argc, char** argv) {
  size_t mib = 256;
  int repeats = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--mib") == 0)
      mib = std::strtoull(argv[i + 1], nullptr, 10);
    if (std::strcmp(argv[i], "--repeats") == 0)
      repeats = std::atoi(argv[i + 1]);
  }
  auto device = kernels::DeviceDescription();
  if (!device.ok()) {
    std::printf(
        "kernels_bench: no GPU here (%s); nothing measured (exit 77: "
        "skipped)\n",
        std::string(device.status().message()).c_str());
    return 77;
  }
  auto ctx_or = kernels::Context::Create();
  if (!ctx_or.ok()) return 1;
  kernels::Context& ctx = **ctx_or;
  const size_t n = mib * (size_t{1} << 20) / 4;
  // Small positive values (0x3c: ~0.01), so no scale overflows.
  kernels::DeviceBuffer x = Buffer(4 * n, 0x3c), e = Buffer(4 * n, 0),
                        m = Buffer(4 * n, 0x3c), v = Buffer(4 * n, 0x3c),
                        g = Buffer(4 * n, 0x3c), out = Buffer(4 * n, 0);
  compress::CodecSpec sign1;
  sign1.kind = compress::CodecKind::kSign1;
  sign1.block_elems = 2048;
  compress::CodecSpec int4 = sign1;
  int4.kind = compress::CodecKind::kInt4;
  int4.rounding = compress::Rounding::kStochastic;
  kernels::DeviceBuffer payload = Buffer(compress::PayloadBytes(int4, n), 0);
  compress::AdamScalars adam;

  const double copy = BestSeconds(
      ctx, repeats, [&] { return ctx.Copy(out.data(), x.data(), 4 * n); });
  const double copy_bw = 8.0 * n / copy;
  std::printf("GPU: %s; %zu MiB per array (%zu floats), best of %d\n",
              device->c_str(), mib, n, repeats);
  std::printf("%-34s %12s %10s %10s %8s\n", "kernel", "bytes", "ms", "GB/s",
              "of copy");
  std::printf("%-34s %12zu %10.3f %10.1f %8.2f\n", "device-to-device copy",
              8 * n, copy * 1e3, copy_bw / 1e9, 1.0);
  const auto row = [&](const char* name, double bytes,
                       const std::function<absl::Status()>& run) {
    const double t = BestSeconds(ctx, repeats, run);
    std::printf("%-34s %12.0f %10.3f %10.1f %8.2f\n", name, bytes, t * 1e3,
                bytes / t / 1e9, bytes / t / copy_bw);
  };
  const double sign1_payload = n / 8.0 + 4.0 * n / sign1.block_elems;
  row("sign1 encode + ef (l2)", 12.0 * n + sign1_payload, [&] {
    return kernels::EncodeWithError(ctx, sign1, x.as<float>(), e.as<float>(), n,
                                    {compress::FeedbackKind::kEf, 1.0f}, {},
                                    payload.as<uint8_t>());
  });
  row("sign1 encode + ef + momentum (fused)", 16.0 * n + sign1_payload, [&] {
    return kernels::EncodeWithError(ctx, sign1, g.as<float>(), e.as<float>(), n,
                                    {compress::FeedbackKind::kEf, 1.0f}, {},
                                    payload.as<uint8_t>(), nullptr,
                                    m.as<float>(), 0.9f, out.as<float>());
  });
  row("sign1 decode", 4.0 * n + sign1_payload, [&] {
    return kernels::Decode(ctx, sign1, payload.as<uint8_t>(), n,
                           out.as<float>());
  });
  row("sign1 decode + frozen update", 16.0 * n + sign1_payload, [&] {
    return kernels::DecodeFrozenUpdate(ctx, sign1, payload.as<uint8_t>(), n,
                                       adam, /*mask=*/true, x.as<float>(),
                                       m.as<float>(), v.as<float>());
  });
  row("int4 encode + ema (stochastic)",
      12.0 * n + n / 2.0 + 4.0 * n / int4.block_elems, [&] {
        return kernels::EncodeWithError(ctx, int4, x.as<float>(), e.as<float>(),
                                        n, {compress::FeedbackKind::kEma, 0.1f},
                                        {7, 1, 0, 0}, payload.as<uint8_t>());
      });
  row("adam update", 28.0 * n, [&] {
    return kernels::AdamUpdate(ctx, adam, g.as<float>(), x.as<float>(),
                               m.as<float>(), v.as<float>(), n);
  });
  row("momentum", 12.0 * n, [&] {
    return kernels::Momentum(ctx, 0.9f, m.as<float>(), g.as<float>(),
                             out.as<float>(), n);
  });
  // zero_one_adam's local step (g, v read; x, m, u read and written).
  row("0/1 adam local step", 32.0 * n, [&] {
    return kernels::ZeroOneLocalStep(ctx, adam, g.as<float>(), x.as<float>(),
                                     m.as<float>(), out.as<float>(),
                                     v.as<float>(), n, /*write_x=*/true);
  });
  // onebit_lamb's step after its replies, over one layer of n elements in
  // pieces of 2^20 (a partition each): the segments' and the pieces' sums
  // (x, m, v, v' read; the pieces' sums copied to the host), then the x
  // update (x, m, v read; x written).
  compress::ReplyRule lamb;
  lamb.lamb = true;
  lamb.frozen_variance = true;
  std::vector<compress::LayerPiece> pieces;
  for (uint64_t at = 0; at < n; at += uint64_t{1} << 20)
    pieces.push_back({at, std::min<uint64_t>(n, at + (uint64_t{1} << 20)), 0});
  auto segments = kernels::LambSegments::Create(pieces, 1);
  if (!segments.ok()) return 1;
  row("lamb layer sums (to the host)", 16.0 * n + 24.0 * pieces.size(), [&] {
    return segments
        ->PieceSums(ctx, lamb, x.as<float>(), m.as<float>(), v.as<float>(),
                    g.as<float>())
        .status();
  });
  const std::vector<float> steps = {1e-6f};
  row("lamb x update", 16.0 * n, [&] {
    return segments->UpdateX(ctx, lamb, steps, x.as<float>(), m.as<float>(),
                             v.as<float>());
  });
  return 0;
}
