"""How fast XLA:CPU multiplies at a decode step's shapes: GFLOP/s of ``weights @ activations``
(float32, feature-major as ``rft_jax.models.decode.feature_major`` decodes: ``[N, K] @ [K, rows]``) for
the peers' large model's products (the unembedding, the fused q/k/v, gate/up, down and output
projections) at ``--rows``, and of a 2048-square product for the machine's peak.

    python benchmarks/speed/cpu_products.py [--rows 64 128] [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# (name, N, K) of learner_step.MODELS["large"]: hidden 512, 8 + 2 x 4 heads of 64, MLP 1536.
PRODUCTS = (("unembed", 32768, 512), ("qkv", 1024, 512), ("gate_up", 3072, 512),
            ("down", 512, 1536), ("o", 512, 512))


def gflops(n: int, k: int, rows: int, rounds: int) -> float:
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.random((n, k)), jnp.float32)
  x = jnp.asarray(rng.random((k, rows)), jnp.float32)
  product = jax.jit(lambda w, x: w @ x)
  product(w, x).block_until_ready()
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    product(w, x).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n * k * rows / statistics.median(times) / 1e9


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--rounds", type=int, default=20)
  args = parser.parse_args()
  print(f"{os.cpu_count()} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"GFLOP/s, medians of {args.rounds}")
  print("| product | " + " | ".join(f"{r} rows" for r in args.rows) + " |")
  print("|---|" + "---|" * len(args.rows))
  for name, n, k in PRODUCTS:
    print(f"| {name} [{n}, {k}] | "
          + " | ".join(f"{gflops(n, k, r, args.rounds):.0f}" for r in args.rows) + " |")
  print(f"| square, 2048 | {gflops(2048, 2048, 2048, max(3, args.rounds // 4)):.0f} |")


if __name__ == "__main__":
  main()
