"""Peak temporary memory of token_stats, chunked vs naive, at real LLM sizes.

Compiles (never runs) the forward and the forward+backward of ``token_stats`` for
4096 positions x 151,936 vocabulary (Qwen2.5 / Qwen3), from float32 logits and from
bfloat16 hidden states (hidden size 3584, Qwen2.5-7B) with the unembedding matrix,
and prints XLA's ``memory_analysis()`` temporary bytes for each, on whatever backend
JAX runs on. (On CPU, XLA's bfloat16 normalisation converts a whole bfloat16 logits
input to float32 before the loop, so the logits path is measured from float32 logits;
the learner uses the hidden-state path.)

    python benchmarks/speed/token_stats_memory.py [--positions 4096] [--vocab 151936]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from rft_jax.entropy import token_stats


def temp_gb(fn, *args) -> float:
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**30


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--positions", type=int, default=4096)
  parser.add_argument("--vocab", type=int, default=151_936)
  parser.add_argument("--hidden", type=int, default=3584)
  parser.add_argument("--chunk", type=int, default=512)
  args = parser.parse_args()
  n, v, d = args.positions, args.vocab, args.hidden
  tokens = jax.ShapeDtypeStruct((n,), jnp.int32)
  logits = jax.ShapeDtypeStruct((n, v), jnp.float32)
  hidden = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  unembedding = jax.ShapeDtypeStruct((d, v), jnp.bfloat16)

  def from_logits(chunk):
    return lambda z, t: token_stats(z, t, chunk_size=chunk)

  def from_logits_grad(chunk):
    return jax.grad(lambda z, t: token_stats(z, t, chunk_size=chunk).logp.sum())

  def from_hidden(chunk):
    return lambda h, w, t: token_stats(h, t, unembedding=w, chunk_size=chunk)

  def from_hidden_grad(chunk):
    loss = lambda h, w, t: token_stats(h, t, unembedding=w, chunk_size=chunk).logp.sum()
    return jax.grad(loss, argnums=(0, 1))

  print(f"token_stats temporaries, {n} positions x {v} vocab, chunk {args.chunk} "
        f"(one full float32 [positions, V] tensor = {n * v * 4 / 2**30:.2f} GiB)")
  print(f"{'path':<34} {'naive GiB':>10} {'chunked GiB':>12} {'ratio':>7}")
  cases = [
      ("logits (f32) forward", from_logits, (logits, tokens)),
      ("logits (f32) forward+backward", from_logits_grad, (logits, tokens)),
      (f"hidden {d} + unembedding forward", from_hidden, (hidden, unembedding, tokens)),
      (f"hidden {d} + unembedding fwd+bwd", from_hidden_grad, (hidden, unembedding, tokens)),
  ]
  for name, make, shapes in cases:
    naive, chunked = temp_gb(make(None), *shapes), temp_gb(make(args.chunk), *shapes)
    print(f"{name:<34} {naive:>10.2f} {chunked:>12.2f} {naive / chunked:>6.1f}x")


if __name__ == "__main__":
  main()
