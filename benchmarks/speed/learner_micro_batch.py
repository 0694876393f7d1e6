"""Learner step time on a demo batch against ``learner.micro_batch_size``.

Samples one demo batch (16 prompts x 8 completions) from the shipped checkpoint and times
the compiled train step (median of ``--repeats`` steps after the compiling one) for each
micro-batch size. With one micro-batch the step takes its statistics, mask and gradient
from a single forward pass; with several it runs a pre-update pass, then accumulates.

    python benchmarks/speed/learner_micro_batch.py [--sizes 128 64 32 16] [--repeats 5] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

from rft_jax.demo.run import build_demo_run
from rft_jax.models import load_hf
from rft_jax.rl.learner import Learner
from rft_jax.train import loop


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=[128, 64, 32, 16])
  parser.add_argument("--repeats", type=int, default=5)
  args, overrides = parser.parse_known_args()
  with tempfile.TemporaryDirectory() as root:
    cfg, run, state = build_demo_run(root, ["learner.forecast_every=0", *overrides])
    batch = loop.step_rollouts(run, state, step=0).batch
  rows, width = batch.input_ids.shape
  print(f"demo batch: {rows} sequences x {width} tokens")
  for size in args.sizes:
    learner = Learner(run.learner.model(state), dataclasses.replace(cfg.learner, micro_batch_size=size),
                      mesh=run.mesh)
    fresh = learner.init(load_hf(cfg.model.path, mesh=run.mesh))
    fresh, _ = learner.step(fresh, batch)  # compiles
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      fresh, _ = learner.step(fresh, batch)
      times.append(time.perf_counter() - start)
    kind = "one forward pass" if learner.is_single_pass(rows) else f"{rows // size} micro-batches"
    print(f"micro_batch_size {size:4d} ({kind:>16}): {statistics.median(times):.3f} s per step "
          f"(median of {args.repeats})")


if __name__ == "__main__":
  main()
