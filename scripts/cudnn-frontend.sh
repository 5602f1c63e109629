#!/usr/bin/env bash
# cudnn-frontend.sh: puts the header-only C++ API of cudnn-frontend (the PyPI wheel
# nvidia-cudnn-frontend, pinned below) into .carry/include/, where CMake looks for it
# (OCTET_WITH_CUDNN_ATTENTION) and from where a device call carries it (scripts/carry.sh): the GPU
# machine has no package registry. Only the wheel's include/ tree is kept. Does nothing when that
# version is already there. Environment: OCTET_CUDNN_FRONTEND_WHEEL, a wheel file already on disk
# (then nothing is downloaded).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The version whose SDPA attributes src/ops/cuda/attention_cudnn.cc was written against.
readonly kVersion=1.32.0
readonly dest=.carry/include
readonly stamp=$dest/cudnn_frontend.version

if [[ -f $dest/cudnn_frontend.h && "$(cat "$stamp" 2>/dev/null)" == "$kVersion" ]]; then
  echo "cudnn-frontend.sh: cudnn-frontend $kVersion already in $dest"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel=${OCTET_CUDNN_FRONTEND_WHEEL:-}
if [[ -z $wheel ]]; then
  # Any platform's wheel holds the same headers; pip picks the one for this interpreter.
  python3 -m pip download --no-deps --only-binary=:all: --quiet --dest "$work" \
    "nvidia-cudnn-frontend==$kVersion"
  wheel=$(find "$work" -name 'nvidia_cudnn_frontend-*.whl' | head -1)
  [[ -n $wheel ]] || { echo "cudnn-frontend.sh: pip downloaded no wheel" >&2; exit 1; }
fi
# A wheel is a zip; python3 reads it where unzip is not installed.
python3 - "$wheel" "$work/unpacked" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    headers = [n for n in wheel.namelist() if n.startswith("include/") and not n.endswith("/")]
    if not any(n == "include/cudnn_frontend.h" for n in headers):
        sys.exit(f"cudnn-frontend.sh: {sys.argv[1]} has no include/cudnn_frontend.h")
    wheel.extractall(sys.argv[2], headers)
PY
mkdir -p "$dest"
# Replace an older version's files, leaving the other carried headers (dlpack/) alone.
rm -rf "$dest"/cudnn_frontend "$dest"/cudnn_frontend*.h "$dest"/cudnn_backend_base.h
cp -r "$work"/unpacked/include/. "$dest"/
echo "$kVersion" >"$stamp"
echo "cudnn-frontend.sh: cudnn-frontend $kVersion headers in $dest"
