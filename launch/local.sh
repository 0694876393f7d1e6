#!/usr/bin/env bash
# The main job on this machine (CPU is fine): creates ./.venv if needed, then runs the
# embedded default. Extra arguments are passed to the command.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
exec rft-jax demo "$@"
