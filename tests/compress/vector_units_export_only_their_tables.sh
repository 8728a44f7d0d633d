#!/usr/bin/env bash
# The avx2/ and avx512/ translation units are compiled with wider instruction
# sets: a function they define with external linkage (an `inline` helper from
# a header, a template) can be the copy the linker keeps for every caller,
# and then code that must run on any x86-64 executes AVX-512 instructions
# (SIGILL on a CPU without them). Each may export its table's getter only.
#   vector_units_export_only_their_tables.sh OBJECT...  (or one ;-list: ctest)
set -euo pipefail
failed=0
checked=0
joined="$(IFS=';'; echo "$*")"
IFS=';' read -r -a objects <<<"$joined"
for obj in "${objects[@]}"; do
  case "$obj" in
    */avx2/*) want="Avx2Kernels" ;;
    */avx512/*) want="Avx512Kernels" ;;
    *) continue ;;
  esac
  checked=$((checked + 1))
  extra="$(nm -C --defined-only "$obj" | grep -vE ' [tdbrn] ' | grep -v "morse::compress::${want}()" || true)"
  if [ -n "$extra" ]; then
    echo "$obj defines symbols other code may link to:"
    echo "$extra"
    failed=1
  else
    echo "$(basename "$(dirname "$obj")")/$(basename "$obj"): only ${want}() is visible"
  fi
done
[ "$checked" -eq 2 ] || { echo "expected the avx2 and avx512 objects, found $checked" >&2; exit 1; }
exit "$failed"
