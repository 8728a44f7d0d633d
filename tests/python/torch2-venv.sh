#!/usr/bin/env bash
# Makes VENV, a virtual environment of Debian's /usr/bin/python3 with a
# current torch 2.x, transformers, accelerate and peft from PyPI (pinned below), for the Python tests' second
# run (ctest -L torch2; issue 41: CI tests torch 2.x beside Debian's 1.13).
#
#   tests/python/torch2-venv.sh VENV
#
# PyPI's Linux wheels of torch 2.x carry CUDA (the nvidia-* and cuda-toolkit
# packages, about 4.7 GB installed); on a machine without a GPU torch runs on
# the CPU and they are not loaded. Made once: a stamp in VENV names the pins,
# and a venv with other pins is made again. A host that cannot reach PyPI
# skips (exit 77, which ctest reports as skipped, saying why) instead of
# failing on the network.
set -euo pipefail
venv="${1:?usage: torch2-venv.sh VENV}"
# scikit-learn: the examples' digits (bundled with it, no download);
# transformers, accelerate and peft: test_hf (Trainer and Accelerate, LoRA; issue 41).
pins=(torch==2.11.0 numpy==2.1.3 scikit-learn==1.5.2 scipy==1.14.1 transformers==5.24.0 accelerate==1.15.0
      peft==0.21.2)
stamp="$venv/morse-pins"
pypi_answers() {
  /usr/bin/python3 -c "import urllib.request; urllib.request.urlopen('https://pypi.org/simple/torch/', timeout=20)" 2>/dev/null
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ] && "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "torch2-venv: $venv has ${pins[*]} already"
  exit 0
fi
if ! pypi_answers; then
  echo "torch2-venv: SKIPPED: PyPI (https://pypi.org) is not reachable from this host, so the" \
       "Python tests do not run against torch 2.x here (they still run against Debian's torch 1.13)"
  exit 77
fi
# The install needs about 5 GB (and pip's cache as much again).
mkdir -p "$(dirname "$venv")"
free_kb="$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 {print $4}')"
if [ "${free_kb:-0}" -lt $((10 * 1024 * 1024)) ]; then
  echo "torch2-venv: SKIPPED: $((free_kb / 1024)) MB free beside $venv, and torch 2.x from PyPI" \
       "needs about 10 GB to install; the Python tests still run against Debian's torch 1.13"
  exit 77
fi
rm -rf "$venv"
/usr/bin/python3 -m venv "$venv"
echo "torch2-venv: installing ${pins[*]} from PyPI into $venv"
if ! "$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}"; then
  rm -rf "$venv"
  # A registry that went away mid-install is the host's network, not Morse.
  if ! pypi_answers; then
    echo "torch2-venv: SKIPPED: PyPI stopped answering during the install"
    exit 77
  fi
  echo "torch2-venv: pip could not install ${pins[*]} (above)" >&2
  exit 1
fi
"$venv/bin/python" -c "import torch, numpy; print('torch2-venv: torch', torch.__version__, 'numpy', numpy.__version__)"
echo "${pins[*]}" >"$stamp"
