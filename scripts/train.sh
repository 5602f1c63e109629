#!/usr/bin/env bash
# Builds octet and runs the main job: `octet train` on its defaults. Extra arguments go to
# `octet train` (e.g. scripts/train.sh --precision bf16 --steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh octet_cli
exec "${OCTET_BUILD_DIR:-build}/octet" train "$@"
