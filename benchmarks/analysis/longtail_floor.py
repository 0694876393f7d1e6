"""The machine's floor for a long-tailed CPU rollout: what any float32 engine needs, at least, to
generate the tokens of the long-tailed works of ``benchmarks/peers/longtail.py`` (issue 33).

Each step of an ideal engine decodes exactly the running rows (all rows start at once, as
vLLM's scheduler runs them with enough memory), and costs at least

* its weight products: ``2 x parameters x rows`` FLOPs at ``--peak`` GFLOP/s, or every weight
  read once at ``--bandwidth`` GB/s, whichever is longer (a step of few rows streams the
  weights for a handful of tokens), plus
* its attention: every running row's keys and values, ``layers x 2 x kv heads x head dim x 4``
  bytes a slot over its prompt and the tokens so far, read at ``--bandwidth``;

the two added, as if nothing overlapped and nothing else (sampling, cache writes, norms) cost.
Lengths are drawn as the works draw them (prompts of 16-48 tokens; every step ends a row with
probability ``--stop-p``, at most the work's limit). Defaults: 192 GFLOP/s (2 cores x 32 float32
FLOPs a cycle x 3 GHz) and 29 GB/s (an XLA sum over 512 MiB on both cores): the floor of
benchmarks/LONGTAIL.md.

Prints, per model and work, the median floor over ``--trials`` draws, its parts, and the share
of it an engine must reach to take ``1 / --ratio`` of another's measured time (``--against``).

    python benchmarks/analysis/longtail_floor.py [--models small large] [--against 25.2 83.2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from peers.runners.spec import LONGTAIL, STOP_EVERY  # noqa: E402
from speed.learner_step import MODELS, config_of  # noqa: E402
from speed.sampler import kv_bytes_per_token, weight_arrays  # noqa: E402


def floor_seconds(lengths: np.ndarray, prompts: np.ndarray, weights: int, weight_bytes: int,
                  per_slot: int, peak: float, bandwidth: float) -> tuple[float, float]:
  """(products s, attention s) of the ideal engine (``weights`` parameters in ``weight_bytes``,
  ``per_slot`` bytes of keys and values a cache slot) on rows of ``lengths`` new tokens after
  ``prompts`` tokens."""
  products = attention = 0.0
  for t in range(int(lengths.max())):
    running = lengths > t
    products += max(2 * weights * int(running.sum()) / peak, weight_bytes / bandwidth)
    attention += float((prompts[running] + t + 1).sum()) * per_slot / bandwidth
  return products, attention


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["small", "large"])
  parser.add_argument("--work", nargs="+", choices=sorted(LONGTAIL), default=sorted(LONGTAIL))
  parser.add_argument("--peak", type=float, default=192.0, help="GFLOP/s")
  parser.add_argument("--bandwidth", type=float, default=29.0, help="GB/s")
  parser.add_argument("--stop-p", type=float, default=1 / STOP_EVERY)
  parser.add_argument("--trials", type=int, default=20)
  parser.add_argument("--against", type=float, nargs="*", default=[],
                      help="another engine's seconds for each model and work, in order")
  parser.add_argument("--ratio", type=float, default=1.3)
  args = parser.parse_args()
  against = iter(args.against)
  print(f"floor at {args.peak:.0f} GFLOP/s and {args.bandwidth:.0f} GB/s; medians of "
        f"{args.trials} draws")
  print("| model | work | tokens | floor s | products s | attention s | share needed |")
  print("|---|---|---|---|---|---|---|")
  for model in args.models:
    arrays, per_slot = weight_arrays(config_of(model)), kv_bytes_per_token(config_of(model))
    weights = sum(x.size for x in arrays)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in arrays)
    for work in args.work:
      prompts_n, n, max_new = LONGTAIL[work]
      rng = np.random.default_rng(0)
      rows = []
      for _ in range(args.trials):
        lengths = np.minimum(rng.geometric(args.stop_p, prompts_n * n), max_new)
        prompts = np.repeat(rng.integers(16, 49, prompts_n), n)
        parts = floor_seconds(lengths, prompts, weights, weight_bytes, per_slot,
                              args.peak * 1e9, args.bandwidth * 1e9)
        rows.append((sum(parts), *parts, int(lengths.sum())))
      floor, products, attention, tokens = (statistics.median(c) for c in zip(*rows))
      other = next(against, None)
      share = (f"{floor / (other / args.ratio):.0%} to take 1/{args.ratio} of {other} s"
               if other else "")
      print(f"| {model} | {work} | {tokens:.0f} | {floor:.1f} | {products:.1f} | {attention:.1f} "
            f"| {share} |")


if __name__ == "__main__":
  main()
