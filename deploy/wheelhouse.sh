#!/usr/bin/env bash
# The lock's files that do not come from PyPI, fetched once into a wheelhouse that the image build mounts
# (docs/deploy.md, 1A): torch's CPU wheel, from PyTorch's index or from TORCH_FIND_LINKS (a folder or page
# that holds the wheel, where that index cannot be reached), checked against the lock's hash before it is
# kept.
#
#   deploy/wheelhouse.sh [OUT]             # OUT defaults to build/wheelhouse
#   podman build -f deploy/Dockerfile --build-context wheels=build/wheelhouse -t fedlt:0.1.0 .
set -euo pipefail

OUT="${1:-build/wheelhouse}"
LOCK="$(dirname "$0")/requirements.txt"
PYTHON="${PYTHON:-python3}"
FIND_LINKS="${TORCH_FIND_LINKS:-https://download.pytorch.org/whl/cpu/torch/}"

mkdir -p "$OUT"
# torch's entry of the lock, continuation lines included, as a requirements file of its own.
requirement="$(mktemp)"
trap 'rm -f "$requirement"' EXIT
sed -n '/^torch==/,/^[^ ]/p' "$LOCK" | grep -E '^(torch==| +--hash=)' > "$requirement"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
    --platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp --abi cp311 \
    --find-links "$FIND_LINKS" --dest "$OUT" --requirement "$requirement"
ls -l "$OUT"
