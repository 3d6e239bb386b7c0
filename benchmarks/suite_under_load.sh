#!/usr/bin/env bash
# The default test suite (`make test`) N times in a row with a CPU-bound process beside it, as on a shared CI
# machine: `bash benchmarks/suite_under_load.sh [N]` (default 5) from the repository's root. Stops at the first
# failure and prints its tail; otherwise one line per run with its wall time.
set -u
runs=${1:-5}
python3 -c 'while True: pass' &
hog=$!
trap 'kill $hog' EXIT
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  log=$(mktemp)
  if make test > "$log" 2>&1; then
    echo "run $i: passed in $(( $(date +%s) - start )) s ($(tail -n 1 "$log"))"
  else
    echo "run $i: FAILED after $(( $(date +%s) - start )) s"
    tail -n 40 "$log"
    exit 1
  fi
done
