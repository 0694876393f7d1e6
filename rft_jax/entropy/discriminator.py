r"""Entropy and the entropy discriminator of a softmax policy.

Notation of arXiv 2602.03392, Section 3. Results are cited as Lemma 1, Theorems 1-2 and
Corollaries 1-4 (the arXiv text numbers them within Section 3: Lemma 3.1, Theorems 3.2 and
3.3, ...); the clipping algorithms as Algorithm 1 / Eq. 15 (Clip_B) and Algorithm 2 / Eq. 16
(Clip_V). At one position the policy has logits
:math:`z \in \mathbb{R}^V`, probabilities :math:`p = \mathrm{softmax}(z)` and entropy
:math:`H = -\sum_i p_i \log p_i`. The *entropy discriminator* of vocabulary entry
:math:`i` is

.. math::  S_i = p_i \, (H + \log p_i),

:math:`S_* = S_k` for the sampled token :math:`k`, and the policy-average baseline
is :math:`\mathbb{E}_{i \sim p}[S_i] = \sum_i p_i S_i`. The sign of :math:`S_*` says
whether pushing up the logit of :math:`k` lowers (:math:`S_* > 0`) or raises
(:math:`S_* < 0`) the entropy (Theorem 1). Note :math:`\sum_i S_i = 0`.

Conventions shared by every function here:

* Statistics are computed in ``float32`` or wider (``float64`` inputs stay ``float64``),
  whatever the logits' dtype, from ``log_softmax`` so that extreme logits are safe.
* :math:`0 \log 0 = 0`: an entry whose probability underflows to 0 (or whose logit
  is ``-inf``) contributes nothing to :math:`H` and has :math:`S_i = 0`; no NaN.
* The vocabulary is the last axis; any leading axes are batch/sequence axes.

These functions materialise ``[..., V]`` arrays. For real vocabularies over many
positions use :func:`rft_jax.entropy.token_stats`, which chunks over positions.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def stats_dtype(dtype) -> jnp.dtype:
  """The dtype entropy statistics are computed in: at least float32."""
  return jnp.promote_types(dtype, jnp.float32)


def log_softmax(logits: Float[Array, "... V"]) -> Float[Array, "... V"]:
  r"""Log-probabilities :math:`\log p_i = z_i - \log \sum_j e^{z_j}`, accurate near one-hot.

  The usual form :math:`(z_i - m) - \log \sum_j e^{z_j - m}` (with :math:`m = \max z`)
  rounds :math:`\log p_{top}` to exactly 0 once the other entries' mass
  :math:`\tau = \sum_{j \ne top} e^{z_j - m}` falls below the dtype's epsilon
  (1e-7 in float32: common for a confident LLM), and :math:`S_{top}` then loses
  :math:`p_{top} \log p_{top} \approx -\tau`, a relative error of order
  :math:`1 / \log(1/\tau)` in exactly the low-entropy positions the paper studies.
  Here :math:`\log \sum_j e^{z_j - m} = \mathrm{log1p}(\tau)` with the top entry
  left out of :math:`\tau`, which keeps :math:`\log p_{top} \approx -\tau` exact.
  ``-inf`` logits give ``-inf``; a row of only ``-inf`` is undefined.
  """
  top = jnp.argmax(logits, axis=-1, keepdims=True)
  # No stop_gradient on the max: the top entry's "1" is not in the tail, so the
  # derivative of log p w.r.t. z_top flows through the subtraction.
  is_top = jnp.arange(logits.shape[-1]) == top
  # 0 at the top by construction: under jit, XLA may fuse a caller's z / T into the
  # subtraction and round its two operands differently (log p_top > 0, H < 0).
  shifted = jnp.where(is_top, 0.0, logits - jnp.take_along_axis(logits, top, axis=-1))
  tail = jnp.sum(jnp.where(is_top, 0.0, jnp.exp(shifted)), axis=-1, keepdims=True)
  return shifted - jnp.log1p(tail)


def probs_and_safe_log(
    log_p: Float[Array, "... V"],
) -> tuple[Float[Array, "... V"], Float[Array, "... V"]]:
  r"""Returns ``(p, log_p)`` from log-probabilities, with ``log_p`` set to 0 where ``p == 0``.

  Zeroing :math:`\log p` where :math:`p = 0` makes every product
  :math:`p_i \log p_i` equal to 0 there (the convention :math:`0 \log 0 = 0`) with
  finite derivatives, including for ``-inf`` logits.
  """
  p = jnp.exp(log_p)
  return p, jnp.where(p > 0, log_p, 0.0)


def safe_log_softmax(
    logits: Float[Array, "... V"],
) -> tuple[Float[Array, "... V"], Float[Array, "... V"]]:
  """:func:`probs_and_safe_log` of :func:`log_softmax`, upcast to :func:`stats_dtype`."""
  logits = logits.astype(stats_dtype(logits.dtype))
  return probs_and_safe_log(log_softmax(logits))


def entropy_from_probs(
    p: Float[Array, "... V"], log_p: Float[Array, "... V"]
) -> Float[Array, "..."]:
  r""":math:`H = -\sum_i p_i \log p_i` from the outputs of :func:`safe_log_softmax`."""
  return -jnp.sum(p * log_p, axis=-1)


def entropy(logits: Float[Array, "... V"]) -> Float[Array, "..."]:
  r"""Shannon entropy of :math:`p = \mathrm{softmax}(z)` over the last axis.

  .. math::  H(z) = -\sum_{i=1}^{V} p_i \log p_i, \qquad 0 \log 0 = 0.

  Args:
    logits: ``[..., V]`` logits :math:`z` (any float dtype; ``-inf`` allowed).

  Returns:
    ``[...]`` entropy in nats, float32 (float64 for float64 input).
  """
  return entropy_from_probs(*safe_log_softmax(logits))


def discriminator(logits: Float[Array, "... V"]) -> Float[Array, "... V"]:
  r"""Entropy discriminator of every vocabulary entry (arXiv 2602.03392, Section 3).

  .. math::  S_i = p_i \, (H + \log p_i).

  :math:`S_i > 0` for entries more likely than :math:`e^{-H}` and :math:`S_i < 0`
  for less likely ones; :math:`\sum_i S_i = 0`; :math:`S_i = 0` where
  :math:`p_i = 0`.

  Args:
    logits: ``[..., V]`` logits.

  Returns:
    ``[..., V]`` discriminator values, float32 (float64 for float64 input).
  """
  p, log_p = safe_log_softmax(logits)
  h = entropy_from_probs(p, log_p)
  return p * (h[..., None] + log_p)


def token_discriminator(
    logits: Float[Array, "... V"], tokens: Int[Array, "..."]
) -> Float[Array, "..."]:
  r"""The discriminator of the sampled token, :math:`S_* = S_k` (Theorem 1).

  Args:
    logits: ``[..., V]`` logits.
    tokens: ``[...]`` sampled token ids :math:`k` in ``[0, V)``.

  Returns:
    ``[...]`` values of :math:`S_* = p_k (H + \log p_k)`.
  """
  s = discriminator(logits)
  return jnp.take_along_axis(s, tokens[..., None], axis=-1)[..., 0]


def expected_discriminator(logits: Float[Array, "... V"]) -> Float[Array, "..."]:
  r"""The policy-average discriminator :math:`\mathbb{E}_{i \sim p}[S_i]`.

  .. math::  \mathbb{E}_p[S] = \sum_i p_i S_i = \sum_i p_i^2 (H + \log p_i).

  It is the baseline that a GRPO step subtracts from :math:`S_*` (Theorem 2).

  Args:
    logits: ``[..., V]`` logits.

  Returns:
    ``[...]`` values of :math:`\mathbb{E}_p[S]`.
  """
  p, log_p = safe_log_softmax(logits)
  h = entropy_from_probs(p, log_p)
  return jnp.sum(p * p * (h[..., None] + log_p), axis=-1)


def centered_token_discriminator(
    logits: Float[Array, "... V"], tokens: Int[Array, "..."]
) -> Float[Array, "..."]:
  r"""The centred score :math:`S_* - \mathbb{E}_p[S]` of the sampled token.

  Theorem 2's first-order entropy change of a GRPO step is
  :math:`-\alpha (S_* - \mathbb{E}_p[S])`; Clip_V thresholds this score.
  """
  return token_discriminator(logits, tokens) - expected_discriminator(logits)


def token_discriminator_from_logp(
    log_p_k: Float[Array, "..."], entropy: Float[Array, "..."]
) -> Float[Array, "..."]:
  r""":math:`S_* = p_k (H + \log p_k)` from the sampled token's log-prob and the entropy.

  The two may come from different evaluations of the policy: the authors' Clip_B
  (Trinity-RFT 0.6.0) takes :math:`\log p_k` from the rollout engine and :math:`H` from
  the trainer's forward pass. :math:`0 \log 0 = 0` where :math:`p_k = 0`.

  Args:
    log_p_k: ``[...]`` :math:`\log p_k` of the sampled tokens.
    entropy: ``[...]`` :math:`H` at the same positions.

  Returns:
    ``[...]`` :math:`S_*`, in the wider of the two dtypes (at least float32).
  """
  dtype = stats_dtype(jnp.promote_types(log_p_k.dtype, entropy.dtype))
  p_k, log_p_k = probs_and_safe_log(log_p_k.astype(dtype))
  return p_k * (entropy.astype(dtype) + log_p_k)
