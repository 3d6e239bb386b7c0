#!/usr/bin/env bash
# fedlt on a GPU against the CPU: one short simulator study and one DP-SGD epoch on each, their times and
# accuracy difference (benchmarks/device_check.py says what runs). From the repository's root:
#   bash benchmarks/device_check.sh [--device cuda:N] [--rounds R] [--json PATH]
# Uses the project's venv (.venv/bin/python, or $PYTHON) and sets nothing up. Under 5 minutes on a GPU
# machine; without a GPU it prints one line and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
if [ ! -x "$python" ]; then
  echo "device_check: no Python at $python; run make (it creates .venv) or set PYTHON" >&2
  exit 2
fi
# cuBLAS reads this when it starts: with it, a deterministic run on one GPU repeats to the bit
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
exec "$python" benchmarks/device_check.py "$@"
