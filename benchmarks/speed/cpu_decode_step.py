"""Where a CPU decode step of the continuous sampler spends its time, per row (issue 33).

The continuous sampler's CPU decode step (``rft_jax/sampling/continuous.py``) is
``feature_major.decode_step`` (with the attention kernel where it builds) followed by the
sampling strategy on the ``[V, B]`` logits. This script runs ``--steps`` of them in one compiled
``fori_loop`` over ``--rows`` rows whose caches hold a prompt of ``--prompt`` slots in a cache of
``cache_slots(prompt, --max-new)`` slots with one write index per row (the pool's cache, its keys
tiled as the pool holds them for the kernel), on the
peers' ``--model`` (``benchmarks/speed/learner_step.py``), at temperature 1 (the long-tailed works'
setting: no truncation). Each part is also timed alone, to split the step:

* ``step``: decode step + strategy (what the sampler runs);
* ``decode``: the decode step, its logits summed over the vocabulary instead of sampled;
* ``no unembed``: the decode step without the unembedding product (its last hidden state summed);
* ``strategy``: the strategy alone on fixed ``[V, B]`` logits (a different uniform per step);
* ``no attention``: the decode step + strategy with attention replaced by its queries.

It also prints the bytes of weights a step reads and, beside it, the machine's copy bandwidth:
at a few rows a step streams every weight from memory (the peers' large model: 160 MiB of
float32 weights, five times the L3 cache of the machine below). ``--model large --rows 1 --kinds
step`` (2026-11-27, 2 cores, load average 3 from a compile at low priority): 12.3 ms a step,
weights read at 13.7 GB/s, where numpy copies 30.4 GB/s (read + write); at 64 rows, 81.9 ms.

Contenders alternate round by round; the table gives milliseconds per step and per row (median
over rounds) in wall time and in process CPU time (both cores: a step that keeps two cores busy
shows about twice its wall time).

    python benchmarks/speed/cpu_decode_step.py [--model small] [--rows 64] [--steps 64] [--rounds 5]

To compare two checkouts, run it with ``PYTHONPATH`` set to each (a script's own directory, not
the working directory, comes first on ``sys.path``, so without it ``rft_jax`` is the installed
one). On 2026-11-26 (2 cores, AVX2, load average 6-13 from other work: CPU times, medians of 5
rounds, two runs each), ``--kinds step``, CPU ms per step before -> after the attention kernel's
register-wide vectors: 64 rows, prompt 48: 21.0 -> 16.0-16.4; 64 rows, prompt 256: 37.8-38.6 ->
19.1-23.1; 16 rows, prompt 700: 20.4-20.6 -> 10.7-12.6.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from speed.learner_step import build  # noqa: E402
from rft_jax.models.decode import cpu_attention, feature_major  # noqa: E402
from rft_jax.sampling.decoder import CPU_COMPILER_OPTIONS  # noqa: E402
from rft_jax.sampling.loop import cache_slots  # noqa: E402
from rft_jax.sampling.strategies import Strategy  # noqa: E402

STRATEGY = Strategy()  # temperature > 0, no truncation


def attention_fn(name: str):
  """The decode step's attention: ``kernel`` (built here where it is not, as ``rft-jax
  build-kernels`` does, an error without a C++ compiler; XLA's where it does not load), ``xla``
  or ``none`` (the queries)."""
  if name == "none":
    return lambda q, k, v, mask: q
  if name == "kernel":
    cpu_attention.build()
  if name == "xla" or not cpu_attention.available():
    return feature_major.attend
  return cpu_attention.attend


def loop(kind: str, steps: int, attention):
  """A compiled ``fori_loop`` of ``steps`` steps of ``kind``."""
  def run(graphdef, state, tokens, cache, uniforms, logits0):
    model = nnx.merge(graphdef, state)
    weights = feature_major.decode_weights(model)
    temperature = jnp.float32(1.0)

    def body(i, carry):
      tokens, cache, acc = carry
      u = uniforms[:, i]
      if kind == "strategy":
        logits = logits0 + i.astype(jnp.float32)  # not loop-invariant: computed every step
        new, logp = STRATEGY(logits, u, temperature, 0, 1.0, vocab_axis=0)
        return new, cache, acc + logp
      if kind == "no unembed":
        hidden, cache = decode_hidden(model, weights, tokens, cache, attention)
        return (tokens + 1) % model.config.vocab_size, cache, acc + jnp.sum(hidden, axis=0)
      logits, cache = feature_major.decode_step(model, weights, tokens, cache, attention)
      if kind == "decode":
        return (tokens + 1) % model.config.vocab_size, cache, acc + jnp.sum(logits, axis=0)
      new, logp = STRATEGY(logits, u, temperature, 0, 1.0, vocab_axis=0)
      return new, cache, acc + logp
    acc = jnp.zeros(tokens.shape, jnp.float32)
    _, cache, acc = jax.lax.fori_loop(0, steps, body, (tokens, cache, acc))
    return acc, cache  # the cache returned: updated in the donated buffers, not copied
  return jax.jit(run, static_argnums=0, donate_argnums=3, compiler_options=CPU_COMPILER_OPTIONS)


def decode_hidden(model, weights, tokens, cache, attention):
  """``feature_major.decode_step`` with an identity in place of the unembedding: ``[D, B]``."""
  eye = jnp.eye(model.config.hidden_size, dtype=weights.unembed.dtype)
  return feature_major.decode_step(model, weights.replace(unembed=eye), tokens, cache, attention)


def prefilled(model, rows: int, prompt: int, max_new: int, seed: int = 0, tiled: bool = False):
  """A pool-like cache: ``rows`` prompts of ``prompt`` tokens prefilled, one index per row;
  ``tiled``: its keys tiled, as the sampler's pool holds them for the attention kernel
  (``rft_jax.models.decode.cpu_attention.tile_keys``)."""
  rng = np.random.default_rng(seed)
  vocab = model.config.vocab_size
  ids = jnp.asarray(rng.integers(3, vocab, (rows, prompt)), jnp.int32)
  width = cache_slots(prompt, max_new)
  cache = model.init_cache(rows, cpu_attention.tiled_slots(width) if tiled else width)
  _, cache = nnx.jit(lambda m, i, c: m.prefill(i, jnp.ones_like(i), c))(model, ids, cache)
  cache = cache.replace(index=jnp.full((rows,), prompt, jnp.int32))
  if tiled:
    cache = cache.replace(k=tuple(map(cpu_attention.tile_keys, cache.k)))
  tokens = jnp.asarray(rng.integers(3, vocab, rows), jnp.int32)
  return tokens, cache


def timed(fn, graphdef, state, tokens, cache, *args) -> tuple[float, float]:
  """(wall s, process CPU s) of one blocked call on a fresh copy of ``cache`` (it is donated:
  the loop updates it in place, as the sampler's does)."""
  cache = jax.block_until_ready(jax.tree.map(jnp.copy, cache))
  wall, cpu = time.perf_counter(), time.process_time()
  jax.block_until_ready(fn(graphdef, state, tokens, cache, *args))
  return time.perf_counter() - wall, time.process_time() - cpu


def copy_bandwidth(nbytes: int = 2**29, rounds: int = 5) -> float:
  """Bytes per second (read + write) of the best of ``rounds`` numpy copies of ``nbytes``."""
  src = np.ones(nbytes // 4, np.float32)
  dst = np.empty_like(src)
  best = min(_timed_copy(src, dst) for _ in range(rounds))
  return 2 * nbytes / best


def _timed_copy(src, dst) -> float:
  start = time.perf_counter()
  np.copyto(dst, src)
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="small", choices=("small", "large"))
  parser.add_argument("--rows", type=int, default=64)
  parser.add_argument("--prompt", type=int, default=48)
  parser.add_argument("--max-new", type=int, default=1024)
  parser.add_argument("--steps", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--kinds", nargs="+",
                      default=["step", "decode", "no unembed", "strategy", "no attention"])
  parser.add_argument("--attention", default="kernel", choices=("kernel", "xla"))
  args = parser.parse_args()

  model = build(args.model)
  graphdef, state = nnx.split(model)
  attention_fn(args.attention)  # builds the kernel where it is not built
  kernel = args.attention == "kernel" and cpu_attention.available()
  tokens, cache = prefilled(model, args.rows, args.prompt, args.max_new, tiled=kernel)
  rng = np.random.default_rng(1)
  uniforms = jnp.asarray(rng.random((args.rows, args.steps)), jnp.float32)
  logits0 = jnp.asarray(rng.normal(size=(model.config.vocab_size, args.rows)), jnp.float32)
  runs = {kind: loop(kind if kind != "no attention" else "step", args.steps,
                     attention_fn("none" if kind == "no attention" else args.attention))
          for kind in args.kinds}
  call_args = (graphdef, state, tokens, cache, uniforms, logits0)
  for run in runs.values():
    timed(run, *call_args)
  times = {kind: [] for kind in runs}
  for _ in range(args.rounds):
    for kind, run in runs.items():
      times[kind].append(timed(run, *call_args))
  print(f"{args.model}, {args.rows} rows, prompt {args.prompt}, {args.steps} steps, "
        f"{os.cpu_count()} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
        f"attention: {'the kernel' if kernel else 'XLA'}")
  read = jax.eval_shape(lambda: feature_major.decode_weights(model))  # shapes, no copy
  weights = sum(x.size * x.dtype.itemsize  # all but the embedding table (a row a token)
                for x in jax.tree.leaves((read.layers, read.norm, read.unembed)))
  if "step" in times:
    step = statistics.median(w for w, _ in times["step"]) / args.steps
    print(f"a step reads {weights / 2**20:.0f} MiB of weights: {weights / step / 1e9:.1f} GB/s at "
          f"this batch; the machine copies {copy_bandwidth() / 1e9:.1f} GB/s (numpy, 512 MiB)")
  print("| part | wall ms/step | CPU ms/step | wall ms/row | CPU ms/row | min wall ms/step |")
  print("|---|---|---|---|---|---|")
  for kind, ts in times.items():
    wall = statistics.median(w for w, _ in ts) / args.steps * 1e3
    cpu = statistics.median(c for _, c in ts) / args.steps * 1e3
    low = min(w for w, _ in ts) / args.steps * 1e3
    print(f"| {kind} | {wall:.2f} | {cpu:.2f} | {wall / args.rows:.3f} | {cpu / args.rows:.3f} "
          f"| {low:.2f} |")


if __name__ == "__main__":
  main()
