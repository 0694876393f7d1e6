"""Float32 error of ``token_stats`` against float64, by vocabulary, beside verl's and TRL's entropy.

The setting of issue 59: float32 logits drawn N(0, 2) per entry (numpy seed 0), ``--positions``
positions (256 up to a vocabulary of 4,096, 32 above unless given) and random sampled tokens;
``token_stats``' autodiff reference (``chunk_size=None``) and chunks of 8 positions (the multi-chunk
path the learner takes at scale), under jit; the largest absolute error over the positions of
log p, H, S_* and E_p[S] against the float64 values of the same float32 logits. Beside them the
entropy of verl 0.9.1's and TRL 1.16.0's float32 ``entropy_from_logits`` (transcribed in
``tests/test_token_stats_precision.py``, where the suite holds these bounds) on the same logits.

    python benchmarks/precision/token_stats_error.py [--vocab 64 4096 32768 151936] [--positions N]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo
from benchmarks.precision.vocab_reductions import ref_stats  # noqa: E402
from rft_jax.entropy import token_stats  # noqa: E402
from tests.test_token_stats_precision import trl_entropy_from_logits  # noqa: E402
from tests.test_token_stats_precision import verl_entropy_from_logits  # noqa: E402

STATS = ("logp", "entropy", "s_star", "expected_s")


def errors(vocab: int, positions: int) -> dict[str, list[float]]:
  rng = np.random.default_rng(0)
  z = (2 * rng.standard_normal((positions, vocab))).astype(np.float32)
  tokens = rng.integers(0, vocab, positions)
  ref = ref_stats(z)
  rows = np.arange(positions)
  log_pk = ref["logp"][rows, tokens]
  want = (log_pk, ref["h"], np.exp(log_pk) * (ref["h"] + log_pk), ref["e_s"])
  out = {}
  for name, chunk in (("reference", None), ("chunks of 8", 8)):
    got = jax.jit(lambda z, t, c=chunk: token_stats(z, t, chunk_size=c))(jnp.asarray(z), jnp.asarray(tokens, jnp.int32))
    out[name] = [float(np.abs(np.asarray(getattr(got, s), np.float64) - w).max()) for s, w in zip(STATS, want)]
  for name, fn in (("verl", verl_entropy_from_logits), ("TRL", trl_entropy_from_logits)):
    out[name] = [float(np.abs(np.asarray(fn(torch.from_numpy(z)), np.float64) - ref["h"]).max())]
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocab", type=int, nargs="+", default=[64, 4096, 32_768, 151_936])
  parser.add_argument("--positions", type=int, default=None)
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; torch {torch.__version__}; "
        "max |error| against float64")
  print("| vocabulary | path | H | log p_k | S_* | E_p[S] | verl H | TRL H |")
  print("|---|---|---|---|---|---|---|---|")
  for vocab in args.vocab:
    positions = args.positions or (256 if vocab <= 4096 else 32)
    out = errors(vocab, positions)
    for path in ("reference", "chunks of 8"):
      logp, h, s_star, expected_s = out[path]
      peers = f"{out['verl'][0]:.1e} | {out['TRL'][0]:.1e}" if path == "reference" else " | "
      print(f"| {vocab:,} ({positions} positions) | {path} | {h:.1e} | {logp:.1e} | {s_star:.1e} | "
            f"{expected_s:.1e} | {peers} |", flush=True)


if __name__ == "__main__":
  main()
