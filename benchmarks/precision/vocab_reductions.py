"""Float32 error of every reduction over the vocabulary outside ``token_stats``, against float64.

Each row calls the project's own function (the sampler's strategies, ``rft_jax.entropy``'s
``discriminator`` and ``dynamics`` functions, the fused decode step in Pallas' interpret mode
followed by its sampling) on the same float32 logits, ``2 * N(0, 1)`` per entry (the tests'
scale), ``--rows`` positions x ``--vocab`` entries, numpy seed 0, and compares the result with
the same quantity computed in float64 by numpy from those float32 logits. It prints a markdown
table: the largest absolute error over the rows, the quantity's typical magnitude (the median
over rows of its absolute value; for ``[rows, V]`` outputs, as the row says) and that error in
float32 ulps of the magnitude. A sequential sum over V shows as an error growing about linearly
with V, to hundreds of ulps at 151,936; a blocked or pairwise one stays within a few ulps.

The top-p cumulative sum is internal to ``strategies.truncate``: it is read off the traced
program of ``truncate`` itself (the ``cumsum`` equation's output added to the outputs), not
re-implemented. ``evaluate``'s answer entropy, the attribution page, ``sft`` and the learner reduce
over the vocabulary only through ``token_stats``, which is measured elsewhere.

    python benchmarks/precision/vocab_reductions.py [--vocab 151936] [--rows 32] [--no-fused]
"""

from __future__ import annotations

import argparse
import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jex_core

from rft_jax.entropy import dynamics
from rft_jax.models import Qwen, QwenConfig
from rft_jax.models.decode import fused_decode
from rft_jax.sampling import strategies

TOP_P = 0.95
# The module (the package re-exports its function ``discriminator`` under the same name).
disc = importlib.import_module("rft_jax.entropy.discriminator")


# ---------------------------------------------------------------------------------------------
# float64 references (numpy), from the float32 logits.

def ref_log_softmax(z: np.ndarray) -> np.ndarray:
  z = z.astype(np.float64)
  m = z.max(-1, keepdims=True)
  return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def ref_stats(z: np.ndarray) -> dict[str, np.ndarray]:
  logp = ref_log_softmax(z)
  p = np.exp(logp)
  h = -(p * logp).sum(-1)
  s = p * (h[:, None] + logp)
  return {"logp": logp, "p": p, "h": h, "s": s, "e_s": (p * s).sum(-1)}


def ref_inversion(z: np.ndarray, u: np.ndarray) -> np.ndarray:
  """The token the inversion of ``u`` picks under ``softmax(z)`` in float64."""
  w = np.exp(z.astype(np.float64) - z.max(-1, keepdims=True))
  cdf = np.cumsum(w, -1)
  return np.minimum((cdf <= (u * cdf[:, -1])[:, None]).sum(-1), z.shape[-1] - 1)


# ---------------------------------------------------------------------------------------------
# Rows.

def ulps(err: float, mag: float) -> float:
  return err / float(np.spacing(np.float32(mag)))


def row(name: str, where: str, got, ref, mag: float | None = None) -> tuple:
  """``(name, where, max |got - ref|, magnitude, ulps)``; magnitude: median |ref| by default."""
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  err = float(np.max(np.abs(got - ref)))
  mag = float(np.median(np.abs(ref))) if mag is None else mag
  return name, where, err, mag, ulps(err, mag)


def with_output_of(fn, primitive: str, *args):
  """``fn(*args)`` compiled with the output of the first (possibly nested) ``primitive``
  equation of its program added: an intermediate of the project's own code, not a copy of it."""
  closed = jax.make_jaxpr(fn)(*args)

  def contains(eqn) -> bool:
    if eqn.primitive.name == primitive:
      return True
    return any(contains(e) for j in jex_core.jaxprs_in_params(eqn.params) for e in j.eqns)

  eqn = next(e for e in closed.jaxpr.eqns if contains(e))
  jaxpr = closed.jaxpr.replace(outvars=list(closed.jaxpr.outvars) + [eqn.outvars[0]])
  f = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, closed.consts))
  return jax.jit(lambda *a: f(*jax.tree.leaves(a)))(*args)


def sampler_rows(z: np.ndarray, u: np.ndarray, ref: dict) -> tuple[list[tuple], int, int]:
  """The sampler's rows, the sampled tokens unlike float64's, the largest top-p kept-count difference."""
  rows = []
  zj, uj = jnp.asarray(z), jnp.asarray(u)
  one, k0, p1 = jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0)
  b = np.arange(z.shape[0])

  # Greedy: max - logsumexp, on both layouts ([B, V] accelerator, [V, B] the CPU loop's).
  for axis, x in ((1, zj), (0, zj.T)):
    tokens, logp = jax.jit(strategies.greedy, static_argnums=1)(x, axis)
    assert np.array_equal(np.asarray(tokens), z.argmax(-1))
    rows.append(row(f"greedy log-prob, max - logsumexp ({'[B, V]' if axis else '[V, B]'})",
                    "sampling.strategies:greedy", logp, ref["logp"][b, np.asarray(tokens)]))

  # Plain sampling (T = 1): log-prob from draw's total; the total itself.
  plain = strategies.Strategy()
  mismatches = 0
  for axis, x in ((1, zj), (0, zj.T)):
    tokens, logp = jax.jit(lambda x, u: plain(x, u, one, k0, p1, vocab_axis=axis))(x, uj)
    tokens = np.asarray(tokens)
    mismatches += int(np.sum(tokens != ref_inversion(z, u)))
    layout = "[B, V]" if axis else "[V, B]"
    rows.append(row(f"sampled log-prob, T = 1 ({layout})", "sampling.strategies:Strategy -> draw",
                    logp, ref["logp"][b, tokens]))
    w = jnp.exp(x - jnp.max(x, axis=axis, keepdims=True))
    _, total = jax.jit(lambda w, u: strategies.draw(u, w, vocab_axis=axis))(w, uj)
    ref_total = np.exp(z.astype(np.float64) - z.max(-1, keepdims=True)).sum(-1)
    rows.append(row(f"draw's normaliser sum exp(z - max) ({layout})", "sampling.strategies:draw",
                    total, ref_total))

  # Top-p sampling: log-prob by token_logprob (logsumexp), and truncate's cumulative sum.
  top_p = strategies.Strategy(truncate=True)
  tokens, logp = jax.jit(lambda x, u: top_p(x, u, one, k0, jnp.float32(TOP_P)))(zj, uj)
  rows.append(row(f"sampled log-prob, top-p {TOP_P}", "sampling.strategies:Strategy -> token_logprob",
                  logp, ref["logp"][b, np.asarray(tokens)]))
  _, cdf = with_output_of(strategies.truncate, "cumsum", zj, k0, jnp.float32(TOP_P))
  cdf = np.asarray(cdf, np.float64)
  ref_cdf = np.cumsum(np.exp(ref_log_softmax(-np.sort(-z, axis=-1))), -1)
  rows.append(row("top-p CDF, last entry vs 1", "sampling.strategies:truncate (cumsum)",
                  cdf[:, -1], np.ones(len(z)), 1.0))
  rows.append(row("top-p CDF, every entry", "sampling.strategies:truncate (cumsum)", cdf, ref_cdf,
                  float(np.median(ref_cdf))))
  kept = np.asarray(jnp.isfinite(jax.jit(strategies.truncate)(zj, k0, jnp.float32(TOP_P)))).sum(-1)
  ref_kept = np.maximum(((ref_cdf - np.exp(ref_log_softmax(-np.sort(-z, axis=-1)))) < TOP_P).sum(-1), 1)
  return rows, mismatches, int(np.max(np.abs(kept - ref_kept)))


def entropy_rows(z: np.ndarray, tokens: np.ndarray, d: np.ndarray, ref: dict) -> list[tuple]:
  zj, tj, dj = jnp.asarray(z), jnp.asarray(tokens), jnp.asarray(d)
  b = np.arange(len(z))
  where = "entropy.discriminator:"
  s_ref, p, logp_ref, h = ref["s"], ref["p"], ref["logp"], ref["h"]
  d = d.astype(np.float64)
  # The sums with cancellation are measured against the size of their terms (what a summation
  # error is proportional to), not of their result.
  e_s_scale = float(np.median((p * p * (h[:, None] + np.abs(logp_ref))).sum(-1)))
  s_k_scale = float(np.median(p[b, tokens] * h))
  logp = jax.jit(disc.log_softmax)(zj)
  rows = [
      row("log-softmax (all entries; magnitude median |log p|)", where + "log_softmax", logp, ref["logp"]),
      row("entropy H", where + "entropy", jax.jit(disc.entropy)(zj), ref["h"]),
      row("S_i (all entries; magnitude max_i p_i (H + |log p_i|))", where + "discriminator",
          jax.jit(disc.discriminator)(zj), s_ref,
          float(np.median((p * (h[:, None] + np.abs(logp_ref))).max(-1)))),
      row("E_p[S] (magnitude sum p_i^2 (H + |log p_i|))", where + "expected_discriminator",
          jax.jit(disc.expected_discriminator)(zj), ref["e_s"], e_s_scale),
      row("S_* of the sampled token (magnitude p_k H)", where + "token_discriminator",
          jax.jit(disc.token_discriminator)(zj, tj), s_ref[b, tokens], s_k_scale),
      row("S_* - E_p[S] (magnitude p_k H)", where + "centered_token_discriminator",
          jax.jit(disc.centered_token_discriminator)(zj, tj), s_ref[b, tokens] - ref["e_s"], s_k_scale),
      row("dH along d, -sum S_i d_i (magnitude sum p_i |d_i| (H + |log p_i|))", "entropy.dynamics:entropy_jvp",
          jax.jit(dynamics.entropy_jvp)(zj, dj), -(s_ref * d).sum(-1),
          float(np.median((p * np.abs(d) * (h[:, None] + np.abs(logp_ref))).sum(-1)))),
  ]
  dp_ref = ref["p"] * (d - (ref["p"] * d).sum(-1, keepdims=True))
  rows.append(row("Lemma 1 dp (all entries; magnitude max |dp_i|)", "entropy.dynamics:first_order_prob_update",
                  jax.jit(dynamics.first_order_prob_update)(zj, dj), dp_ref,
                  float(np.median(np.abs(dp_ref).max(-1)))))
  return rows


def fused_row(vocab: int, rows: int, u: np.ndarray) -> tuple:
  """One decode step of a 1-layer model (hidden 128) through the fused Pallas kernels in interpret
  mode, its logits sampled by the sampler's plain strategy: the log-prob against float64 from the
  step's own float32 logits (the kernels reduce over hidden and cache axes; the vocabulary is
  reduced by the strategy)."""
  config = QwenConfig("qwen2", vocab_size=vocab, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      attention_bias=True, dtype=jnp.float32, param_dtype=jnp.float32,
                      tie_word_embeddings=False)
  model = Qwen(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  # RMSNorm makes the final hidden entries about unit-size: logits about 2 N(0, 1), as above.
  model.lm_head.value = jnp.asarray(rng.normal(0, 2 / np.sqrt(128), (128, vocab)), jnp.float32)
  cache = model.init_cache(rows, 16)
  tokens = jnp.asarray(rng.integers(0, vocab, rows), jnp.int32)
  layers = model.unstacked_layers()
  plain = strategies.Strategy()

  @nnx.jit
  def step(m, t, c, u):
    logits, _ = fused_decode.decode_step(m, t, c, layers, "fused_interpret")
    return logits, plain(logits, u, jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0))

  logits, (drawn, logp) = step(model, tokens, cache, jnp.asarray(u))
  logits = np.asarray(logits)
  return row("fused decode step (interpret) -> sampled log-prob", "models.fused_decode:decode_step + Strategy",
             logp, ref_log_softmax(logits)[np.arange(rows), np.asarray(drawn)])


def control_rows(z: np.ndarray, ref: dict) -> list[tuple]:
  """Not project code: the entropy from plain float32 ``jnp.sum``s of ``jax.nn.log_softmax``, and
  from one sequential variadic ``lax.reduce`` over V (what ``token_stats`` did), for scale."""
  def plain(z):
    logp = jax.nn.log_softmax(z, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)

  def sequential(z):
    shifted = z - jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(shifted)
    total, m1 = jax.lax.reduce((e, e * shifted), (jnp.float32(0), jnp.float32(0)),
                               lambda a, b: (a[0] + b[0], a[1] + b[1]), (1,))
    return jnp.log(total) - m1 / total

  zj = jnp.asarray(z)
  return [row("control: entropy, jax.nn.log_softmax + jnp.sum", "(not project code)", jax.jit(plain)(zj), ref["h"]),
          row("control: entropy, one sequential variadic lax.reduce", "(not project code)",
              jax.jit(sequential)(zj), ref["h"])]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocab", type=int, default=151_936)
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no-fused", action="store_true", help="skip the fused decode step's row")
  args = parser.parse_args()
  start = time.perf_counter()
  rng = np.random.default_rng(args.seed)
  z = (2.0 * rng.standard_normal((args.rows, args.vocab))).astype(np.float32)
  u = rng.random(args.rows).astype(np.float32)
  d = rng.standard_normal((args.rows, args.vocab)).astype(np.float32)
  ref = ref_stats(z)
  tokens = ref_inversion(z, u)  # the sampled tokens (float64 inversion of u)

  sampled, mismatches, kept_diff = sampler_rows(z, u, ref)
  table = sampled + entropy_rows(z, tokens, d, ref)
  if not args.no_fused:
    table.append(fused_row(args.vocab, args.rows, u))
  table += control_rows(z, ref)
  print(f"float32 vs float64, {args.rows} rows x V = {args.vocab:,}, logits 2 N(0, 1), seed {args.seed}, "
        f"{jax.default_backend()} ({time.perf_counter() - start:.0f} s)\n")
  print("| reduction | module:function | max abs error | typical magnitude | error in ulps |")
  print("|---|---|---|---|---|")
  for name, where, err, mag, ulp in table[:-2]:
    print(f"| {name} | `{where}` | {err:.2e} | {mag:.3g} | {ulp:.1f} |")
  for name, where in (("answer entropy", "train.evaluate:_entropy_sums / answer_entropy"),
                      ("attribution page's p, H, S_*, E_p[S]", "analysis.attribution:attribute"),
                      ("SFT loss, learner's log-probs and entropy", "train.sft, rl.learner.forward")):
    print(f"| {name} | `{where}` | via token_stats | | |")
  for name, where, err, mag, ulp in table[-2:]:
    print(f"| {name} | {where} | {err:.2e} | {mag:.3g} | {ulp:.1f} |")
  print(f"\nsampled tokens unlike the float64 inversion of the same uniforms: {mismatches} of "
        f"{2 * args.rows}; top-p {TOP_P} kept counts, largest difference from float64: {kept_diff}")


if __name__ == "__main__":
  main()
