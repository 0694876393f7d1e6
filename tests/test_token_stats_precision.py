"""``token_stats`` against a float64 reference at real vocabulary sizes (issue 59).

Every path (the autodiff reference, one closed-form chunk and several, from logits and from hidden
states with the unembedding, a Python and a traced temperature, a bfloat16 product) at vocabularies 64 to 151,936: the values
(log p, H, S_*, E_p[S]), the JVP along a random direction and the VJP, each within ``ULPS`` float32
units of roundoff of its own first-order sensitivity to rounding (:func:`error_scales`). A sum over
the vocabulary taken in one sequential float32 loop (what a variadic ``lax.reduce`` is on XLA:CPU)
fails these at 4,096 and above: its entropy is off by ~100 units at 151,936.

Float32 inputs whose products are exact (:func:`dyadic`) make the float64 reference exact for the
hidden-state path too, so it is held to the same tolerance as the logits path. The entropy is also
compared with verl's and TRL's float32 ``entropy_from_logits`` on the same logits: no worse than
either.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rft_jax.entropy import token_stats

VOCABS = (64, 4096, 32_768, 151_936)
U = 2.0**-24  # float32's unit roundoff
# Tolerance, in units of U times each quantity's rounding sensitivity (first-order, measured
# worst case about 3 here on an AVX-512 and an AVX2 machine; the sequential sum's entropy: 100+).
ULPS = 8.0
POSITIONS, CHUNK = 20, 8  # two full chunks and a shorter last one


def reference(z, tokens, temperature, input_error, dz=None):
  """float64 statistics of ``softmax(z / T)`` and their error scales (in units of ``U``).

  ``input_error``: ``[n, V]`` bound on the rounding of the float32 ``z / T`` the code forms, in
  units of ``U``. ``dz``: a direction; then also the JVP of ``(log p_k, H)`` along it (central
  differences of this reference, float64) and its error scales.
  """
  zt = np.asarray(z, np.float64) / temperature
  top = zt.max(-1, keepdims=True)
  log_p = zt - top - np.log(np.exp(zt - top).sum(-1, keepdims=True))
  p = np.exp(log_p)
  h = -(p * log_p).sum(-1)
  rows = np.arange(len(tokens))
  log_pk, p_k = log_p[rows, tokens], p[rows, tokens]
  s_star = p_k * (h + log_pk)
  expected_s = (p * p * (h[:, None] + log_p)).sum(-1)
  values = np.stack([log_pk, h, s_star, expected_s])
  if dz is None:
    return values
  # First-order error scales: an entry's log p carries |log p_i| + e_i + E_p[e] units (e: the input
  # error), which p_i = e^{log p_i} turns into a relative error; H's sensitivity to z'_i is S_i.
  e = input_error
  mean_e = (p * e).sum(-1, keepdims=True)
  log_err = np.abs(log_p) + e + mean_e
  scale_logp = log_err[rows, tokens]
  scale_h = h + (p * np.abs(log_p + h[:, None]) * e).sum(-1)
  scale_s_star = p_k * (1 + np.abs(h + log_pk)) * (scale_h + scale_logp)
  scale_expected_s = (p * p * ((1 + 2 * np.abs(h[:, None] + log_p)) * log_err + scale_h[:, None])).sum(-1)
  dzt = np.asarray(dz, np.float64) / temperature
  scale_dlogp = np.abs(dzt[rows, tokens]) + (p * np.abs(dzt) * (2 + log_err)).sum(-1)
  scale_dh = (p * np.abs(dzt) * (np.abs(log_p + h[:, None]) * (2 + log_err) + log_err + scale_h[:, None])).sum(-1)
  step = 1e-4
  plus = reference(np.asarray(z, np.float64) + step * dz, tokens, temperature, None)
  minus = reference(np.asarray(z, np.float64) - step * dz, tokens, temperature, None)
  tangents = (plus[:2] - minus[:2]) / (2 * step)
  return (values, np.stack([scale_logp, scale_h, scale_s_star, scale_expected_s]), tangents,
          np.stack([scale_dlogp, scale_dh]))


def dyadic(rng, shape, bits, limit):
  """float32 multiples of ``2**-bits`` in ``[-limit, limit]``: few significant bits, so sums of
  their products are exact in float32 (and their bfloat16 casts are exact too)."""
  return (np.round(np.clip(rng.normal(0.0, limit / 3, shape), -limit, limit) * 2**bits) / 2**bits).astype(np.float32)


def case(vocab, from_hidden, seed=0):
  """``(inputs, unembedding, tokens, direction of inputs, direction of unembedding, z, dz)``:
  logits of about N(0, 2) per entry, or hidden states (width 16) and an unembedding whose float32
  product is those logits exactly."""
  rng = np.random.default_rng(seed + vocab)
  tokens = rng.integers(0, vocab, POSITIONS)
  if not from_hidden:
    z = (2 * rng.standard_normal((POSITIONS, vocab))).astype(np.float32)
    dz = rng.standard_normal((POSITIONS, vocab)).astype(np.float32)
    return z, None, tokens, dz, None, z, dz
  x, w = dyadic(rng, (POSITIONS, 16), 2, 6.0), dyadic(rng, (16, vocab), 6, 1.5)
  dx, dw = dyadic(rng, (POSITIONS, 16), 2, 6.0), dyadic(rng, (16, vocab), 6, 1.5)
  x64, w64 = x.astype(np.float64), w.astype(np.float64)
  return x, w, tokens, dx, dw, x64 @ w64, dx.astype(np.float64) @ w64 + x64 @ dw.astype(np.float64)


PATHS = {
    # name: (from hidden states, chunk_size, temperature, traced temperature, product dtype)
    "logits, the reference (chunk_size=None)": (False, None, 1.0, False, None),
    "logits, one closed-form chunk, T=0.7": (False, 4 * CHUNK, 0.7, False, None),
    "logits, chunks, T=0.7": (False, CHUNK, 0.7, False, None),
    "hidden, reference, traced T=0.7": (True, None, 0.7, True, None),
    "hidden, chunks": (True, CHUNK, 1.0, False, None),
    "hidden, chunks, traced T=0.7, bfloat16 product": (True, CHUNK, 0.7, True, jnp.bfloat16),
}


@functools.partial(jax.jit, static_argnames=("chunk_size", "product_dtype", "python_temperature"))
def values_jvp_vjp(inputs, unembedding, tokens, d_inputs, d_unembedding, weights, temperature, chunk_size,
                   product_dtype, python_temperature):
  """The statistics, their JVP along ``(d_inputs, d_unembedding)`` and the gradients of
  ``sum(weights[0] log p + weights[1] H)`` (the VJP)."""
  t = python_temperature if python_temperature is not None else temperature

  def stats(x, w):
    return token_stats(x, tokens, unembedding=w, temperature=t, chunk_size=chunk_size, entropy_grad=True,
                       product_dtype=product_dtype)

  if unembedding is None:
    fn, primals, tangents = (lambda x: stats(x, None)), (inputs,), (d_inputs,)
  else:
    fn, primals, tangents = stats, (inputs, unembedding), (d_inputs, d_unembedding)
  values, jvp = jax.jvp(fn, primals, tangents)
  grads = jax.grad(lambda *a: jnp.sum(weights[0] * fn(*a).logp + weights[1] * fn(*a).entropy),
                   argnums=tuple(range(len(primals))))(*primals)
  return values, jvp, grads


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("path", list(PATHS))
def test_values_and_derivatives_within_a_few_ulps_of_float64(vocab, path):
  from_hidden, chunk_size, temperature, traced, product_dtype = PATHS[path]
  inputs, w, tokens, d_inputs, d_w, z, dz = case(vocab, from_hidden)
  # z / T is one or two float32 roundings of |z / T| (a division or a reciprocal's product); z
  # itself is exact (given, or an exact product).
  input_error = 0.0 if temperature == 1.0 else 2 * np.abs(z / temperature)
  want, scales, want_tangents, tangent_scales = reference(z, tokens, temperature, input_error, dz)
  weights = np.random.default_rng(vocab).standard_normal((2, POSITIONS)).astype(np.float32)
  values, jvp, grads = values_jvp_vjp(
      inputs, w, jnp.asarray(tokens, jnp.int32), d_inputs, d_w, weights, jnp.float32(temperature), chunk_size,
      product_dtype, None if traced else temperature)
  got = np.stack([np.asarray(v, np.float64) for v in values])
  for name, g, r, s in zip(("log p", "H", "S_*", "E_p[S]"), got, want, scales):
    units = np.abs(g - r) / (U * s)
    assert units.max() <= ULPS, f"{path}, V={vocab}: {name} off by {units.max():.1f} units (max |error| {np.abs(g - r).max():.2e})"
  got_tangents = np.stack([np.asarray(jvp.logp, np.float64), np.asarray(jvp.entropy, np.float64)])
  for name, g, r, s in zip(("JVP of log p", "JVP of H"), got_tangents, want_tangents, tangent_scales):
    units = np.abs(g - r) / (U * s)
    assert units.max() <= ULPS, f"{path}, V={vocab}: {name} off by {units.max():.1f} units"
  # The VJP contracted with the direction (in float64) is the weighted sum of the JVP's entries.
  # A bfloat16 product's backward multiplies the logits' cotangent in bfloat16 too (the model's
  # rate, by design): only its dtypes are checked here.
  primals = (inputs, w) if from_hidden else (inputs,)
  directions = (d_inputs, d_w) if from_hidden else (d_inputs,)
  assert all(g.dtype == x.dtype for g, x in zip(grads, primals))
  if product_dtype is not None:
    return
  vjp = sum((np.asarray(g, np.float64) * d).sum() for g, d in zip(grads, directions))
  want_vjp = (weights[0] * want_tangents[0] + weights[1] * want_tangents[1]).sum()
  vjp_scale = (np.abs(weights[0]) * tangent_scales[0] + np.abs(weights[1]) * tangent_scales[1]).sum()
  assert abs(vjp - want_vjp) <= ULPS * U * vjp_scale, f"{path}, V={vocab}: VJP {vjp} against {want_vjp}"


def verl_entropy_from_logits(logits):
  """verl 0.9.1's ``entropy_from_logits`` (Apache-2.0; ``pip download --no-deps verl==0.9.1``,
  ``verl/utils/torch_functional.py``), line for line."""
  pd = torch.nn.functional.softmax(logits, dim=-1)
  entropy = torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)
  return entropy


def trl_entropy_from_logits(logits, chunk_size=128):
  """TRL 1.16.0's ``entropy_from_logits`` on a CPU (Apache-2.0; ``pip download --no-deps
  trl==1.16.0``, ``trl/trainer/utils.py``; its Triton branch needs a GPU), line for line."""
  original_shape = logits.shape[:-1]
  num_classes = logits.shape[-1]
  flat_logits = logits.reshape(-1, num_classes)
  entropies = []
  for chunk in flat_logits.split(chunk_size, dim=0):
    logps = F.log_softmax(chunk, dim=-1)
    chunk_entropy = -(torch.exp(logps) * logps).sum(-1)
    entropies.append(chunk_entropy)
  entropies = torch.cat(entropies, dim=0)
  return entropies.reshape(original_shape)


@pytest.mark.parametrize("vocab", VOCABS)
def test_entropy_no_worse_than_verl_and_trl(vocab):
  """Max absolute entropy error over 64 positions of N(0, 2) logits (32 above 4,096 entries; 3
  draws), against float64."""
  positions = 64 if vocab <= 4096 else 32
  for seed in range(3):
    z = (2 * np.random.default_rng(seed).standard_normal((positions, vocab))).astype(np.float32)
    tokens = np.zeros(len(z), np.int64)
    want = reference(z, tokens, 1.0, None)[1]
    errors = {name: np.abs(np.asarray(fn(torch.from_numpy(z)), np.float64) - want).max()
              for name, fn in (("verl", verl_entropy_from_logits), ("TRL", trl_entropy_from_logits))}
    for chunk_size in (None, 64, CHUNK):  # the reference, one closed-form chunk, chunks
      ours = token_stats(jnp.asarray(z), jnp.asarray(tokens, jnp.int32), chunk_size=chunk_size).entropy
      error = np.abs(np.asarray(ours, np.float64) - want).max()
      assert error <= min(errors.values()), (vocab, seed, chunk_size, error, errors)
