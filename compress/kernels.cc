#include "compress/kernels.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace morse::compress {
namespace {

const KernelTable& Widest() {
  if (Avx512Kernels() != nullptr) return *Avx512Kernels();
  if (Avx2Kernels() != nullptr) return *Avx2Kernels();
  return ScalarKernels();
}

const KernelTable& ChooseKernels() {
  const char* wanted = std::getenv("MORSE_SIMD");
  const bool any = wanted == nullptr || wanted[0] == '\0';
  const auto allows = [&](const char* name) {
    return any || std::strcmp(wanted, name) == 0;
  };
  if (!any && !allows("avx512") && !allows("avx2") && !allows("scalar")) {
    std::fprintf(stderr,
                 "morse: MORSE_SIMD=%s is not one of scalar, avx2, avx512; "
                 "using the widest supported\n",
                 wanted);
    return Widest();
  }
  if (any) return Widest();
  if (allows("avx512") && Avx512Kernels() != nullptr) return *Avx512Kernels();
  if (allows("avx2") && Avx2Kernels() != nullptr) return *Avx2Kernels();
  return ScalarKernels();
}

}  // namespace

const KernelTable& ActiveKernels() {
  static const KernelTable& table = ChooseKernels();
  return table;
}

}  // namespace morse::compress
