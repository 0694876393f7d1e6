"""How far scheduling alone can take long-tailed CPU rollouts: the continuous pool's steps
against an ideal batch, priced by measured decode-step times (issue 33).

Measures the CPU decode step (decode + sampling strategy, ``benchmarks/speed/cpu_decode_step.py``'s
compiled loop) of the peers' ``--model`` at each batch size in ``--sizes`` and each size of the
replayed pools (``--pool`` too), then replays
``--trials`` draws of a long-tailed work (``--rows`` samples, lengths geometric with stop
probability ``--stop-p`` per token, truncated at ``--max-new``) through:

* ``pool``: the sampler's CPU schedule, ``rft_jax.sampling.continuous.pool_sizes`` slots (a waiting
  sample takes each free slot; once nothing waits, the pool halves whenever its running samples
  fit the next size), every step priced at its pool size;
* ``ideal``: every step priced at its number of running samples, as if a batch could shrink by
  one row at no cost (all rows start at once: what vLLM's scheduler does with enough memory).

Step prices between measured sizes are interpolated linearly (beyond the largest, at its cost
per row), which flatters ``ideal``: XLA:CPU's products cost more at some row counts than their
rows say (the large model, 2026-11-28: 22.8 ms a step at 11 rows, 29.2 at 15 and 42.0 at 27,
against 20.1 at 16 and 28.9 at 32; 79.5 at 96 against 88.2 at 128). Prefill, admission copies
and the stages' compaction are not priced. So the ratio of the two says how much a better
schedule could gain at most, and ``ideal`` how fast the step must get to beat a time; check a
schedule on the works themselves (``benchmarks/speed/longtail_calls.py``, two checkouts). A pool
shrinking by quarters (64, 48, 36, 27, 20, 15, 11, 8, ... slots) replayed 7.6% faster than
halving on the large model's 128-row work, interpolated, and ran 3-4% slower, with 10 s more
compiling (2026-11-28).

Prints the per-size step times, the median seconds of each schedule and the share of the pool's
columns that hold no running sample (its stopped slots until the next stage; that share does not
depend on the step prices). On the large model (2026-11-28, quiet) the 128-row work's pool
replays at 25.0 s, where its calls took 24.2-25.9 s (``longtail_calls.py --work longtail_128
--decode-slots 64``), and the ideal at 22.9 s; the 512-row work's (``--rows 512 --max-new 512
--decode-slots 128``) at 68.2 s, where ``longtail.py`` measured 68.8 s, and the ideal at 62.1 s.

    python benchmarks/analysis/longtail_schedule.py --model large --rows 128 --max-new 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from speed.cpu_decode_step import attention_fn, build, loop, prefilled, timed  # noqa: E402
from rft_jax.models.decode import cpu_attention  # noqa: E402
from rft_jax.sampling.continuous import min_pool_slots, pool_sizes  # noqa: E402
from rft_jax.sampling.params import SamplingParams  # noqa: E402


def step_seconds(model_name: str, sizes: list[int], prompt: int, max_new: int, steps: int,
                 rounds: int) -> dict[int, float]:
  """Median wall seconds of one decode step + strategy at each batch size: the difference of
  loops of ``2 * steps`` and ``steps`` steps over ``steps``, so that what a call costs once (the
  weights laid out for the step, about 4 ms a step of a 16-step loop on the large model) is
  not counted as steps."""
  import jax.numpy as jnp
  from flax import nnx
  model = build(model_name)
  graphdef, state = nnx.split(model)
  short, long = (loop("step", n, attention_fn("kernel")) for n in (steps, 2 * steps))
  out = {}
  for size in sizes:
    tokens, cache = prefilled(model, size, prompt, max_new, tiled=cpu_attention.available())
    uniforms = jnp.asarray(np.random.default_rng(1).random((size, 2 * steps)), jnp.float32)
    logits0 = jnp.zeros((model.config.vocab_size, size), jnp.float32)
    args = (graphdef, state, tokens, cache, uniforms, logits0)
    timed(short, *args), timed(long, *args)
    out[size] = statistics.median(timed(long, *args)[0] - timed(short, *args)[0]
                                  for _ in range(rounds)) / steps
  return out


def price(step: dict[int, float]):
  """Seconds of a step of ``b`` rows: interpolated between the measured sizes, and beyond the
  largest at its cost per row."""
  sizes = sorted(step)
  top = sizes[-1]
  return lambda b: (float(np.interp(b, sizes, [step[s] for s in sizes])) if b <= top
                    else step[top] * b / top)


def pool_steps(lengths: list[int], slots: tuple[int, ...]):
  """The pool schedule of ``rft_jax.sampling.continuous`` replayed on ``lengths``: each step's
  pool size and running samples."""
  queue, running, stage = list(lengths), [], 0
  while queue or running:
    size = slots[stage]
    while queue and len(running) < size:
      running.append(queue.pop(0))
    yield size, len(running)
    running = [left - 1 for left in running if left > 1]
    while not queue and stage + 1 < len(slots) and len(running) <= slots[stage + 1]:
      stage += 1


def pool_seconds(lengths: list[int], slots: tuple[int, ...], cost) -> float:
  """The pool schedule, every step priced at its pool size."""
  return sum(cost(size) for size, _ in pool_steps(lengths, slots))


def idle_share(lengths: list[int], slots: tuple[int, ...]) -> float:
  """The share of the pool's columns (slots x steps) that hold no running sample: a stopped
  sample's slot until the next stage (what the weight products still multiply)."""
  steps = list(pool_steps(lengths, slots))
  return sum(size - running for size, running in steps) / sum(size for size, _ in steps)


def ideal_seconds(lengths: list[int], cost) -> float:
  lengths = np.asarray(lengths)
  return sum(cost(int(np.sum(lengths > s))) for s in range(int(lengths.max())))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="large", choices=("small", "large"))
  parser.add_argument("--rows", type=int, default=128)
  parser.add_argument("--max-new", type=int, default=1024)
  parser.add_argument("--stop-p", type=float, default=1 / 200)
  parser.add_argument("--decode-slots", type=int, default=64)
  parser.add_argument("--stages", type=int, default=SamplingParams().pool_stages)
  parser.add_argument("--pool", type=int, nargs="*", default=[],
                      help="other pool sizes to replay, largest first (e.g. 64 48 32 24 16 12 8)")
  parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
  parser.add_argument("--prompt", type=int, default=200, help="prompt slots in the timed caches")
  parser.add_argument("--steps", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--trials", type=int, default=20)
  args = parser.parse_args()

  slots = pool_sizes(args.rows, args.decode_slots, args.stages, min_slots=min_pool_slots("cpu"))
  other = tuple(args.pool)
  sizes = sorted(set(args.sizes) | set(slots) | set(other))  # every pool's own sizes measured
  step = step_seconds(args.model, sizes, args.prompt, args.max_new, args.steps, args.rounds)
  print(f"{args.model} (attention: {'the kernel' if cpu_attention.available() else 'XLA'}): "
        "ms per decode step by batch: "
        + ", ".join(f"{b}: {s * 1e3:.1f}" for b, s in step.items()))
  cost = price(step)
  rng = np.random.default_rng(0)
  pool, custom, ideal, tokens, idle = [], [], [], [], []
  for _ in range(args.trials):
    lengths = np.minimum(rng.geometric(args.stop_p, args.rows), args.max_new).tolist()
    tokens.append(sum(lengths))
    pool.append(pool_seconds(lengths, slots, cost))
    idle.append(idle_share(lengths, slots))
    custom.append(pool_seconds(lengths, other, cost) if other else 0.0)
    ideal.append(ideal_seconds(lengths, cost))
  print(f"{args.rows} rows, max {args.max_new} new tokens, ~{statistics.median(tokens):.0f} "
        f"tokens; medians of {args.trials} draws: pool {slots}: {statistics.median(pool):.1f} s"
        + (f", pool {other}: {statistics.median(custom):.1f} s" if other else "")
        + f", ideal (a batch of the running rows): {statistics.median(ideal):.1f} s; the pool's "
        f"columns without a running sample: {statistics.median(idle):.1%}")


if __name__ == "__main__":
  main()
