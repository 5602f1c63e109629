#!/usr/bin/env bash
# carry.sh: gathers here what the GPU machine's image lacks and has no registry to install, into
# folders that git ignores and that a device call names in its carry (scripts/gpu-check.sh):
#   .carry/include/dlpack/dlpack.h   DLPack's header, for the C API (Debian: libdlpack-dev)
#   .carry/include/cudnn_frontend*   cudnn-frontend's headers, for cuDNN attention (cudnn-frontend.sh)
#   .corpora/                        the real-text corpora of the convergence check (corpora.sh)
#   .carry/commit                    this checkout's commit, which gpu-check's summary quotes
# Installs the Debian packages with apt-get when missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ ! -f /usr/include/dlpack/dlpack.h ]]; then
  sudo_cmd=$([[ $(id -u) -eq 0 ]] && echo "" || echo sudo)
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq libdlpack-dev >/dev/null
fi
mkdir -p .carry/include
rm -rf .carry/include/dlpack
cp -r /usr/include/dlpack .carry/include/
scripts/cudnn-frontend.sh >/dev/null
# The commit the device call's files come from, for gpu-check's summary (its copy of .git is stale).
{ git rev-parse --short HEAD
  [[ -z "$(git status --porcelain --untracked-files=no)" ]] || echo "+ uncommitted changes"
} | paste -sd' ' >.carry/commit
scripts/corpora.sh .corpora >/dev/null
echo "carry.sh: .carry/include (dlpack, cudnn-frontend) and .corpora ready;" \
  "name both in the device call's carry"
