"""A CPU decode step's weight products at a few rows: the panel kernel
(``rft_jax.models.cpu_matmul``) against XLA's ``W @ h``, on the peers' ``--model`` shapes.

Every product of one decode step (each layer's stacked q/k/v, output, stacked gate/up and down
projections, then the unembedding; random float32 weights, all of them, so that they stream from
memory as in a step) multiplies ``[O, I]`` by ``h [I, B]`` for each batch ``B`` in ``--columns``;
the two contenders alternate round by round. The table gives milliseconds for the whole set
(median, min), the bandwidth over the weights' bytes, and the largest difference between the two
(relative to the largest output).

    python benchmarks/speed/cpu_matmul.py [--model large] [--columns 1 2 4 8 12 16] [--rounds 15]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from speed.learner_step import MODELS  # noqa: E402
from rft_jax.models import cpu_attention, cpu_matmul  # noqa: E402


def step_shapes(model: str) -> list[tuple[int, int]]:
  """The ``[O, I]`` weights one feature-major decode step of ``model`` multiplies by."""
  c = MODELS[model]
  d, f, h = c["hidden_size"], c["intermediate_size"], c["head_dim"]
  n, k = c["num_attention_heads"], c["num_key_value_heads"]
  layer = [((n + 2 * k) * h, d), (d, n * h), (2 * f, d), (d, f)]
  return layer * c["num_hidden_layers"] + [(c["vocab_size"], d)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="large", choices=tuple(MODELS))
  parser.add_argument("--columns", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args()
  cpu_attention.build()  # the library holds both kernels
  if not cpu_matmul.available():
    sys.exit(f"no panel product here: the library is built for {cpu_attention.target()}, the "
             "kernel needs x86-64-v3 (AVX2 and FMA)")
  rng = np.random.default_rng(0)
  shapes = step_shapes(args.model)
  weights = [jnp.asarray(rng.standard_normal(s, dtype=np.float32) / np.sqrt(s[1])) for s in shapes]
  packed = jax.jit(lambda ws: [cpu_matmul.panels(w) for w in ws])(weights)
  nbytes = sum(o * i * 4 for o, i in shapes)
  xla = jax.jit(lambda ws, h: [w @ h[:w.shape[1]] for w in ws])
  kernel = jax.jit(lambda ps, h: [cpu_matmul.matmul(p, h[:p.shape[1]], o)
                                  for p, (o, _) in zip(ps, shapes)])
  print(f"{args.model}: {len(shapes)} products, {nbytes / 2**20:.0f} MiB of float32 weights, "
        f"{os.cpu_count()} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  print("| columns | XLA ms (min) | XLA GB/s | kernel ms (min) | kernel GB/s | XLA / kernel | "
        "max diff |")
  print("|---|---|---|---|---|---|---|")
  widest = max(i for _, i in shapes)
  for b in args.columns:
    h = jnp.asarray(rng.standard_normal((widest, b), dtype=np.float32))
    runs = {"xla": (xla, weights), "kernel": (kernel, packed)}
    outs = {name: jax.block_until_ready(fn(w, h)) for name, (fn, w) in runs.items()}
    diff = max(float(jnp.max(jnp.abs(a - c)) / jnp.max(jnp.abs(a)))
               for a, c in zip(outs["xla"], outs["kernel"]))
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
      for name, (fn, w) in runs.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(w, h))
        times[name].append(time.perf_counter() - start)
    x, k = (statistics.median(times[n]) for n in ("xla", "kernel"))
    print(f"| {b} | {x * 1e3:.2f} ({min(times['xla']) * 1e3:.2f}) | {nbytes / x / 1e9:.1f} | "
          f"{k * 1e3:.2f} ({min(times['kernel']) * 1e3:.2f}) | {nbytes / k / 1e9:.1f} | "
          f"{x / k:.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
  main()
