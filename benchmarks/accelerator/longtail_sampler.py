"""The sampler alone on long-tailed lengths, in one process: continuous batching against the
static program, on any device (the GPU figures of issue 33; on CPU, ``benchmarks/peers/longtail.py``
also runs vLLM).

A random model of a preset's shapes (``benchmarks/speed/sampler.py``'s ``PRESETS``: Qwen2.5-0.5B,
1.5B, ...; compute in ``--dtype``), ``--prompts`` prompts of 16-48 random tokens x ``--n``
samples, temperature 1, at most ``--max-new`` new tokens, ending at any of ``vocab /
--stop-every`` stop ids (the nearly uniform next-token distribution of a random model makes
lengths about geometric; the mean length is printed). ``--fixed``: no stop ids, every row runs
``--max-new`` tokens (a decode step's cost: seconds / max-new). Each setting (``static``, or
``continuous:SLOTS``, SLOTS ``-`` for one slot per row) compiles on a first call, then the
settings take turns for ``--rounds`` rounds; the table gives each one's median seconds and
tokens per second. ``paged:SLOTS:PAGES[:KIND]`` decodes on a paged KV cache of ``PAGES`` pages
of 16 tokens with paged attention ``KIND`` (``auto``: the platform's Pallas kernel; ``xla``).

    python benchmarks/accelerator/longtail_sampler.py --preset 0.5b --prompts 16 --n 8 --max-new 1024 \\
        --settings static continuous:- continuous:64 paged:64:4096 paged:64:4096:xla
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
from speed.sampler import PRESETS  # noqa: E402
from rft_jax.models import Qwen  # noqa: E402
from rft_jax.sampling import SamplingParams, generate  # noqa: E402


def setting_params(setting: str, base: SamplingParams) -> SamplingParams:
  """``static``, ``continuous:SLOTS`` or ``paged:SLOTS:PAGES[:KIND]`` as sampler parameters."""
  parts = setting.split(":")
  scheduler, slots, pages, kind = parts + ["-", "-", "auto"][len(parts) - 1:]
  fields = {"scheduler": "continuous" if scheduler == "paged" else scheduler,
            "decode_slots": None if slots == "-" else int(slots)}
  if scheduler == "paged":
    fields.update(kv_pages=int(pages), paged_attention=kind)
  return SamplingParams(**{**base.__dict__, **fields})


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="0.5b")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--n", type=int, default=8)
  parser.add_argument("--max-new", type=int, default=1024)
  parser.add_argument("--stop-every", type=int, default=200)
  parser.add_argument("--fixed", action="store_true", help="no stop ids: every row runs max-new")
  parser.add_argument("--settings", nargs="+", default=["static", "continuous:-"])
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)
  config = PRESETS[args.preset](dtype=dtype, param_dtype=dtype)
  model = Qwen(config, rngs=nnx.Rngs(0))
  vocab = config.vocab_size
  rng = np.random.default_rng(2)
  prompts = [rng.integers(3, vocab, rng.integers(16, 49)).tolist() for _ in range(args.prompts)]
  stops = () if args.fixed else tuple(range(2, 2 + vocab // args.stop_every))
  base = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new,
                        stop_token_ids=stops)
  print(f"{args.preset} ({args.dtype}) on {jax.devices()[0].device_kind}: {args.prompts} prompts "
        f"x {args.n}, max {args.max_new} new tokens, {len(stops)} stop ids", flush=True)
  results = {s: {"first": None, "runs": []} for s in args.settings}
  for rnd in range(args.rounds + 1):
    for setting in args.settings:
      start = time.perf_counter()
      out = generate(model, prompts, setting_params(setting, base), seed=rnd)
      seconds = time.perf_counter() - start
      tokens = int(out.completion_lengths.sum())
      if rnd == 0:
        results[setting]["first"] = seconds
      else:
        results[setting]["runs"].append((seconds, tokens, float(out.completion_lengths.mean()),
                                         int(out.completion_lengths.max())))
      print(f"round {rnd} {setting}: {seconds:.2f} s, {tokens} tokens", flush=True)
  print("\n| setting | median s | tokens/s | mean length | longest | first call s |")
  print("|---|---|---|---|---|---|")
  for setting, r in results.items():
    seconds = statistics.median(s for s, *_ in r["runs"])
    rate = statistics.median(t / s for s, t, *_ in r["runs"])
    print(f"| {setting} | {seconds:.2f} | {rate:.0f} | {r['runs'][-1][2]:.0f} | "
          f"{r['runs'][-1][3]} | {r['first']:.1f} |")


if __name__ == "__main__":
  main()
