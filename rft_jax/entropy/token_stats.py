r"""Per-token statistics of a policy in one chunked pass over positions.

The learner needs, at every response position, the log-probability of the sampled
token (differentiable: it is the policy-gradient term) and the entropy statistics
:math:`H`, :math:`S_*` and :math:`\mathbb{E}_p[S]` (stop-gradient: they feed metrics,
the Corollary 4 forecast and the Clip_B / Clip_V masks). For a real vocabulary the
full ``[positions, V]`` float32 logits do not fit (151,936 entries are 0.6 MB per
token), so :func:`token_stats` walks over positions in chunks of ``chunk_size``:
each chunk's logits are formed (optionally from hidden states and the unembedding
matrix), scaled by the sampling temperature, reduced to four numbers per position
and dropped. When there are several chunks, each is rematerialised in the backward
pass, so training memory is :math:`O(\text{chunk} \times V)` as well; when all
positions fit in one chunk nothing is rematerialised (the backward pass keeps that
one chunk's logits instead of recomputing them).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rft_jax.entropy.discriminator import probs_and_safe_log


class TokenStats(NamedTuple):
  """Per-position statistics under :math:`p = \\mathrm{softmax}(z / T)`.

  Attributes:
    logp: ``[...]`` :math:`\\log p_k` of the sampled token; differentiable.
    entropy: ``[...]`` :math:`H`; stop-gradient.
    s_star: ``[...]`` :math:`S_* = p_k (H + \\log p_k)`; stop-gradient.
    expected_s: ``[...]`` :math:`\\mathbb{E}_p[S] = \\sum_i p_i S_i`; stop-gradient.
  """

  logp: Float[Array, "..."]
  entropy: Float[Array, "..."]
  s_star: Float[Array, "..."]
  expected_s: Float[Array, "..."]

  @property
  def centered(self) -> Float[Array, "..."]:
    """:math:`S_* - \\mathbb{E}_p[S]`, the score of Theorem 2 and Clip_V."""
    return self.s_star - self.expected_s


def _row_stats(logits: Float[Array, "V"], token: Int[Array, ""], entropy_grad: bool = False) -> TokenStats:
  r"""Statistics of one position from its float32 (temperature-scaled) logits.

  Written as row reductions so that no ``[V]``-sized intermediate needs to be stored
  beside the logits (XLA fuses each into its reduction):
  :math:`H = -\sum p \log p`, :math:`S_* = p_k (H + \log p_k)` and
  :math:`\mathbb{E}_p[S] = H \sum_i p_i^2 + \sum_i p_i^2 \log p_i`. The normaliser
  is the accurate ``log1p`` form of :func:`rft_jax.entropy.discriminator.log_softmax`.
  """
  top = jnp.argmax(logits)
  is_top = jnp.arange(logits.shape[-1]) == top
  # The top entry is 0 by construction, not by the subtraction: under jit XLA fuses z / T
  # into z - z_top and may round the two operands differently (one ulp, ~2e-6 at |z| ~ 16),
  # which would make log p_top > 0 and H < 0 at confident positions.
  shifted = jnp.where(is_top, 0.0, logits - logits[top])
  log_norm = jnp.log1p(jnp.sum(jnp.where(is_top, 0.0, jnp.exp(shifted))))
  logp = shifted[token] - log_norm

  log_p_all = shifted - log_norm
  p, log_p = probs_and_safe_log(log_p_all if entropy_grad else jax.lax.stop_gradient(log_p_all))
  h = -jnp.sum(p * log_p)
  p, log_p, h_const = jax.lax.stop_gradient((p, log_p, h))
  expected_s = h_const * jnp.sum(p * p) + jnp.sum(p * p * log_p)
  p_k, log_p_k = probs_and_safe_log(jax.lax.stop_gradient(logp))
  return TokenStats(logp=logp, entropy=h, s_star=p_k * (h_const + log_p_k), expected_s=expected_s)


def token_stats(
    inputs: Float[Array, "... F"],
    tokens: Int[Array, "..."],
    *,
    unembedding: Float[Array, "D V"] | None = None,
    temperature: float | Float[Array, ""] = 1.0,
    chunk_size: int | None = 512,
    entropy_grad: bool = False,
) -> TokenStats:
  r"""Log-prob, entropy, :math:`S_*` and :math:`\mathbb{E}_p[S]` at every position.

  All statistics are those of the sampling distribution
  :math:`p = \mathrm{softmax}(z / T)`, computed in float32 whatever the input dtype
  (float64 input stays float64), with the :math:`0 \log 0 = 0` convention of
  :mod:`rft_jax.entropy.discriminator`.

  Args:
    inputs: ``[..., V]`` logits, or ``[..., D]`` final hidden states when
      ``unembedding`` is given.
    tokens: ``[...]`` sampled token ids in ``[0, V)``; the leading shape of
      ``inputs``.
    unembedding: optional ``[D, V]`` output projection; logits are then
      ``inputs @ unembedding`` accumulated in float32, one chunk at a time.
    temperature: sampling temperature :math:`T > 0`.
    chunk_size: positions per chunk; peak memory is ``O(chunk_size * V)``. ``None``
      processes all positions at once (the naive path, for reference).
    entropy_grad: let gradients flow through ``entropy`` too (for an entropy bonus).

  Returns:
    :class:`TokenStats` of ``[...]`` arrays. Only ``logp`` (and ``entropy`` with
    ``entropy_grad``) carries gradients, to ``inputs`` and ``unembedding``.
  """
  if tokens.shape != inputs.shape[:-1]:
    raise ValueError(
        f"token_stats: tokens shape {tokens.shape} must equal the leading shape of "
        f"inputs {inputs.shape[:-1]}"
    )
  if unembedding is not None and unembedding.shape[0] != inputs.shape[-1]:
    raise ValueError(
        f"token_stats: unembedding shape {unembedding.shape} does not match hidden "
        f"size {inputs.shape[-1]}"
    )
  dtype = jnp.promote_types(inputs.dtype, jnp.float32)

  def position_stats(x: Float[Array, "F"], token: Int[Array, ""]) -> TokenStats:
    if unembedding is None:
      logits = x.astype(dtype)
    else:
      logits = jnp.dot(x, unembedding, preferred_element_type=dtype)
    return _row_stats(logits / temperature, token, entropy_grad)

  flat_x = inputs.reshape(-1, inputs.shape[-1])
  flat_t = tokens.reshape(-1)
  if chunk_size is None or flat_t.shape[0] <= chunk_size:
    # One chunk: no jax.checkpoint, which would only recompute the same [positions, V] block.
    stats = jax.vmap(position_stats)(flat_x, flat_t)
  else:
    # lax.map scans over chunks (vmapping inside each, remainder included); the
    # checkpoint makes the backward pass recompute each chunk's logits instead of
    # storing them, so neither pass ever holds more than one chunk of [., V].
    row = jax.checkpoint(lambda xt: position_stats(*xt))
    stats = jax.lax.map(row, (flat_x, flat_t), batch_size=chunk_size)
  return TokenStats(*(s.reshape(tokens.shape) for s in stats))
