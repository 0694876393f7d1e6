"""Issue 16's before/after figures: Clip_V on a small batch, and token_stats under jit.

  python benchmarks/analysis/fidelity_figures.py
  git worktree add /tmp/before 581e3af && PYTHONPATH=/tmp/before python benchmarks/analysis/fidelity_figures.py

1. Tokens Clip_V masks (released defaults: mu_low 8.5, max_frac 1e-4) on a 5,000-token batch
   with one extreme negative-sample token: the authors' code masks 1.
2. At near one-hot positions, under ``jax.jit`` with T = 0.7 and 1.3, chunked and not: the
   smallest entropy (must be >= 0), the largest log p (must be <= 0) and the worst relative
   error of S_* against float64.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rft_jax import entropy as E


def clip_v_on_a_small_batch() -> int:
  rng = np.random.default_rng(0)
  s = rng.normal(0, 1e-3, (50, 100)).astype(np.float32)
  adv = np.repeat(rng.choice([-1.0, 1.0], (50, 1)), 100, 1).astype(np.float32)
  s[int(np.flatnonzero(adv[:, 0] < 0)[0]), 7] = -1.0  # ~1000 standard deviations below 0
  keep = E.clip_v_mask(jnp.asarray(s), jnp.asarray(adv), jnp.ones_like(s, bool))
  return int((~np.asarray(keep)).sum())


def confident_positions(seed: int = 0, n: int = 512, vocab: int = 1000):
  rng = np.random.default_rng(seed)
  z = rng.normal(size=(n, vocab)).astype(np.float32)
  top = rng.integers(0, vocab, n)
  z[np.arange(n), top] += rng.uniform(15, 40, n).astype(np.float32)
  token = np.where(rng.random(n) < 0.8, top, rng.integers(0, vocab, n)).astype(np.int32)
  return z, token, top


def float64_s_star(z, token, temperature):
  x = z.astype(np.float64) / temperature
  logp = x - x.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  h = -(np.exp(logp) * logp).sum(-1)
  lpk = np.take_along_axis(logp, token[:, None], -1)[:, 0]
  return np.exp(lpk) * (h + lpk)


@functools.partial(jax.jit, static_argnames=("chunk",))
def jitted_stats(z, token, temperature, chunk):
  return E.token_stats(z, token, temperature=temperature, chunk_size=chunk)


def main() -> None:
  print(f"Clip_V, 5,000 valid tokens, one extreme negative-sample token: {clip_v_on_a_small_batch()} masked")
  z, token, top = confident_positions()
  confident = token == top
  for temperature in (0.7, 1.3):
    reference = float64_s_star(z, token, temperature)
    for chunk in (None, 64):
      stats = jitted_stats(jnp.asarray(z), jnp.asarray(token), temperature, chunk)
      s_star = np.asarray(stats.s_star, np.float64)
      rel = (np.abs(s_star - reference) / np.maximum(np.abs(reference), 1e-300))[confident]
      print(f"T={temperature} chunk={chunk}: min H {float(np.min(stats.entropy)):.3g}, "
            f"max log p {float(np.max(stats.logp)):.3g}, worst relative S_* error {rel.max():.3g}")


if __name__ == "__main__":
  main()
