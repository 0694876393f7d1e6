"""rft_jax alone on a long-tailed work of ``benchmarks/peers/longtail.py``: ``--calls`` calls of
``generate`` in one process after a compiling one, each call's seconds, tokens and ms a token.

The same seeds draw the same samples in every checkout whose sampler draws them alike, so two
checkouts compare call by call: run it with ``PYTHONPATH`` set to each (a script's own
directory, not the working directory, comes first on ``sys.path``, so without it ``rft_jax`` is
the installed one), alternated. Without vLLM or the peers' runners, it takes a third of
``longtail.py``'s time.

    PYTHONPATH=. python benchmarks/speed/longtail_calls.py [--model large] [--work longtail_128] [--decode-slots 64] [--calls 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import rft_jax  # noqa: E402
from peers.runners.spec import (LONGTAIL, build_checkpoint, longtail_prompts,  # noqa: E402
                                stop_token_ids)
from rft_jax.models import load_hf  # noqa: E402
from rft_jax.models.decode import cpu_attention  # noqa: E402
from rft_jax.sampling import SamplingParams, generate  # noqa: E402


def load_work(root: str, model_name: str, work: str, decode_slots: int):
  """``(model, prompts, params)`` of the long-tailed ``work`` on the peers' ``model_name``, its
  checkpoint written under ``root`` (which must outlive the model): the prompts, samples, stop
  ids and limit every contender of ``longtail.py`` gets, at temperature 1."""
  build_checkpoint(os.path.join(root, "checkpoint"), model_name)
  model = load_hf(os.path.join(root, "checkpoint"))
  vocab = model.config.vocab_size
  _, n, new = LONGTAIL[work]
  params = SamplingParams(n=n, max_new_tokens=new, temperature=1.0,
                          stop_token_ids=tuple(stop_token_ids(vocab)), decode_slots=decode_slots)
  return model, longtail_prompts(work, vocab), params


def add_work_arguments(parser: argparse.ArgumentParser) -> None:
  """``--model``, ``--work`` and ``--decode-slots``: what :func:`load_work` takes."""
  parser.add_argument("--model", default="large", choices=("small", "large"))
  parser.add_argument("--work", default="longtail_128", choices=sorted(LONGTAIL))
  parser.add_argument("--decode-slots", type=int, default=64)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_work_arguments(parser)
  parser.add_argument("--calls", type=int, default=3)
  args = parser.parse_args()
  cpu_attention.build()
  print(f"rft_jax from {os.path.dirname(rft_jax.__file__)}; {args.model}, {args.work}, "
        f"{args.decode_slots} slots; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')}",
        flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    model, work, params = load_work(tmp, args.model, args.work, args.decode_slots)
    start = time.perf_counter()
    generate(model, work, params, seed=10**6)  # compiles
    print(f"first call (compile) {time.perf_counter() - start:.1f} s", flush=True)
    for seed in range(args.calls):
      start = time.perf_counter()
      out = generate(model, work, params, seed=seed)
      seconds = time.perf_counter() - start
      tokens = int(np.asarray(out.completion_lengths).sum())
      print(f"seed {seed}: {seconds:.2f} s, {tokens} tokens, {seconds / tokens * 1e3:.3f} ms a "
            "token", flush=True)


if __name__ == "__main__":
  main()
