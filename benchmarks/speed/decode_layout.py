"""The CPU decode step, row-first against feature-major (what ``rft_jax.models.decode.feature_major``
rests on), on the peers' models (``benchmarks/speed/learner_step.py`` ``MODELS``, random weights).

Each contender runs ``--steps`` decode steps of ``--rows`` rows in one compiled ``fori_loop``
over the same prefilled cache of ``--slots`` slots, and the contenders alternate round by
round (same machine load); the table gives milliseconds per step (median, min):

* ``row-first``: ``Qwen.decode_step`` with its layers sliced once, outside the loop
  (``[B, D] x [D, out]`` products, the GPU / TPU form; ``[B, V]`` logits);
* ``feature-major``: ``feature_major.decode_step`` with its weights made once, outside the loop
  (``[out, D] x [D, B]`` products, ``[V, B]`` logits, elementwise attention scores);
* ``feature-major, dot scores``: the same with the scores as a batched matrix product
  (``attend_cache``), to isolate the attention change;
* ``feature-major, scores summed term by term``: the scores as 64 products added pairwise (an
  elementwise fusion, which XLA:CPU splits over the cores; the sum over ``H`` is a reduction,
  which runs on one);
* ``feature-major, no attention``: attention replaced by its queries (XLA then drops the cache
  writes too): the step's cost without attention, to size it.

    python benchmarks/speed/decode_layout.py [--model large] [--rows 32] [--slots 176] [--steps 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from speed.learner_step import build  # noqa: E402
from rft_jax.models import attention  # noqa: E402
from rft_jax.models.decode import cpu_attention, feature_major  # noqa: E402
from rft_jax.models.attention import MASKED_SCORE  # noqa: E402


def dot_scores(q, k_cache, v_cache, mask):
  """``feature_major.attend`` with the scores as ``attend_cache``'s batched product."""
  b, k, g, h = q.shape
  out = attention.attend_cache(q.reshape(b, 1, k * g, h), k_cache, v_cache, mask[:, None])
  return out.reshape(b, k, g, h)


def decode_loop(prepare, step, vocab_axis: int, steps: int):
  """A compiled ``fori_loop`` of ``steps`` greedy decode steps; ``prepare(m)`` runs once, before
  the loop (the feature-major weights), ``step(m, prepared, tokens, cache)`` in it."""
  @nnx.jit
  def run(m, tokens, cache):
    prepared = prepare(m)

    def body(i, carry):
      tokens, cache = carry
      logits, cache = step(m, prepared, tokens, cache)
      return jnp.argmax(logits, axis=vocab_axis).astype(jnp.int32), cache
    return jax.lax.fori_loop(0, steps, body, (tokens, cache))[0]
  return run


def pairwise_scores(q, k_cache, v_cache, mask):
  """``feature_major.attend`` with the scores summed over ``H`` as ``H`` products added pairwise."""
  terms = [q[:, :, :, i, None] * k_cache[:, :, None, i, :] for i in range(q.shape[-1])]
  while len(terms) > 1:
    terms = [terms[i] + terms[i + 1] for i in range(0, len(terms), 2)]
  scores = jnp.where(mask[:, None, None, :], terms[0] * q.shape[-1] ** -0.5, MASKED_SCORE)
  return jnp.einsum("bkgs,bksh->bkgh", jax.nn.softmax(scores, axis=-1), v_cache)


def no_attention(q, k_cache, v_cache, mask):
  return q


def contenders(steps: int) -> dict:
  """name -> compiled loop."""
  rows = decode_loop(lambda m: m.unstacked_layers(),
                     lambda m, layers, tokens, cache: m.decode_step(tokens, cache, layers=layers),
                     -1, steps)
  def features(attention):
    return decode_loop(feature_major.decode_weights,
                       lambda m, w, tokens, cache: feature_major.decode_step(
                           m, w, tokens, cache, attention=attention), 0, steps)
  runs = {"row-first": rows,
          "feature-major": features(feature_major.attend),
          "feature-major, dot scores": features(dot_scores),
          "feature-major, scores summed term by term": features(pairwise_scores),
          "feature-major, no attention": features(no_attention)}
  if cpu_attention.available():
    runs["feature-major, attention kernel"] = features(cpu_attention.attend)
  return runs


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="large", choices=("small", "large"))
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--slots", type=int, default=176, help="cache slots (prompt 48 + 128 new)")
  parser.add_argument("--prompt", type=int, default=48)
  parser.add_argument("--steps", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()

  model = build(args.model)
  rng = np.random.default_rng(0)
  vocab = model.config.vocab_size
  ids = jnp.asarray(rng.integers(3, vocab, (args.rows, args.prompt)), jnp.int32)
  cache = model.init_cache(args.rows, args.slots)
  _, cache = nnx.jit(lambda m, i, c: m.prefill(i, jnp.ones_like(i), c))(model, ids, cache)
  tokens = jnp.asarray(rng.integers(3, vocab, args.rows), jnp.int32)
  runs = contenders(args.steps)
  for run in runs.values():  # compile
    jax.block_until_ready(run(model, tokens, cache))
  times = {name: [] for name in runs}
  for _ in range(args.rounds):
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run(model, tokens, cache))
      times[name].append((time.perf_counter() - start) / args.steps * 1e3)
  print(f"{args.model}, {args.rows} rows, {args.slots} slots, {os.cpu_count()} cores, "
        f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  print("| decode step | median ms | min ms |\n|---|---|---|")
  for name, ts in times.items():
    print(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f} |")


if __name__ == "__main__":
  main()
