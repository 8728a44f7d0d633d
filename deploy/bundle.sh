#!/usr/bin/env bash
# Packs a built Morse into one relocatable tarball that runs after `tar x` on
# any x86-64 Linux with glibc >= 2.36 (and, for the GPU path, an NVIDIA
# driver and CUDA 13's runtime and cuBLAS):
#
#   morse/bin/      morse-server, morse-worker, morse-netprobe, morse-run
#   morse/python/   the `morse` package (pure Python + libmorse.so, loaded
#                   through ctypes: any Python 3.9+, any PyTorch 1.13+);
#                   `pip install --no-build-isolation morse/python` installs it
#   morse/python/morse/lib/ (and the link morse/lib)
#                   the shared libraries everything needs that such a host may
#                   lack (gRPC, Protobuf, Abseil, OpenSSL, OpenBLAS, Boost,
#                   prometheus-cpp, ...), found through $ORIGIN-relative
#                   RUNPATHs; inside the package so that pip takes them along
#   morse/tests/    the test binaries, the benchmarks and run-tests.sh
#   morse/share/    the example job configs
#
# Left to the host: glibc, libstdc++ and libgcc_s, the NVIDIA driver, and
# the CUDA toolkit's own libraries (libcudart, libcublas), which the RUNPATH
# also looks for in /usr/local/cuda/lib64.
#
# Usage: deploy/bundle.sh [OUTPUT.tar.xz]   (default build/morse-bundle.tar.xz)
# The build folder is ${MORSE_BUILD_DIR:-build}; build it first
# (deploy/build.sh). Set MORSE_BUNDLE_COMPRESS=gzip for a faster, larger
# tarball.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MORSE_BUILD_DIR:-$root/build}"
out="${1:-$build/morse-bundle.tar.xz}"
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit 0
fi
for tool in patchelf ldd strip tar; do
  command -v "$tool" >/dev/null || { echo "bundle.sh: $tool is missing (deploy/install-deps.sh installs it)" >&2; exit 1; }
done
[ -x "$build/server/morse-server" ] || { echo "bundle.sh: no $build/server/morse-server; build first (deploy/build.sh)" >&2; exit 1; }

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
top="$stage/morse"
libs="$top/python/morse/lib"
mkdir -p "$top/bin" "$libs" "$top/tests" "$top/share/morse/configs"
ln -s python/morse/lib "$top/lib"

# Executables: the daemons, the network probe, and every test and benchmark.
cp "$build/server/morse-server" "$build/worker/morse-worker" "$top/bin/"
[ -x "$build/deploy/experiments/morse-netprobe" ] && cp "$build/deploy/experiments/morse-netprobe" "$top/bin/"
cp "$root/worker/python/morse-run" "$top/bin/"
while IFS= read -r f; do
  cp "$f" "$top/tests/"
done < <(find "$build/tests" -maxdepth 2 -type f -perm -u+x \( -name '*_test' -o -name '*_bench' \) | sort)
cp "$root/tests/bundle/run-tests.sh" "$top/tests/"
mkdir -p "$top/tests/python"
cp "$root"/tests/python/{harness,test_cuda_tensors,test_onebit_identical,test_adam_matches_torch,test_wrong_use,test_torch_idioms,test_resume,test_buffers,test_node_aggregation,test_node_sharding,test_diloco,test_grad_scaler,test_add_param_group}.py "$top/tests/python/"
cp "$root"/deploy/configs/*.textproto "$top/share/morse/configs/"

# The Python package: whatever CMake assembled in build/python/morse.
cp "$build"/python/morse/*.py "$build/python/morse/libmorse.so" "$top/python/morse/"
mkdir -p "$top/python/morse/torch" && cp "$build"/python/morse/torch/*.py "$top/python/morse/torch/"
cp "$build/python/pyproject.toml" "$top/python/"

# Shared libraries: everything ldd resolves except what the host provides.
host_provided='^(linux-vdso|ld-linux|libc\.so|libm\.so|libmvec|libpthread|libdl\.so|librt\.so|libresolv|libutil|libstdc\+\+|libgcc_s|libcuda\.so|libcudart|libcublas|libcublasLt|libnvidia|libnvrtc|libnvJitLink)'
mapfile -t elves < <(find "$top/bin" "$top/tests" "$top/python/morse/libmorse.so" -type f -exec sh -c 'head -c4 "$1" | grep -q ELF' _ {} \; -print)
declare -A copied=()
for elf in "${elves[@]}"; do
  while read -r name _ path _; do
    [ -n "$path" ] && [ -f "$path" ] || continue
    [[ "$name" =~ $host_provided ]] && continue
    [ -n "${copied[$name]:-}" ] && continue
    cp -L "$path" "$libs/$name"
    copied[$name]=1
  done < <(ldd "$elf" | grep '=>')
done

# Smaller: no debug information. Relocatable: RUNPATHs relative to $ORIGIN.
for f in "$top"/bin/* "$top"/tests/* "$top"/python/morse/libmorse.so "$libs"/*; do
  [ -f "$f" ] && head -c4 "$f" | grep -q ELF || continue
  chmod u+w "$f"
  strip --strip-debug "$f"
  case "$f" in
    "$libs"/*) patchelf --set-rpath '$ORIGIN' "$f" ;;
    */libmorse.so) patchelf --set-rpath '$ORIGIN/lib:/usr/local/cuda/lib64' "$f" ;;
    *) patchelf --set-rpath '$ORIGIN/../python/morse/lib:/usr/local/cuda/lib64' "$f" ;;
  esac
done

mkdir -p "$(dirname "$out")"
case "${MORSE_BUNDLE_COMPRESS:-xz}" in
  gzip) tar -C "$stage" -czf "$out" morse ;;
  *) tar -C "$stage" -cf - morse | xz -T0 -6 >"$out" ;;
esac
echo "bundle.sh: $out ($(du -h "$out" | cut -f1); $(ls "$libs" | wc -l) libraries, $(ls "$top/tests" | wc -l) test files)"
