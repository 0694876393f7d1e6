"""Paged attention of one decode step (``rft_jax.models.decode.paged_kv.paged_attention``) by each kind
this backend runs, on long-tailed slot lengths: its distance from a float32 dense reference and
its time against the bytes it must read.

For each head shape (``--shapes``: Qwen2.5-0.5B's 14 query / 2 kv heads of 64, 7B's 28 / 4 of
128) and number of slots, the slots' lengths are drawn about geometrically (mean ``--mean``,
at most ``--max-len``), their pages scattered over a pool just large enough; every kind runs the
same bfloat16 query, pages and block tables. ``max |err|`` is against the XLA kind in float32;
``GB/s`` counts the live keys and values once (what a kernel that reads only the tokens that
exist must move), so it is comparable with the device's copy bandwidth.

    python benchmarks/accelerator/paged_attention.py --kinds xla pallas_gpu   # on a GPU
    python benchmarks/accelerator/paged_attention.py --kinds xla pallas_gpu_interpret --slots 8 \\
        --max-len 256 --repeats 1   # anywhere (Pallas' interpret mode: slow)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from rft_jax.models.decode.paged_kv import pages_for, paged_attention

SHAPES = {"0.5b": (14, 2, 64), "7b": (28, 4, 128)}  # query heads, kv heads, head width


def case(shape: str, slots: int, mean: int, max_len: int, page_size: int, rng):
  """A query, pages and block tables of ``slots`` slots with long-tailed lengths."""
  heads, kv_heads, h = SHAPES[shape]
  lengths = np.minimum(rng.geometric(1 / mean, slots), max_len).astype(np.int32)
  width = pages_for(max_len, page_size)
  used = sum(pages_for(int(n), page_size) for n in lengths)
  tables = np.zeros((slots, width), np.int32)
  order = rng.permutation(used + 8)  # pages scattered over the pool
  start = 0
  for s, n in enumerate(lengths):
    k = pages_for(int(n), page_size)
    tables[s, :k] = order[start:start + k]
    start += k
  pool = (kv_heads, used + 8, page_size, h)
  k = jnp.asarray(rng.normal(size=pool), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=pool), jnp.bfloat16)
  q = jnp.asarray(rng.normal(size=(slots, heads, h)), jnp.bfloat16)
  live_bytes = 2 * int(lengths.sum()) * kv_heads * h * 2  # keys and values, bfloat16
  return q, k, v, jnp.asarray(tables), jnp.asarray(lengths), live_bytes


def seconds(fn, args, repeats: int) -> float:
  """The best of ``repeats`` timed calls after a compiling one."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kinds", nargs="+", default=["xla", "pallas_gpu"])
  parser.add_argument("--shapes", nargs="+", default=["0.5b", "7b"], choices=sorted(SHAPES))
  parser.add_argument("--slots", type=int, nargs="+", default=[64, 256])
  parser.add_argument("--mean", type=int, default=1000)
  parser.add_argument("--max-len", type=int, default=8192)
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  print(f"{jax.devices()[0].device_kind}; pages of {args.page_size}, lengths ~ geometric(mean "
        f"{args.mean}) up to {args.max_len}", flush=True)
  print("| shape | slots | live tokens | kind | ms | GB/s of live K/V | max abs err |")
  print("|---|---|---|---|---|---|---|")
  for shape in args.shapes:
    for slots in args.slots:
      q, k, v, tables, lengths, live = case(shape, slots, args.mean, args.max_len,
                                            args.page_size, rng)
      f32 = [x.astype(jnp.float32) for x in (q, k, v)]
      reference = np.asarray(jax.jit(paged_attention)(*f32, tables, lengths))
      for kind in args.kinds:
        fn = jax.jit(lambda *a, kind=kind: paged_attention(*a, kind=kind))
        inputs = (q, k, v, tables, lengths)
        try:
          err = float(np.max(np.abs(np.asarray(fn(*inputs), np.float32) - reference)))
          ms = 1e3 * seconds(fn, inputs, args.repeats)
        except Exception as e:  # a kind this backend cannot run: say why, go on
          print(f"| {shape} | {slots} | {int(lengths.sum())} | {kind} | failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0][:200]} | | |", flush=True)
          continue
        print(f"| {shape} | {slots} | {int(lengths.sum())} | {kind} | {ms:.3f} | "
              f"{live / ms / 1e6:.1f} | {err:.2e} |", flush=True)


if __name__ == "__main__":
  main()
