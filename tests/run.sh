#!/usr/bin/env bash
# Installs what Morse needs (Debian packages), builds it, and runs every test
# with ctest. This is the README's test command and what CI runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/deploy/install-deps.sh"
"$root/deploy/build.sh"
build="${MORSE_BUILD_DIR:-$root/build}"
cd "$build"
code=0
ctest --output-on-failure -j "${MORSE_JOBS:-$(nproc)}" --timeout 900 "$@" || code=$?
# A failed test's output scrolls by in the middle of an hour's log; CI keeps
# its tail. So the run ends with what each failure said: its failing
# assertions and sanitizer reports, the lines that name the cause.
if [ "$code" -ne 0 ] && [ -s Testing/Temporary/LastTestsFailed.log ]; then
  echo "=== what the failed tests said (whole output above, and in $build/Testing/Temporary/LastTest.log)"
  cut -d: -f2- Testing/Temporary/LastTestsFailed.log | while read -r name; do
    echo "--- $name"
    awk -v name="$name" '
      $0 ~ "^[0-9]+/[0-9]+ Test: " && $3 == name { found = 1; next }
      found && /^Output:/ { inside = 1; next }
      inside && /^<end of output>/ { exit }
      inside' Testing/Temporary/LastTest.log |
      grep -E '\[  FAILED  \]|^FAIL |Sanitizer|runtime error|Failure$|^Expected|^Which is|^  Actual|Error|error:|Timeout|Traceback|^[A-Za-z]*Error' |
      grep -v '^\[  FAILED  \] [0-9]* test' | head -12 || true
  done
fi
exit "$code"
