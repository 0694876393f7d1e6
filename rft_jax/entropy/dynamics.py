r"""First-order entropy dynamics of logit updates (arXiv 2602.03392, Section 3).

A logit update :math:`z \to z + \delta z` changes the probabilities by
:math:`\delta p = p \odot (\delta z - \langle p, \delta z \rangle \mathbf{1})` to first
order (Lemma 1) and the entropy by :math:`\langle \nabla_z H, \delta z \rangle` with
:math:`\partial H / \partial z_i = -S_i`. The two updates the paper studies are

* a single-logit update :math:`\delta z = \varepsilon e_k`, where
  :math:`\Delta H = -\varepsilon S_* + O(\varepsilon^2)` (Theorem 1), and
* a GRPO / policy-gradient step on the sampled token, whose logit gradient is
  :math:`\delta z = \alpha (e_k - p)` with :math:`\alpha = \eta\, r\, A`, where
  :math:`\Delta H = -\alpha (S_* - \mathbb{E}_p[S]) + O(\alpha^2)` (Theorem 2).

Averaged over :math:`k \sim p` the GRPO term vanishes (Corollaries 1-2); its
advantage-weighted average is a covariance (Corollaries 3-4). All functions are pure
and vectorised over leading axes; statistics are float32 or wider.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rft_jax.entropy.discriminator import (
    centered_token_discriminator,
    entropy,
    stats_dtype,
    token_discriminator,
)


def entropy_jvp(
    logits: Float[Array, "... V"], direction: Float[Array, "... V"]
) -> Float[Array, "..."]:
  r"""Exact directional derivative of :math:`H(\mathrm{softmax}(z))` along ``direction``.

  .. math::  \frac{d}{d\varepsilon} H(z + \varepsilon\, d) \Big|_{\varepsilon=0}
             = -\sum_i S_i\, d_i,

  computed by forward-mode autodiff (``jax.jvp``) of :func:`entropy`, independently
  of the closed form on the right, which is what Theorems 1 and 2 state.

  Args:
    logits: ``[..., V]`` logits :math:`z`.
    direction: ``[..., V]`` logit direction :math:`d`.

  Returns:
    ``[...]`` the derivative, in the statistics dtype of ``logits``.
  """
  dtype = stats_dtype(logits.dtype)
  _, tangent = jax.jvp(entropy, (logits.astype(dtype),), (direction.astype(dtype),))
  return tangent


def first_order_prob_update(
    logits: Float[Array, "... V"], delta_logits: Float[Array, "... V"]
) -> Float[Array, "... V"]:
  r"""Lemma 1: the first-order change of :math:`p` under :math:`z \to z + \delta z`.

  .. math::  \delta p_i = p_i \Big(\delta z_i - \sum_j p_j\, \delta z_j\Big),

  i.e. the softmax Jacobian :math:`(\mathrm{diag}(p) - p p^\top)` applied to
  :math:`\delta z`. For :math:`\delta z = \varepsilon e_k` this is
  :math:`\delta p_k = \varepsilon p_k (1 - p_k)` and
  :math:`\delta p_i = -\varepsilon p_i p_k` for :math:`i \ne k`: the mass gained by
  :math:`k` is taken from the others in proportion to their probability.
  """
  dtype = stats_dtype(logits.dtype)
  p = jax.nn.softmax(logits.astype(dtype), axis=-1)
  delta_logits = delta_logits.astype(dtype)
  return p * (delta_logits - jnp.sum(p * delta_logits, axis=-1, keepdims=True))


def first_order_logit_update(
    logits: Float[Array, "... V"], tokens: Int[Array, "..."], eps
) -> Float[Array, "..."]:
  r"""Theorem 1: entropy change of the single-logit update :math:`\delta z = \varepsilon e_k`.

  .. math::  \Delta H = -\varepsilon\, S_* + O(\varepsilon^2),
             \qquad S_* = p_k (H + \log p_k).

  Raising a token's logit lowers the entropy when :math:`S_* > 0` (a token more
  likely than :math:`e^{-H}`) and raises it when :math:`S_* < 0`.

  Args:
    logits: ``[..., V]`` logits.
    tokens: ``[...]`` updated token ids :math:`k`.
    eps: scalar or ``[...]`` step :math:`\varepsilon` (negative for a penalty).

  Returns:
    ``[...]`` the first-order prediction :math:`-\varepsilon S_*`.
  """
  return -eps * token_discriminator(logits, tokens)


def first_order_grpo_update(
    logits: Float[Array, "... V"], tokens: Int[Array, "..."], alpha
) -> Float[Array, "..."]:
  r"""Theorem 2: entropy change of a GRPO step on the sampled token :math:`k`.

  The policy-gradient step on :math:`\log p_k` moves the logits by
  :math:`\delta z = \alpha (e_k - p)` with :math:`\alpha = \eta\, r\, A` (learning
  rate, importance ratio, advantage), and

  .. math::  \Delta H = -\alpha \big(S_* - \mathbb{E}_{i \sim p}[S_i]\big) + O(\alpha^2).

  The off-policy case (Corollary 1.1's setting) is covered by passing the ratio
  :math:`r` inside ``alpha``.

  Args:
    logits: ``[..., V]`` logits.
    tokens: ``[...]`` sampled token ids.
    alpha: scalar or ``[...]`` step size :math:`\alpha = \eta r A`.

  Returns:
    ``[...]`` the first-order prediction :math:`-\alpha (S_* - \mathbb{E}_p[S])`.
  """
  return -alpha * centered_token_discriminator(logits, tokens)


def masked_mean(x: Float[Array, "..."], where: Array) -> Float[Array, ""]:
  r"""Mean of ``x`` over the entries where ``where`` is true (or nonzero), 0 if there are none.

  .. math::  \bar x = \frac{\sum_t [w_t]\, x_t}{\max(\sum_t [w_t], 1)},

  with :math:`[w_t]` the indicator of ``where`` (``optax``'s ``where=`` convention); entries
  outside ``where`` never enter, not even as ``0 * nan``. The project's one masked mean: verl's
  ``masked_mean``, :math:`\sum m x / (\sum m + 10^{-8})`, is the same number in float32 for 0/1
  masks (:math:`N + 10^{-8} = N` for :math:`N \ge 1`; both are 0 for :math:`N = 0`)."""
  valid = where if where.dtype == jnp.bool_ else where != 0
  return jnp.sum(jnp.where(valid, x, 0)) / jnp.maximum(jnp.sum(valid), 1).astype(x.dtype)


def masked_covariance(
    x: Float[Array, "..."], y: Float[Array, "..."], mask: Array
) -> Float[Array, ""]:
  r"""Population covariance of ``x`` and ``y`` over the entries where ``mask`` is true.

  .. math::  \mathrm{Cov}_B(x, y) = \frac{1}{N} \sum_{t \in B} (x_t - \bar x)(y_t - \bar y).
  """
  dx = x - masked_mean(x, mask)
  dy = y - masked_mean(y, mask)
  return masked_mean(dx * dy, mask)


def batch_entropy_change(
    advantages: Float[Array, "..."],
    centered_scores: Float[Array, "..."],
    mask: Array,
    lr,
    ratio: Float[Array, "..."] | None = None,
) -> Float[Array, ""]:
  r"""Corollary 4 (and 4.1): first-order entropy change of a GRPO step on a batch.

  Summing Theorem 2 over the valid response tokens :math:`t` of a batch :math:`B`,
  with centred scores :math:`S^c_t = S_{*,t} - \mathbb{E}_{p_t}[S]` whose batch mean
  vanishes in expectation (Corollary 2), the entropy moves by

  .. math::  \Delta H \approx -\eta\, \mathrm{Cov}_B\big(A,\; r\, S^c\big),

  where :math:`r` is the importance ratio (1 on-policy, Corollary 4; the off-policy
  form is Corollary 4.1). Tokens whose advantage is positively correlated with
  their centred score drive entropy down (collapse); the opposite drives it up.

  Args:
    advantages: ``[...]`` per-token advantages :math:`A_t`.
    centered_scores: ``[...]`` :math:`S_* - \mathbb{E}_p[S]` per token.
    mask: ``[...]`` valid response tokens (bool or 0/1).
    lr: learning rate :math:`\eta`.
    ratio: optional ``[...]`` importance ratios :math:`r_t`.

  Returns:
    scalar forecast :math:`-\eta\, \mathrm{Cov}_B(A, r S^c)` over valid tokens.
  """
  dtype = stats_dtype(centered_scores.dtype)
  scores = centered_scores.astype(dtype)
  if ratio is not None:
    scores = ratio.astype(dtype) * scores
  return -lr * masked_covariance(advantages.astype(dtype), scores, mask)
