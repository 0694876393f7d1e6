"""Where a long-tailed CPU rollout call spends its time: one ``generate`` of a long-tailed work
of ``benchmarks/peers/longtail.py`` (the peers' ``--model``, ``--work``, ``--decode-slots``)
timed, then traced with ``jax.profiler`` (the same samples; a compiling call first), its XLA
operations summed by kind.

Kinds: ``products`` (``dot`` and the fusions XLA hands to its matrix library, ``ynn_fusion``),
``attention`` (the CPU kernel's custom call, ``ffi_call``), ``cache writes`` (``scatter``) and
everything else. Each operation is counted on the thread that ran it; a kernel that splits its
work over the intra-op pool counts once, for its wall time on the calling thread.

    python benchmarks/speed/longtail_trace.py [--model large] [--work longtail_128] [--decode-slots 64]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from rft_jax.models.decode import cpu_attention  # noqa: E402
from rft_jax.sampling import generate  # noqa: E402
from speed.longtail_calls import add_work_arguments, load_work  # noqa: E402

KINDS = (("products", ("dot", "ynn_fusion")), ("attention", ("ffi_call",)),
         ("cache writes", ("wrapped_scatter",)))


def kind_of(name: str) -> str:
  return next((kind for kind, prefixes in KINDS if name.startswith(prefixes)), "other")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_work_arguments(parser)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  cpu_attention.build()
  with tempfile.TemporaryDirectory() as tmp:
    model, work, params = load_work(tmp, args.model, args.work, args.decode_slots)
    generate(model, work, params, seed=args.seed + 1)  # compiles
    start = time.perf_counter()
    out = generate(model, work, params, seed=args.seed)
    wall = time.perf_counter() - start
    with jax.profiler.trace(os.path.join(tmp, "trace"), create_perfetto_trace=True):
      generate(model, work, params, seed=args.seed)  # the same samples, traced
    path = glob.glob(os.path.join(tmp, "trace", "**", "*.trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
      events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
  seconds, calls = collections.Counter(), collections.Counter()
  for e in events:
    if e["name"].startswith(("Thunk", "$", "Slinky", "Pjit", "while", "Common", "Parse")):
      continue  # the executor's own spans, which hold the operations
    seconds[kind_of(e["name"])] += e["dur"] / 1e6
    calls[kind_of(e["name"])] += 1
  tokens = int(np.asarray(out.completion_lengths).sum())
  print(f"{args.model}, {args.work}, {args.decode_slots} slots: {wall:.1f} s untraced, {tokens} "
        f"tokens; attention {'the kernel' if cpu_attention.available() else 'XLA'}")
  print("| kind | seconds | operations |\n|---|---|---|")
  for kind in [k for k, _ in KINDS] + ["other"]:
    print(f"| {kind} | {seconds[kind]:.2f} | {calls[kind]} |")


if __name__ == "__main__":
  main()
