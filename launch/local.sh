#!/usr/bin/env bash
# The main job on this machine (CPU is fine): creates ./.venv if needed, then runs the
# embedded default. Extra arguments are passed to the command.
set -euo pipefail
# "" : no extras (sourced without arguments, _venv.sh would read this script's arguments as extras)
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" ""
cd "$ROOT"
# The CPU decode attention kernel, once per machine and kernel source (then it says it is built);
# where it cannot be built (no C++ compiler), the demo decodes with XLA's attention.
rft-jax build-kernels || true
# Huge pages for what malloc maps (glibc 2.35 on; older ones ignore it): where the kernel gives
# transparent huge pages on advice, the weights and KV cache sit in 2 MiB pages, and long-tailed
# CPU rollouts run 2-3% faster (benchmarks/LONGTAIL.md, "Huge pages"). A GLIBC_TUNABLES of
# your own is kept.
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}"
exec rft-jax demo "$@"
