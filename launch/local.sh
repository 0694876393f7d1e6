#!/usr/bin/env bash
# The main job on this machine (CPU is fine): creates ./.venv if needed, then runs the
# embedded default. Extra arguments are passed to the command.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
# The CPU decode attention kernel, once per machine and kernel source (then it says it is built);
# where it cannot be built (no C++ compiler), the demo decodes with XLA's attention.
rft-jax build-kernels || true
exec rft-jax demo "$@"
