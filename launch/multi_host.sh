#!/usr/bin/env bash
# Several GPU hosts: run this on every host (e.g. from a job scheduler), one process per host.
#   COORDINATOR=host0:1234 NUM_HOSTS=4 HOST_ID=<0..3> bash launch/multi_host.sh CONFIG.yaml key=value ...
# Every host must see the same repository, model and data paths. The mesh spans all hosts' GPUs.
set -euo pipefail
CONFIG="${1:?usage: launch/multi_host.sh CONFIG.yaml [key=value ...]}"; shift
export RFT_JAX_COORDINATOR="${COORDINATOR:?set COORDINATOR=host:port of host 0}"
export RFT_JAX_NUM_PROCESSES="${NUM_HOSTS:?set NUM_HOSTS}"
export RFT_JAX_PROCESS_ID="${HOST_ID:?set HOST_ID (0-based)}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu_host.sh" "$CONFIG" "$@"
