#!/usr/bin/env bash
# A Cloud TPU VM slice (v4, v5e, v5p, v6e): run the same command on every host of the slice, e.g.
#   gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all --command \
#     "cd rft_jax && bash launch/tpu_vm.sh configs/qwen2_5_7b_clip_b.yaml model.path=/ckpt/Qwen2.5-7B-Instruct data.train_path=/data/dapo.parquet"
# Check first, on any machine, that the config fits the slice (nothing is downloaded or run):
#   rft-jax plan configs/qwen2_5_7b_clip_b.yaml model.path=/ckpt/Qwen2.5-7B-Instruct --topology v5p:2x2x1
# Installs rft_jax[tpu] (jax with libtpu) into ./.venv the first time. One process per host;
# jax.distributed.initialize() finds the other hosts from the TPU VM's metadata, and the mesh spans
# every chip of the slice. The model and data paths must be readable at the same path on every host.
set -euo pipefail
CONFIG="${1:?usage: launch/tpu_vm.sh CONFIG.yaml [key=value ...]}"; shift
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" tpu
export RFT_JAX_DISTRIBUTED=tpu
cd "$ROOT"
exec rft-jax train --config "$CONFIG" "$@"
