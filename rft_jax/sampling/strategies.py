r"""Sampling strategies on float32 next-token logits ``[B, V]``: greedy, temperature, top-k, top-p.

Each row draws with its own key, so a row's token depends on its logits and its key only, not on
the other rows. The log-probability returned with a token is always under the *untruncated*
distribution the token was scaled for:

.. math::
   \log \pi(y) = \log \mathrm{softmax}(z / T)_y \quad (T > 0), \qquad
   \log \pi(y) = \log \mathrm{softmax}(z)_y \quad (T = 0),

before top-k / top-p truncation. The learner's importance ratio divides by the same quantity
(``log softmax(z / T)`` over the full vocabulary), so the two sides compare like with like;
truncation renormalisation would otherwise add :math:`-\log(\text{kept mass})` to every token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rft_jax.sampling.params import SamplingParams

_NEG_INF = -jnp.inf


def truncate(logits: Float[Array, "B V"], top_k: Int[Array, ""] | int,
             top_p: Float[Array, ""] | float) -> Float[Array, "B V"]:
  r"""Top-k, then top-p truncation (the Hugging Face order), with one sort per row.

  Top-k keeps the logits ``>=`` the k-th largest (ties kept; ``top_k = 0`` keeps all). Top-p
  then takes the distribution renormalised on those, sorts it in decreasing order, and keeps
  token :math:`i` iff the mass before it is :math:`< p` (so the most likely token always stays,
  and ``top_p = 1`` keeps all); ties with the last kept logit are kept. Both may be traced.

  Returns:
    ``logits`` with the removed entries set to ``-inf``.
  """
  v = logits.shape[-1]
  sorted_logits = -jnp.sort(-logits, axis=-1)
  k = jnp.where((top_k <= 0) | (top_k > v), v, top_k)
  kth = jax.lax.dynamic_index_in_dim(sorted_logits, k - 1, axis=-1)  # [B, 1]
  sorted_logits = jnp.where(sorted_logits >= kth, sorted_logits, _NEG_INF)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  kept = jnp.maximum(jnp.sum((mass_before < top_p) & (probs > 0), axis=-1, keepdims=True), 1)
  cutoff = jnp.take_along_axis(sorted_logits, kept - 1, axis=-1)
  cutoff = jnp.where(top_p < 1, cutoff, kth)
  return jnp.where(logits < cutoff, _NEG_INF, logits)


def categorical(uniforms: Float[Array, "B"], logits: Float[Array, "B V"]) -> Int[Array, "B"]:
  r"""One draw per row from ``softmax(logits)`` by inversion of the row's uniform number.

  With weights :math:`w_i = e^{z_i - \max z}` cut into blocks of ``b`` (a power of two
  :math:`\ge \sqrt V`) and the row's :math:`u \sim U[0, 1)`, the draw picks the
  first block whose cumulative weight exceeds :math:`u \sum_i w_i`, then the first token of
  that block whose cumulative weight exceeds the remainder: two short prefix sums instead of
  one over V, and far cheaper than Gumbel-max (``jax.random.categorical``), which draws V
  random numbers per row and step. Entries at ``-inf`` weigh exactly 0 and are never drawn;
  when rounding pushes the target past the end of a prefix sum, the last entry of nonzero
  weight is taken.
  """
  return draw(uniforms, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)))[0]


def draw(uniforms: Float[Array, "B"], weights: Float[Array, "B V"], *, vocab_axis: int = 1
         ) -> tuple[Int[Array, "B"], Float[Array, "B"]]:
  r""":func:`categorical` from unnormalised weights ``w >= 0`` (``exp`` of shifted logits).

  Args:
    uniforms: ``[B]`` float32 in ``[0, 1)``, one per row.
    weights: ``[B, V]``, or ``[V, B]`` (vocabulary-major) with ``vocab_axis=0``.

  Returns:
    ``(tokens int32 [B], total weight [B])``: the total is :math:`\sum_i w_i`, so that a
    caller holding the weights of the untruncated distribution gets its log-normaliser free.
  """
  v = weights.shape[vocab_axis]
  block = 1 << max(int(v - 1).bit_length() + 1, 2) // 2  # 2**ceil(log2(V) / 2)
  blocks = -(-v // block)
  pad = [(0, 0), (0, 0)]
  pad[vocab_axis] = (0, blocks * block - v)
  weights = jnp.pad(weights, pad)
  if vocab_axis == 1:
    weights = weights.reshape(-1, blocks, block)  # [B, blocks, block]
    block_sums = jnp.sum(weights, axis=-1)
  else:
    weights = weights.reshape(blocks, block, -1)  # [blocks, block, B]
    block_sums = jnp.sum(weights, axis=1).T
  block_cdf = jnp.cumsum(block_sums, axis=-1)  # [B, blocks]
  total = block_cdf[:, -1]
  target = uniforms * total
  j = _first_above(block_cdf, target)
  below = jnp.where(j > 0, jnp.take_along_axis(block_cdf, jnp.maximum(j - 1, 0)[:, None],
                                               axis=-1)[:, 0], 0.0)
  if vocab_axis == 1:
    inner = jnp.take_along_axis(weights, j[:, None, None], axis=1)[:, 0]  # [B, block]
  else:
    inner = jnp.take_along_axis(weights, j[None, None, :], axis=0)[0].T
  i = _first_above(jnp.cumsum(inner, axis=-1), target - below)
  return (j * block + i).astype(jnp.int32), total


def _first_above(cdf: Float[Array, "B K"], target: Float[Array, "B"]) -> Int[Array, "B"]:
  """The first index with ``cdf > target``, or the last increase of ``cdf`` if none."""
  first = jnp.sum(cdf <= target[:, None], axis=-1)
  return jnp.minimum(first, jnp.argmax(cdf, axis=-1)).astype(jnp.int32)


def greedy(logits: Float[Array, "B V"], vocab_axis: int = 1
           ) -> tuple[Int[Array, "B"], Float[Array, "B"]]:
  """The argmax token of each row (the first, on ties) and its log-probability under
  ``softmax(logits)``, ``max - logsumexp``, on either layout: plain reductions along the
  vocabulary, where ``argmax`` over the CPU loop's ``[V, B]`` logits needed them transposed
  first, a slower greedy rollout (``docs/results/cpu.md#greedy-sampling``)."""
  v = logits.shape[vocab_axis]
  top = jnp.max(logits, axis=vocab_axis, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, vocab_axis)
  tokens = jnp.min(jnp.where(logits == top, index, v - 1), axis=vocab_axis)
  logz = jax.nn.logsumexp(logits, axis=vocab_axis, keepdims=True)
  return tokens, jnp.squeeze(top - logz, vocab_axis)


def token_logprob(scaled: Float[Array, "B V"], tokens: Int[Array, "B"]) -> Float[Array, "B"]:
  """``log_softmax(scaled)[b, tokens[b]]``."""
  logz = jax.nn.logsumexp(scaled, axis=-1)
  return jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - logz


@dataclasses.dataclass(frozen=True)
class Strategy:
  """The static (program-shaping) part of a sampling setting; T, top-k and top-p are traced.

  Attributes:
    greedy: argmax instead of a random draw (temperature 0).
    truncate: apply :func:`truncate` (``top_k > 0`` or ``top_p < 1``): one sort per row and
      step, which plain sampling skips.
  """

  greedy: bool = False
  truncate: bool = False

  @classmethod
  def of(cls, params: SamplingParams) -> Strategy:
    return cls(greedy=params.greedy,
               truncate=not params.greedy and (params.top_k > 0 or params.top_p < 1))

  def __call__(self, logits: Float[Array, "B V"], uniforms: Float[Array, "B"],
               temperature: Float[Array, ""], top_k: Int[Array, ""], top_p: Float[Array, ""],
               *, vocab_axis: int = 1) -> tuple[Int[Array, "B"], Float[Array, "B"]]:
    """One token per row and its log-probability (see the module docstring for which one).

    Args:
      logits: raw next-token logits, ``[B, V]``; or ``[V, B]`` with ``vocab_axis=0`` (what
        ``rft_jax.models.decode.feature_major.decode_step`` returns; plain and greedy sampling then run
        on that layout, truncated sampling on its transpose).
      uniforms: ``[B]`` float32 in ``[0, 1)``, one per row, what a draw inverts
        (:func:`~rft_jax.sampling.keys.step_uniforms`; unused when greedy).
      temperature: T > 0 (ignored when greedy).
      top_k, top_p: truncation (ignored unless ``truncate``).

    Returns:
      ``(tokens int32 [B], logp float32 [B])``.
    """
    logits = logits.astype(jnp.float32)
    if vocab_axis not in (0, 1):
      raise ValueError(f"Strategy: vocab_axis={vocab_axis} must be 0 or 1")
    if self.greedy:
      return greedy(logits, vocab_axis)
    if vocab_axis == 0 and self.truncate:
      logits, vocab_axis = logits.T, 1
    scaled = logits / temperature
    if self.truncate:
      tokens = categorical(uniforms, truncate(scaled, top_k, top_p))
      return tokens, token_logprob(scaled, tokens)
    # One exp pass serves both the draw and the log-normaliser.
    shifted = scaled - jnp.max(scaled, axis=vocab_axis, keepdims=True)
    tokens, total = draw(uniforms, jnp.exp(shifted), vocab_axis=vocab_axis)
    picked = jnp.take_along_axis(shifted, jnp.expand_dims(tokens, vocab_axis), axis=vocab_axis)
    return tokens, jnp.squeeze(picked, vocab_axis) - jnp.log(total)
