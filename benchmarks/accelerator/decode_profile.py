"""Where a GPU decode step's time goes: a profile of one ``generate`` call, summarised by kernel.

Builds a random bfloat16 model of a preset's shapes (benchmarks/speed/sampler.py's ``PRESETS``),
runs ``generate`` for ``--batch`` prompts of ``--prompt`` tokens and ``--new-tokens`` new tokens
twice (compile, warm up), then once under ``jax.profiler.trace`` and reads the trace back
(``jax.profiler.ProfileData``): per device stream, the kernels launched, their summed time and the
span from the first start to the last end; then the kernels by name (count per decode step,
microseconds per step, mean microseconds per launch). Kernel time well under the span means the
device waits between kernels (launches); many short kernels per step means fixed costs per kernel
dominate. Also measures the device copy bandwidth with torch (read + write), for the bound.

    python benchmarks/accelerator/decode_profile.py --preset 0.5b --batch 64 [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from speed.sampler import (  # noqa: E402
    PRESETS, add_decode_shape_arguments, make_prompts, torch_copy_gbps)
from rft_jax.models import Qwen  # noqa: E402
from rft_jax.sampling import SamplingParams, generate  # noqa: E402


def summarise(path: str, steps: int, top: int, unit: str = "decode step") -> None:
  """Prints the trace at ``path`` by GPU stream and by kernel name, per ``unit`` (``steps`` of
  them in the trace)."""
  profile = jax.profiler.ProfileData.from_file(path)
  by_name = {"kernels": collections.defaultdict(lambda: [0, 0]),  # name -> [count, ns]
             "XLA ops": collections.defaultdict(lambda: [0, 0])}
  for plane in profile.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      events = list(line.events)
      if not events:
        continue
      busy = sum(e.duration_ns for e in events)
      span = max(e.start_ns + e.duration_ns for e in events) - min(e.start_ns for e in events)
      print(f"{plane.name} / {line.name}: {len(events)} events ({len(events) / steps:.1f} a "
            f"{unit}), busy {busy / 1e6:.2f} ms of a {span / 1e6:.2f} ms span ({busy / span:.0%})")
      table = ("kernels" if line.name.startswith("Stream") else
               "XLA ops" if line.name.startswith("XLA Ops") else None)
      for e in events if table else ():
        name = re.sub(r"[._]?\d+$", "", e.name.split("(")[0])[:60]
        by_name[table][name][0] += 1
        by_name[table][name][1] += e.duration_ns
  for table, counts in by_name.items():
    total = sum(ns for _, ns in counts.values()) or 1
    print(f"\n{table}: {sum(c for c, _ in counts.values()) / steps:.0f} a {unit}, "
          f"{total / steps / 1e3:.0f} us a {unit}; top {top} by time (per {unit}):")
    for name, (count, ns) in sorted(counts.items(), key=lambda kv: -kv[1][1])[:top]:
      print(f"  {name:<60} {count / steps:6.1f} x {ns / count / 1e3:7.1f} us = "
            f"{ns / steps / 1e3:7.1f} us ({ns / total:5.1%})")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_decode_shape_arguments(parser)
  parser.add_argument("--top", type=int, default=30)
  parser.add_argument("--out", default=None, help="keep the trace here (default: a temporary dir)")
  args = parser.parse_args()
  gbps = torch_copy_gbps()
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); torch copy "
        f"{'n/a' if gbps is None else f'{gbps:.0f} GB/s'} (read + write)", flush=True)
  config = PRESETS[args.preset](dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  model = Qwen(config, rngs=nnx.Rngs(0))
  prompts = make_prompts(args.batch, config.vocab_size, args.prompt, args.prompt)
  params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
  for seed in range(2):
    start = time.perf_counter()
    generate(model, prompts, params, seed=seed)
    print(f"call {seed}: {time.perf_counter() - start:.2f} s", flush=True)
  root = args.out or tempfile.mkdtemp()
  with jax.profiler.trace(root):
    start = time.perf_counter()
    generate(model, prompts, params, seed=2)
    wall = time.perf_counter() - start
  print(f"profiled call: {wall * 1e3:.1f} ms wall ({wall / args.new_tokens * 1e3:.3f} ms per new "
        f"token, prefill included)")
  summarise(glob.glob(f"{root}/**/*.xplane.pb", recursive=True)[0], args.new_tokens - 1, args.top)


if __name__ == "__main__":
  main()
