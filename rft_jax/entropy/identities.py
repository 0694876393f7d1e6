r"""Numerical check of the paper's identities, as a report (``rft-jax verify``).

:func:`identity_errors` draws random logits (moderate and extreme) and measures, in
float64, how far each identity of Section 3 of arXiv 2602.03392 is from holding:

=====================  ==========================================================
``lemma1``             first-order :math:`\delta p` vs the softmax Jacobian
``theorem1``           :math:`\partial_\varepsilon H(z + \varepsilon e_k)` vs :math:`-S_k`
``theorem2``           :math:`\partial_\alpha H(z + \alpha(e_k - p))` vs :math:`-(S_k - \mathbb{E}_p S)`
``second_order``       error ratio of the first-order forecast when the step halves (4 = :math:`O(\varepsilon^2)`)
``corollary1``         :math:`\sum_k p_k (S_k - \mathbb{E}_p S)` (0)
``corollary1_1``       :math:`\sum_k p'_k\, r_k (S_k - \mathbb{E}_p S)`, :math:`r = p / p'` (0)
``corollary3``         :math:`\mathbb{E}_{k \sim p}[\Delta H]` vs :math:`-\eta\,\mathrm{Cov}_{k\sim p}(A, S - \mathbb{E}_p S)`
=====================  ==========================================================

Errors of identities are relative to :func:`discriminator_scale`, the magnitude of
the terms :math:`p_i (H + |\log p_i|)` whose cancellation gives :math:`S` (so a
uniform row, where :math:`S = 0` up to rounding, is judged fairly); ``second_order`` reports the worst deviation of the ratio from 4 over rows
with non-negligible curvature. The test suite checks the same identities
independently with hypothesis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rft_jax.entropy.discriminator import (
    discriminator,
    entropy,
    entropy_from_probs,
    expected_discriminator,
    safe_log_softmax,
)
from rft_jax.entropy.dynamics import entropy_jvp, first_order_prob_update


def discriminator_scale(logits: jax.Array) -> jax.Array:
  r"""The magnitude of the terms that make up :math:`S`: :math:`\max_i p_i (H + |\log p_i|)`.

  :math:`S_i = p_i (H + \log p_i)` cancels to (near) 0 for uniform rows; its rounding
  error is relative to the terms, not to the result, so identity errors are measured
  relative to this scale (the tiniest positive float where it is 0: a one-hot row).
  """
  p, log_p = safe_log_softmax(logits)
  h = entropy_from_probs(p, log_p)
  scale = jnp.max(p * (h[..., None] + jnp.abs(log_p)), axis=-1)
  return jnp.maximum(scale, jnp.finfo(scale.dtype).tiny)


def _scaled_error(a, b, scale):
  return jnp.abs(a - b) / scale


def _random_logits(key, num_cases: int, vocab_size: int) -> jax.Array:
  """Half moderate N(0, 3^2) logits, half extreme (spread over ±1e3, some -inf)."""
  k1, k2, k3 = jax.random.split(key, 3)
  moderate = 3.0 * jax.random.normal(k1, (num_cases, vocab_size))
  extreme = 1e3 * jax.random.uniform(k2, (num_cases, vocab_size), minval=-1, maxval=1)
  masked = jax.random.bernoulli(k3, 0.2, (num_cases, vocab_size)).at[:, 0].set(False)
  extreme = jnp.where(masked, -jnp.inf, extreme)
  return jnp.concatenate([moderate, extreme]).astype(jnp.float64)


@jax.jit
def _identity_errors(key, logits):
  n, v = logits.shape
  k_tok, k_adv, k_off = jax.random.split(key, 3)
  p = jax.nn.softmax(logits, axis=-1)
  s = discriminator(logits)
  e_s = expected_discriminator(logits)
  scale = discriminator_scale(logits)
  k = jax.random.randint(k_tok, (n,), 0, v)
  e_k = jax.nn.one_hot(k, v, dtype=logits.dtype)
  s_k = jnp.take_along_axis(s, k[:, None], axis=-1)[:, 0]

  jac = jax.vmap(jax.jacobian(lambda z: jax.nn.softmax(z)))(logits)
  dz = jax.random.normal(k_adv, logits.shape, logits.dtype)
  lemma1 = jnp.max(jnp.abs(first_order_prob_update(logits, dz) - jnp.einsum("nij,nj->ni", jac, dz)))

  theorem1 = _scaled_error(entropy_jvp(logits, e_k), -s_k, scale)
  theorem2 = _scaled_error(entropy_jvp(logits, e_k - p), -(s_k - e_s), scale)

  # O(eps^2): the first-order forecast's error shrinks 4x when the step halves, on
  # rows whose curvature along the step is not negligible (elsewhere O(eps^3) rules).
  d = e_k - p
  curvature = jax.jvp(lambda z: entropy_jvp(z, d), (logits,), (d,))[1]
  def forecast_error(eps):
    return entropy(logits + eps * d) - entropy(logits) - eps * entropy_jvp(logits, d)
  ratio = forecast_error(1e-4) / forecast_error(5e-5)
  second_order = jnp.max(jnp.where(jnp.abs(curvature) > 1e-2, jnp.abs(ratio - 4.0), 0.0))

  centered = s - e_s[:, None]
  corollary1 = _scaled_error(jnp.sum(p * centered, axis=-1), 0.0, scale)
  p_off = jax.nn.softmax(jax.random.normal(k_off, logits.shape, logits.dtype), axis=-1)
  r = p / p_off
  corollary1_1 = _scaled_error(jnp.sum(p_off * r * centered, axis=-1), 0.0, scale)

  lr = 0.1
  adv = jax.random.normal(k_adv, logits.shape, logits.dtype)  # latent A per entry
  # Theorem 2 summed over k ~ p: E_k[dH] = sum_k p_k * (-lr * A_k * (S_k - E_p S)).
  expected_dh = jnp.sum(p * (-lr * adv * centered), axis=-1)
  mean_a = jnp.sum(p * adv, axis=-1, keepdims=True)
  cov = jnp.sum(p * (adv - mean_a) * centered, axis=-1)
  corollary3 = _scaled_error(expected_dh, -lr * cov, lr * scale)

  finite = jnp.all(jnp.isfinite(s)) & jnp.all(jnp.isfinite(entropy_jvp(logits, e_k - p)))
  return {
      "lemma1": lemma1,
      "theorem1": jnp.max(theorem1),
      "theorem2": jnp.max(theorem2),
      "second_order": second_order,
      "corollary1": jnp.max(corollary1),
      "corollary1_1": jnp.max(corollary1_1),
      "corollary3": jnp.max(corollary3),
      "all_finite": finite,
  }


def identity_errors(seed: int = 0, num_cases: int = 256, vocab_size: int = 64) -> dict[str, float]:
  """Worst-case error of each identity over ``2 * num_cases`` random positions.

  Runs in float64 (``jax.enable_x64``) whatever the global setting.
  """
  with jax.enable_x64(True):
    key = jax.random.key(seed)
    logits = _random_logits(jax.random.fold_in(key, 0), num_cases, vocab_size)
    errors = _identity_errors(jax.random.fold_in(key, 1), logits)
    return {name: float(value) for name, value in errors.items()}
