#!/usr/bin/env bash
# The C++ and CUDA sources are formatted with the repository's .clang-format
# (ctest format_check): clang-format --dry-run on every one, failing with the
# files and the command that fixes them. The style is clang-format 14's,
# Debian 12's; another major version formats some constructs differently,
# so the check is skipped there, saying why, rather than fail on a tree that
# is formatted.
#   tests/format/check_format.sh SOURCE_DIR
set -euo pipefail
root="${1:?usage: check_format.sh SOURCE_DIR}"
cd "$root"
command -v clang-format >/dev/null || { echo "format_check: no clang-format (apt-get install clang-format)" >&2; exit 1; }
major="$(clang-format --version | sed -n 's/.*version \([0-9]*\).*/\1/p')"
if [ "$major" != 14 ]; then
  echo "format_check: SKIPPED: clang-format $major is not 14 (Debian 12's), whose output is the style"
  exit 77
fi
if [ -d .git ] && command -v git >/dev/null; then
  mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' '*.inc')
else
  mapfile -t files < <(find . -path ./build -prune -o -path './build-*' -prune -o \
                         \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.inc' \) \
                         -type f -print | sed 's|^\./||' | sort)
fi
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "format_check: ${#bad[@]} of ${#files[@]} files are not formatted with .clang-format:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "format_check: fix with: clang-format -i ${bad[*]}  (or git clang-format before committing)" >&2
  clang-format --dry-run "${bad[0]}" 2>&1 | head -n 12 >&2
  exit 1
fi
echo "format_check: all ${#files[@]} C++/CUDA files formatted (clang-format $major)"
