#!/usr/bin/env bash
# GPU figures and checks (for a CUDA machine where rft_jax and its dependencies import), by section:
#   roofline  the sampler's decode step at 0.5B and 1.5B against the memory bound (the fused
#             step and XLA's, model.decode_kernels), and
#             transformers' generate (benchmarks/speed/sampler.py --roofline --transformers);
#   graphs    the same at 0.5B with XLA's command buffers (CUDA graphs) over while loops too;
#   profile   where a 0.5B decode step's time goes, by kernel
#             (benchmarks/accelerator/decode_profile.py);
#   mfu       the learner's model-FLOPs utilisation at 1.5B and its kernels by time
#             (benchmarks/accelerator/learner_mfu.py --profile);
#   memory    token_stats' peak temporary memory at a real vocabulary
#             (benchmarks/speed/token_stats_memory.py);
#   learner   the learner's step time with and without the masks
#             (benchmarks/speed/learner_overhead.py);
#   paged     the paged KV cache on the GPU: the paged-attention and paged-sampler tests (the
#             real Pallas GPU kernel beside XLA's gather), the kernel against the live bytes
#             (benchmarks/accelerator/paged_attention.py), and long-tailed rollouts, static
#             against continuous against paged (benchmarks/accelerator/longtail_sampler.py);
#   peers     long-tailed rollouts against transformers' generate_batch and static cache + compile
#             at 0.5B and 1.5B, 16 x 8 and 64 x 8 rows (benchmarks/accelerator/longtail_peers.py;
#             $PEERS_PRESETS and $PEERS_PROMPTS pick fewer);
#   kernels   the fused decode step's Pallas kernels, compiled for the GPU, against the XLA path
#             (tests/test_decode_attention.py, test_decode_projections.py, test_fused_decode.py);
#   decode    the decode step at batch 64, the fused step against XLA's ($DECODE_PRESETS, default
#             0.5b 1.5b; benchmarks/speed/sampler.py --roofline --decode-kernels fused xla);
#   tests     every test file whose maths runs on the device ($gpu_test_files), on the GPU, in
#             at most $TESTS_TIMEOUT seconds (default 300); each test's outcome is written to
#             $OUT/test_outcomes.txt as it ends;
#   lease     one device call of about 8 minutes, the first checks of a session lent a GPU:
#             kernels, decode at 0.5B, tests (at most 270 s), then decode at 1.5B; at most seven
#             files in $OUT, each written as it goes.
# Each command stops after $SECTION_TIMEOUT seconds (default 600).  Logs go to $OUT (or runs/gpu).
# Usage:  bash benchmarks/accelerator/gpu.sh [section ...]
#         (default: roofline profile mfu graphs memory learner tests)
set -uo pipefail
self="$(realpath "${BASH_SOURCE[0]}")"
cd "$(dirname "$self")/../.."
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, flax, optax, transformers; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'transformers', transformers.__version__, jax.devices())"
log() { tee "$out/$1.txt" | grep -v Warning; }
run() { timeout "${SECTION_TIMEOUT:-600}" "$@"; }
# The test files of `tests` (slowest first, as tests/conftest.py orders them for the CPU suite).
gpu_test_files=(
  tests/test_learner.py tests/test_learner_token_batches.py tests/test_sampling.py tests/test_attention.py
  tests/test_sampling_continuous.py tests/test_sampling_paged.py tests/test_sampling_parts.py
  tests/test_sampling_chunks.py tests/test_paged_kv.py tests/test_fused_decode.py
  tests/test_decode_attention.py tests/test_decode_projections.py
  tests/test_attention_kernels.py tests/test_models_forward.py
  tests/test_models_cache.py tests/test_models_hf_io.py tests/test_lora.py tests/test_gspo.py
  tests/test_rollout_correction.py tests/test_token_stats.py tests/test_token_stats_precision.py
  tests/test_entropy_theory.py
  tests/test_entropy_methods.py tests/test_entropy_target.py tests/test_rl_losses.py
  tests/test_clipping.py tests/test_cov_methods.py tests/test_token_methods.py tests/test_critic.py
  tests/test_gae.py tests/test_forking_tokens.py tests/test_reference_policy.py
  tests/test_unlikeliness.py tests/test_device_rollouts.py)
graphs=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL
sections=("$@")
[ ${#sections[@]} -gt 0 ] || sections=(roofline profile mfu graphs memory learner tests)
if [ "${sections[*]}" = lease ]; then
  # A lent GPU's first call: each part bounded, the most telling first.
  SECTION_TIMEOUT="${SECTION_TIMEOUT:-120}" TESTS_TIMEOUT="${TESTS_TIMEOUT:-270}" \
    DECODE_PRESETS=0.5b bash "$self" kernels decode tests
  SECTION_TIMEOUT=100 DECODE_PRESETS=1.5b bash "$self" decode
  exit 0
fi
for section in "${sections[@]}"; do
  case $section in
    roofline)
      for preset in 0.5b 1.5b; do
        run python3 benchmarks/speed/sampler.py --roofline --preset $preset --batches 64 256 \
          --decode-kernels fused xla --transformers --repeats 3 2>&1 | log roofline_$preset
      done ;;
    graphs)
      XLA_FLAGS="$graphs --xla_gpu_graph_min_graph_size=1 ${XLA_FLAGS:-}" run python3 \
        benchmarks/speed/sampler.py --roofline --preset 0.5b --batches 64 256 \
        --decode-kernels fused xla --repeats 3 2>&1 | log graphs_0.5b ;;
    profile)
      run python3 benchmarks/accelerator/decode_profile.py --preset 0.5b --batch 64 2>&1 | log decode_profile ;;
    mfu)
      run python3 benchmarks/accelerator/learner_mfu.py --rows 16 --prompt 256 --completion 768 --micro 16 4 \
        --repeats 3 --profile 2>&1 | log learner_mfu ;;
    memory)
      run python3 benchmarks/speed/token_stats_memory.py 2>&1 | log token_stats_memory ;;
    learner)
      run python3 benchmarks/speed/learner_overhead.py --batch 64 --completion 256 --vocab 151936 2>&1 | log learner_overhead ;;
    paged)
      JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false run python3 -m pytest -q \
        -p no:cacheprovider -rf --tb=short -k "not mesh and not shards" \
        tests/test_paged_kv.py tests/test_sampling_paged.py 2>&1 | log pytest_paged
      run python3 benchmarks/accelerator/paged_attention.py --kinds xla pallas_gpu 2>&1 | log paged_attention
      run python3 benchmarks/accelerator/longtail_sampler.py --preset 0.5b --prompts 16 --n 8 \
        --max-new 1024 --rounds 1 --settings static continuous:64 paged:64:2048 \
        paged:64:2048:xla 2>&1 | log longtail_paged_0.5b ;;
    peers)
      for preset in ${PEERS_PRESETS:-0.5b 1.5b}; do
        for prompts in ${PEERS_PROMPTS:-16 64}; do
          run python3 benchmarks/accelerator/longtail_peers.py --preset $preset --prompts $prompts \
            --n 8 --max-new 1024 --rounds 2 --timeout 300 --budget $((${SECTION_TIMEOUT:-600} - 30)) \
            --log-dir "$out/longtail_peers_${preset}_$((prompts * 8))" 2>&1 \
            | log longtail_peers_${preset}_$((prompts * 8))
        done
      done ;;
    kernels)
      JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
        RFT_JAX_TEST_OUTCOMES="$out/test_outcomes.txt" run python3 -m pytest -n 3 -q \
        -p no:cacheprovider -rfEs --tb=short tests/test_decode_attention.py \
        tests/test_decode_projections.py tests/test_fused_decode.py 2>&1 | log pytest_kernels ;;
    decode)
      for preset in ${DECODE_PRESETS:-0.5b 1.5b}; do
        run python3 benchmarks/speed/sampler.py --roofline --preset $preset --batches 64 \
          --decode-kernels fused xla --repeats 2 2>&1 | log decode_$preset
      done ;;
    tests)
      # Every test file whose maths runs on the device, one worker per two cores sharing the GPU,
      # each allocating on demand (compilation is most of the time). Each test's outcome is in
      # $out/test_outcomes.txt as soon as it ends (tests/conftest.py's OutcomeLog), so a run cut
      # short still names what failed; a test needing the CPU suite's 8 fake devices is skipped
      # with that reason (-rs prints it).
      JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
        RFT_JAX_TEST_OUTCOMES="$out/test_outcomes.txt" timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest \
        -n "${TEST_WORKERS:-8}" --dist loadfile -q -p no:cacheprovider -rfEs --tb=line \
        "${gpu_test_files[@]}" 2>&1 | log pytest_gpu ;;
    *) echo "unknown section $section (roofline, graphs, profile, mfu, memory, learner, paged, peers, kernels, decode, tests, lease)"
       exit 2 ;;
  esac
done
