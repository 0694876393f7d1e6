r"""Per-token statistics of a policy in one chunked pass over positions.

The learner needs, at every response position, the log-probability of the sampled
token (differentiable: it is the policy-gradient term) and the entropy statistics
:math:`H`, :math:`S_*` and :math:`\mathbb{E}_p[S]` (stop-gradient: they feed metrics,
the Corollary 4 forecast and the Clip_B / Clip_V masks). For a real vocabulary the
full ``[positions, V]`` float32 logits do not fit (151,936 entries are 0.6 MB per
token), so :func:`token_stats` walks over positions in chunks of ``chunk_size``:
each chunk's logits are formed (optionally from hidden states and the unembedding
matrix), scaled by the sampling temperature, reduced to four numbers per position
and dropped. When there are several chunks, each chunk is one ``jax.custom_jvp``
(:func:`_chunk_stats`) with a closed-form derivative: the policy-gradient logit direction
:math:`\partial \log p_k / \partial z = e_k - p` (Theorem 2's :math:`\delta z`) and, with
``entropy_grad``, the entropy gradient :math:`\partial H / \partial z_i = -S_i =
-p_i (\log p_i + H)` (Theorem 1), instead of JAX differentiating the forward reductions.
Reverse mode transposes it: the backward pass recomputes the chunk's logits with one
product, forms their cotangent in one elementwise pass and multiplies it back through the
unembedding; a ``jax.checkpoint`` keeps only ``[chunk]``-sized residuals (the argmax, max,
log-normaliser and entropy), so training memory is :math:`O(\text{chunk} \times V)` as
well. A ``jax.custom_jvp`` rather than a ``custom_vjp`` because forward mode is used too
(the learner's exact first-order entropy change is a ``jax.jvp`` through this). When all
positions fit in one chunk, that chunk's closed form runs without the checkpoint (its backward
keeps the block's residuals rather than recompute the product); with ``chunk_size=None`` (the
reference) JAX differentiates the same formulas itself.

Both paths compute the same float32 formulas (:func:`_chunk_forward`): every sum over the
vocabulary, forward and in the derivative, is :func:`rft_jax.entropy.vocab_sum.vocab_sums`' blocked
then pairwise sum, whose rounding error grows with the logarithm of the vocabulary rather than with
the vocabulary, and :math:`H` and :math:`\log p_k` come out within a few ulps of themselves at any
vocabulary (``tests/test_token_stats_precision.py`` holds every path to float64 at 64 to 151,936
entries, and to no worse than verl's and TRL's float32 entropy).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, Float, Int

from rft_jax.entropy.discriminator import probs_and_safe_log
from rft_jax.entropy.vocab_sum import vocab_sum
from rft_jax.entropy.vocab_sum import vocab_sums


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


class _Static(NamedTuple):
  """The hashable (non-differentiable) part of a chunk: ``temperature`` when it is a Python
  number (``None`` when it is an array, passed as an argument and differentiated)."""

  entropy_grad: bool
  temperature: float | None
  product_dtype: jnp.dtype | None = None


# Shifted logits are clamped here (only -inf and absurd logits reach it): exp underflows to
# exactly 0 (float32 and float64) far above, so e^s s = 0 there (0 log 0 = 0), with no NaN
# from e^{-inf} * -inf; a -inf logit's log-probability reads -1e30.
_LOG_UNDERFLOW = -1e30


def _product(x, unembedding, product_dtype, dtype):
  """``x @ unembedding`` accumulated and returned in ``dtype``, its operands first cast to
  ``product_dtype`` (None: as they are)."""
  if product_dtype is not None:
    x, unembedding = x.astype(product_dtype), unembedding.astype(product_dtype)
  return jnp.dot(x, unembedding, preferred_element_type=dtype)


def _scaled_logits(x, unembedding, temperature, dtype, product_dtype=None):
  """The chunk's :math:`z / T`, ``[c, V]`` in ``dtype`` (float32 or wider)."""
  if unembedding is None:
    logits = x.astype(dtype)
  else:
    logits = _product(x, unembedding, product_dtype, dtype)
  return logits / temperature


def _shifted(z, is_top, z_top):
  r""":math:`s = z' - \max z'` with :math:`s_{top} = 0` exactly, clamped at :data:`_LOG_UNDERFLOW`.

  The top entry is :math:`z' - z'`, 0 by construction rather than by the subtraction: under jit
  XLA may fuse :math:`z / T` into :math:`z - z_{top}` and round the two operands differently (one
  ulp, ~2e-6 at :math:`|z| \sim 16`), which would make :math:`\log p_{top} > 0` and :math:`H < 0`
  at confident positions. No ``jnp.where`` with a constant:
  under differentiation, ``lax.map``'s partial evaluation would hoist the constant's ``[c, V]``
  broadcast out of the loop, and the loop would read it from memory.
  """
  return jnp.maximum(z - jnp.where(is_top, z, z_top[:, None]), _LOG_UNDERFLOW)


def _chunk_forward(static: _Static, x, unembedding, tokens, temperature, fused: bool = True):
  r"""The statistics of one chunk, its logits :math:`z' = z / T` and ``(top, z_top, log_norm)``.

  Two passes over the chunk's logits: the argmax and max, then one pass of
  :func:`rft_jax.entropy.vocab_sum.vocab_sums` (``fused``: one variadic reduction; otherwise
  differentiable sums, for the reference that JAX differentiates) over terms of the
  shifted logits :math:`s_i = z'_i - \max_j z'_j` (:func:`_shifted`): the non-top mass
  :math:`\tau = \sum_{i \ne top} e^{s_i}`, :math:`m_1 = \sum_i e^{s_i} s_i`,
  :math:`\tau_2 = \sum_{i \ne top} e^{2 s_i}`, :math:`m_2 = \sum_i e^{2 s_i} s_i` and
  :math:`s_k`, with :math:`e^{s_i} s_i = 0` where :math:`e^{s_i} = 0` (the
  :math:`0 \log 0 = 0` convention). With :math:`Z = 1 + \tau`,
  :math:`\log Z = \mathrm{log1p}(\tau)` (the accurate normaliser of
  :func:`rft_jax.entropy.discriminator.log_softmax`) and :math:`\log p_i = s_i - \log Z`:

  .. math::  H = \log Z - m_1 / Z, \qquad
             \sum_i p_i^2 = (1 + \tau_2) / Z^2, \qquad
             \sum_i p_i^2 \log p_i = (m_2 - (1 + \tau_2) \log Z) / Z^2,

  :math:`\log p_k = s_k - \log Z`, :math:`S_* = p_k (H + \log p_k)` and
  :math:`\mathbb{E}_p[S] = H \sum_i p_i^2 + \sum_i p_i^2 \log p_i`.

  Why these are accurate in float32: :math:`s_i` and :math:`s_k` are exact given :math:`z'`
  (one subtraction of nearby values, or 0 at the top), each term is one ``exp`` and at most two
  products (a few ulps), the five sums' error is bounded by :mod:`rft_jax.entropy.vocab_sum`'s
  :math:`\gamma_{b - 1 + \lceil \log_2 \lceil V / b \rceil \rceil}` of their absolute sums, whatever
  :math:`V`, and both terms of :math:`H` are non-negative (no cancellation), so :math:`H` and
  :math:`\log p_k` are good to a few ulps of themselves. The usual :math:`-\sum_i p_i \log p_i`
  is not: :math:`\log p_i` carries an absolute error of a few ulps of :math:`|\log p_i|` (12 at
  Qwen's vocabulary), which :math:`p_i = e^{\log p_i}` turns into a relative one
  (``tests/test_token_stats_precision.py`` measures both).
  """
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  t = static.temperature if static.temperature is not None else temperature
  z = _scaled_logits(x, unembedding, t, dtype, static.product_dtype)
  top = jnp.argmax(z, axis=-1)
  z_top = jnp.max(z, axis=-1)
  is_top = jnp.arange(z.shape[-1]) == top[:, None]
  shifted = _shifted(z, is_top, z_top)
  e = jnp.exp(shifted)
  tail_e = e * jnp.logical_not(is_top).astype(dtype)
  sampled = (jnp.arange(z.shape[-1]) == tokens[:, None]).astype(dtype)
  # Fused, one variadic reduction: each [c, V] term has it as its only user, so XLA fuses them
  # all into it (on CPU too) and stores nothing [c, V]-sized but the logits. s_k is a masked
  # sum of the same pass (a gather would be one more read of the logits).
  terms = (tail_e, e * shifted, tail_e * tail_e, e * e * shifted, shifted * sampled)
  tail, m1, tail2, m2, s_k = vocab_sums(terms, fused=fused)
  log_norm = jnp.log1p(tail)
  norm = 1.0 + tail
  h = log_norm - m1 / norm
  sum_p2 = (1.0 + tail2) / (norm * norm)
  expected_s = h * sum_p2 + (m2 - (1.0 + tail2) * log_norm) / (norm * norm)
  logp = s_k - log_norm
  p_k, log_p_k = probs_and_safe_log(logp)
  stats = TokenStats(logp=logp, entropy=h, s_star=p_k * (h + log_p_k), expected_s=expected_s)
  return stats, z, top, z_top, log_norm


# The [c]-sized values the backward pass keeps (jax.checkpoint's policy in _chunked_stats);
# everything [c, V] is recomputed from the chunk's inputs.
_SAVED = ("token_stats_top", "token_stats_z_top", "token_stats_log_norm", "token_stats_entropy")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _chunk_stats(static: _Static, x, unembedding, tokens, temperature) -> TokenStats:
  """:class:`TokenStats` of one chunk ``x [c, F]``, with a closed-form derivative."""
  return _chunk_forward(static, x, unembedding, tokens, temperature)[0]


def _is_zero(tangent) -> bool:
  return tangent is None or isinstance(tangent, SymbolicZero)


def _chunk_stats_jvp(static: _Static, primals, tangents):
  r"""The statistics' tangents along those of ``(x, unembedding, temperature)``, linear in them.

  With :math:`z' = z / T` and :math:`p = \mathrm{softmax}(z')`,
  :math:`\partial \log p_k / \partial z' = e_k - p` (the GRPO logit direction of Theorem 2)
  and :math:`\partial H / \partial z'_i = -S_i = -p_i (\log p_i + H)` (Theorem 1, with
  :math:`0 \log 0 = 0`), so

  .. math::  \dot{\log p_k} = \langle e_k - p, \dot z' \rangle, \qquad
             \dot H = -\langle p \odot (\log p + H), \dot z' \rangle, \qquad
             \dot z' = (\dot x\, U + x\, \dot U) / T - s\, \dot T / T

  (:math:`s = z' - \max z'`: both directions sum to 0 over the vocabulary, so the shift
  drops out of the temperature's term). :math:`\dot H` only with ``entropy_grad``;
  :math:`S_*` and :math:`\mathbb{E}_p[S]` are stop-gradient (zero tangents). Reverse mode
  transposes this: the chunk's logit cotangent is, in one elementwise pass,
  :math:`\bar z' = \bar g_{\log p} (e_k - p) - \bar g_H\, p \odot (\log p + H)`, then
  :math:`\bar x = \bar z' U^\top / T` and :math:`\bar U = x^\top \bar z' / T`, products
  accumulated in float32 (or wider) and cast to the inputs' dtypes; the tokens get none.
  """
  x, unembedding, tokens, temperature = primals
  d_x, d_u, _, d_t = tangents
  stats, z, top, z_top, log_norm = _chunk_forward(static, *primals)
  names = dict(zip(_SAVED, (top, z_top, log_norm, stats.entropy)))
  top, z_top, log_norm, h = (checkpoint_name(v, n) for n, v in names.items())
  dtype = z.dtype
  t = static.temperature if static.temperature is not None else temperature
  # Tangents that are symbolically zero (inputs not differentiated) add nothing, and no product.
  parts = []
  if not _is_zero(d_x):
    parts.append(d_x.astype(dtype) if unembedding is None
                 else _product(d_x, unembedding, static.product_dtype, dtype))
  if unembedding is not None and not _is_zero(d_u):
    parts.append(_product(x, d_u, static.product_dtype, dtype))
  shifted = _shifted(z, jnp.arange(z.shape[-1]) == top[:, None], z_top)
  d_z = (parts[0] if len(parts) == 1 else parts[0] + parts[1]) / t if parts else jnp.zeros_like(z)
  if static.temperature is None and not _is_zero(d_t):
    d_z = d_z - shifted * (d_t / t)
  log_p = shifted - log_norm[:, None]
  p = jnp.exp(log_p)
  sampled = (jnp.arange(z.shape[-1]) == tokens[:, None]).astype(dtype)
  d_logp = vocab_sum((sampled - p) * d_z)
  # log p is finite (clamped) where p = 0, so p (log p + H) = 0 there.
  d_h = -vocab_sum(p * (log_p + h[:, None]) * d_z) if static.entropy_grad else jnp.zeros_like(h)
  zero = jnp.zeros_like(h)
  return stats, TokenStats(logp=d_logp, entropy=d_h, s_star=zero, expected_s=zero)


_chunk_stats.defjvp(_chunk_stats_jvp, symbolic_zeros=True)


def _static(temperature, entropy_grad: bool, product_dtype) -> tuple[_Static, jax.Array | None]:
  """The chunk's static part and its traced temperature (None when it is a Python number)."""
  if isinstance(temperature, (int, float)):
    return _Static(entropy_grad, float(temperature), product_dtype), None
  temperature = jnp.asarray(temperature)
  return _Static(entropy_grad, None, product_dtype), temperature.astype(jnp.promote_types(temperature.dtype, jnp.float32))


def _reference_stats(flat_x, flat_t, unembedding, temperature, entropy_grad: bool, product_dtype) -> TokenStats:
  """``chunk_size=None``: all positions as one chunk, differentiated by JAX (which keeps the
  block's ``[n, V]`` intermediates for the backward pass), the reference of the closed form: the
  chunk's formulas, with only ``logp`` (and ``entropy`` with ``entropy_grad``) carrying
  derivatives."""
  static, temperature = _static(temperature, entropy_grad, product_dtype)
  stats = _chunk_forward(static, flat_x, unembedding, flat_t, temperature, fused=False)[0]
  stop = jax.lax.stop_gradient
  return TokenStats(logp=stats.logp, entropy=stats.entropy if entropy_grad else stop(stats.entropy),
                    s_star=stop(stats.s_star), expected_s=stop(stats.expected_s))


def _chunked_stats(flat_x, flat_t, unembedding, temperature, chunk_size: int, entropy_grad: bool,
                   product_dtype=None) -> TokenStats:
  """``flat_x [n, F]`` in ``n // chunk_size`` chunks scanned by ``lax.map`` (and a last,
  shorter one), each a :func:`_chunk_stats` call."""
  static, temperature = _static(temperature, entropy_grad, product_dtype)
  # Differentiated, the backward pass keeps only the [c] values named _SAVED (and the inputs)
  # and recomputes the chunk's logits with one product: memory O(chunk x V) in both passes.
  chunk = jax.checkpoint(lambda x, t: _chunk_stats(static, x, unembedding, t, temperature),
                         policy=jax.checkpoint_policies.save_only_these_names(*_SAVED),
                         prevent_cse=False)
  n, f = flat_x.shape
  chunks, full = n // chunk_size, n // chunk_size * chunk_size
  stats = jax.lax.map(lambda xt: chunk(*xt), (flat_x[:full].reshape(chunks, chunk_size, f),
                                              flat_t[:full].reshape(chunks, chunk_size)))
  stats = [s.reshape(-1) for s in stats]
  if full < n:
    stats = [jnp.concatenate([a, b]) for a, b in zip(stats, chunk(flat_x[full:], flat_t[full:]))]
  return TokenStats(*stats)


def token_stats(
    inputs: Float[Array, "... F"],
    tokens: Int[Array, "..."],
    *,
    unembedding: Float[Array, "D V"] | None = None,
    temperature: float | Float[Array, ""] = 1.0,
    chunk_size: int | None = 512,
    entropy_grad: bool = False,
    product_dtype=None,
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
    product_dtype: the dtype ``inputs`` and ``unembedding`` are cast to for their product
      (still accumulated in float32): a model's compute dtype, so that the logits are the
      sampler's (:meth:`rft_jax.models.Qwen.logits`) and a bfloat16 model's product runs at the
      bfloat16 rate. ``unembedding``'s gradient is then each chunk's product cast back to its
      dtype, summed over the chunks in that dtype (float32 for float32 parameters). None: the
      operands as they are (a bfloat16 ``inputs`` times a float32 ``unembedding`` is a float32
      product).

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
  product_dtype = None if product_dtype is None else jnp.dtype(product_dtype)
  flat_x = inputs.reshape(-1, inputs.shape[-1])
  flat_t = tokens.reshape(-1)
  if chunk_size is None:
    stats = _reference_stats(flat_x, flat_t, unembedding, temperature, entropy_grad, product_dtype)
  elif flat_t.shape[0] <= chunk_size:
    # One chunk's closed form, its [n, V] residuals kept for the backward pass (no recomputation).
    static, traced_temperature = _static(temperature, entropy_grad, product_dtype)
    stats = _chunk_stats(static, flat_x, unembedding, flat_t, traced_temperature)
  else:
    # lax.map scans over chunks; each chunk's closed-form backward recomputes its logits
    # from [chunk] residuals, so neither pass ever holds more than one chunk of [., V].
    stats = _chunked_stats(flat_x, flat_t, unembedding, temperature, chunk_size, entropy_grad, product_dtype)
  return TokenStats(*(s.reshape(tokens.shape) for s in stats))
