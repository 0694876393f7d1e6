"""The CPU sampler's compile time: at XLA:CPU's LLVM optimisation levels (what
``rft_jax.sampling.decoder.CPU_COMPILER_OPTIONS`` rests on), and with the layers sliced at indices
that are arguments of the program or at constant offsets (what ``sample_loop``'s ``layer_ids``
rests on).

Each measurement runs in a fresh process (JAX keeps compiled programs in memory): the peers'
random Qwen3 (``--model small``: hidden 256, 4 layers, vocabulary 8,192; ``large``: hidden 512,
8 layers, vocabulary 32,768), 32 prompts of 16-48 tokens, 128 new tokens at temperature 1;
``sample_loop`` lowered and compiled in each case below, then called 3 times. The cases
alternate round by round; medians over the rounds.

    python benchmarks/speed/sampler_compile.py [--model small] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# case -> (LLVM level, layer indices as program arguments); the last is what the sampler runs.
CASES = {"-O3": (3, True), "-O2, layers at constant offsets": (2, False), "-O2": (2, True)}


def measure(model: str, case: str) -> dict:
  """In this process: seconds to lower and to compile the sampler, and its steady call time."""
  level, indices = CASES[case]
  sys.path.insert(0, BENCHMARKS)
  import jax
  import numpy as np
  from flax import nnx

  from peers.runners.spec import NEW_TOKENS, ROLLOUT_PROMPTS, prompts
  from speed.learner_step import MODELS, build
  from rft_jax.sampling import SamplingParams, prompt_fingerprints, prompt_length_bucket
  from rft_jax.sampling.loop import LoopSpec, layer_indices, sample_loop

  graphdef, state = nnx.split(build(model))
  texts = prompts(ROLLOUT_PROMPTS, MODELS[model]["vocab_size"], seed=0)
  width = prompt_length_bucket(max(map(len, texts)))
  ids, mask = np.zeros((2, len(texts), width), np.int32)
  for i, p in enumerate(texts):
    ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
  spec = LoopSpec.of(SamplingParams(n=1, temperature=1.0, max_new_tokens=NEW_TOKENS))
  args = (state, ids, mask, prompt_fingerprints(texts), np.ones(len(texts), bool), np.uint32(0),
          np.float32(1.0), np.int32(0), np.float32(1.0),
          layer_indices(MODELS[model]["num_hidden_layers"]) if indices else None)
  start = time.perf_counter()
  lowered = sample_loop.lower(graphdef, *args, spec=spec, mesh=None, rules=())
  lowered_at = time.perf_counter()
  compiled = lowered.compile({"xla_backend_optimization_level": level})
  compiled_at = time.perf_counter()
  jax.block_until_ready(compiled(*args))  # the first run (allocations), not counted
  calls = []
  for _ in range(3):
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    calls.append(time.perf_counter() - t)
  return {"lower": lowered_at - start, "compile": compiled_at - lowered_at,
          "call": statistics.median(calls)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=("small", "large"), default="small")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)  # one measurement
  args = parser.parse_args()
  if args.child is not None:
    print(json.dumps(measure(args.model, args.child)))
    return
  print(f"{args.model} model, {args.rounds} rounds, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
  results = {case: [] for case in CASES}
  for r in range(args.rounds):
    for case in CASES:
      out = subprocess.run([sys.executable, __file__, "--model", args.model, f"--child={case}"],
                           capture_output=True, text=True, check=True)
      results[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"round {r + 1}: " + ", ".join(f"{case} compile {results[case][-1]['compile']:.2f} s"
                                         for case in CASES), flush=True)
  print("| case | lower s | compile s, median (min-max) | call s |")
  print("|---|---|---|---|")
  for case, runs in results.items():
    compile_s = [x["compile"] for x in runs]
    print(f"| {case} | {statistics.median(x['lower'] for x in runs):.2f} | "
          f"{statistics.median(compile_s):.2f} ({min(compile_s):.2f}-{max(compile_s):.2f}) | "
          f"{statistics.median(x['call'] for x in runs):.3f} |")


if __name__ == "__main__":
  main()
