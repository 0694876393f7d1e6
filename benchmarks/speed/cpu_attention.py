"""One layer's decode attention on CPU: the compiled kernel (``rft_jax.models.decode.cpu_attention``)
against ``feature_major.attend`` (XLA), on the peers' large model's attention shapes.

A cache of ``--slots`` slots per row (keys ``[B, K, H, S]``, values ``[B, K, S, H]``, float32)
holds left-padded prompts of 16-48 tokens in its first 48 slots and ``--live`` generated
tokens after them; each contender attends one query per row over it, ``--layers`` separate
caches per call (so that, as in a decode step, they are not all in the CPU's caches; each
layer's query takes the last one's output, so that XLA runs them one after another as in a
step), and the two alternate round by round. The table gives milliseconds per layer (median, min) and the
bandwidth over the bytes of the live slots (what the kernel reads; XLA reads every slot). Where
``--slots`` is a multiple of 64 the kernel is also timed on the same keys tiled, as the continuous
pool holds them (``cpu_attention.tile_keys``).

    python benchmarks/speed/cpu_attention.py [--rows 32] [--slots 176] [--live 64] [--layers 8]

``--against SOURCE.cc`` also builds another version of the kernel's source (as ``rft-jax
build-kernels`` builds it) and times it in the same rounds, printing how far its outputs are
from the kernel's; e.g. against the last commit's kernel::

    git show HEAD~1:rft_jax/models/decode/cpu_attention.cc > /tmp/before.cc
    python benchmarks/speed/cpu_attention.py --rows 8 --slots 1072 --live 560 \
        --against /tmp/before.cc
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from rft_jax.models.decode import cpu_attention, feature_major

KV_HEADS, GROUP, HEAD_DIM, PROMPT = 4, 2, 64, 48  # learner_step.MODELS["large"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--slots", type=int, default=176)
  parser.add_argument("--live", type=int, default=64, help="generated tokens so far")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--against", help="another version of rft_jax/models/decode/cpu_attention.cc")
  args = parser.parse_args()
  if not cpu_attention.available():
    raise SystemExit("the kernel is not built here (the log above says why)")

  rng = np.random.default_rng(0)
  b, s = args.rows, args.slots
  q = jnp.asarray(rng.standard_normal((b, KV_HEADS, GROUP, HEAD_DIM)), jnp.float32)
  keys = [jnp.asarray(rng.standard_normal((b, KV_HEADS, HEAD_DIM, s)), jnp.float32)
          for _ in range(args.layers)]
  values = [jnp.asarray(rng.standard_normal((b, KV_HEADS, s, HEAD_DIM)), jnp.float32)
            for _ in range(args.layers)]
  lengths = rng.integers(16, PROMPT + 1, b)
  slots = np.arange(s)[None]
  mask = jnp.asarray(((slots >= PROMPT - lengths[:, None]) & (slots < PROMPT))
                     | ((slots >= PROMPT) & (slots < PROMPT + args.live)))
  live_bytes = 2 * KV_HEADS * HEAD_DIM * 4 * int(lengths.sum() + b * args.live)

  def per_layer(attend):  # each layer's query depends on the last one's output, as in a step
    def layers(q, ks, vs, m):
      outs = []
      for k, v in zip(ks, vs):
        outs.append(attend(q, k, v, m))
        q = q + 1e-3 * outs[-1]
      return outs
    return jax.jit(layers)

  runs = {"XLA (feature_major.attend)": (per_layer(feature_major.attend), keys),
          "kernel (cpu_attention.attend)": (per_layer(cpu_attention.attend), keys)}
  if s % cpu_attention.KEY_TILE == 0:  # the continuous pool's layout
    runs["kernel, keys tiled (tile_keys)"] = (per_layer(cpu_attention.attend),
                                              [cpu_attention.tile_keys(k) for k in keys])
  if args.against:
    against = per_layer(other_kernel(args.against))
    runs[f"kernel from {args.against}"] = (against, keys)
    if s % cpu_attention.KEY_TILE == 0:
      runs[f"kernel from {args.against}, keys tiled"] = (
          against, [cpu_attention.tile_keys(k) for k in keys])
  outs = {name: jax.block_until_ready(run(q, ks, values, mask))
          for name, (run, ks) in runs.items()}
  xla, kernel, *other = outs.values()
  np.testing.assert_allclose(kernel, xla, rtol=2e-5, atol=2e-6)
  for name, out in zip(list(runs)[2:], other):
    print(f"{name}: outputs differ from the kernel's by at most "
          f"{max(float(np.max(np.abs(a - b))) for a, b in zip(out, kernel)):.2e}")
  times = {name: [] for name in runs}
  for _ in range(args.rounds):
    for name, (run, ks) in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run(q, ks, values, mask))
      times[name].append((time.perf_counter() - start) / args.layers * 1e3)
  print(f"{b} rows, {s} slots, {args.live} generated, {args.layers} layers, "
        f"{os.cpu_count()} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  print("| attention | median ms / layer | min ms | GB/s of live slots |\n|---|---|---|---|")
  for name, ts in times.items():
    median = statistics.median(ts)
    print(f"| {name} | {median:.3f} | {min(ts):.3f} | {live_bytes / median / 1e6:.1f} |")


def other_kernel(source: str):
  """``cpu_attention.attend`` by the kernel built from ``source``, registered under its own
  name."""
  library = os.path.join(tempfile.mkdtemp(), "against.so")
  cpu_attention.compile_library(source, library)
  cpu_attention.register(library, "rft_jax_decode_attention_against")
  return functools.partial(cpu_attention.attend_by, "rft_jax_decode_attention_against")


if __name__ == "__main__":
  main()
