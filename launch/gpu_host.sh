#!/usr/bin/env bash
# One GPU host, all its GPUs in one mesh (data-parallel FSDP by default).
#   bash launch/gpu_host.sh configs/qwen2_5_7b_clip_b.yaml model.path=/ckpt/Qwen2.5-7B-Instruct \
#        data.train_path=/data/dapo-math-17k.parquet
# Installs jax with CUDA wheels into ./.venv the first time (RFT_JAX_JAX_SPEC overrides).
set -euo pipefail
CONFIG="${1:?usage: launch/gpu_host.sh CONFIG.yaml [key=value ...]}"; shift
# "" : no extras (sourced without arguments, _venv.sh would read this script's arguments as extras)
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" ""
if ! python -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  python -m pip install --quiet "${RFT_JAX_JAX_SPEC:-jax[cuda12]==0.10.2}"
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
cd "$ROOT"
exec rft-jax train --config "$CONFIG" "$@"
