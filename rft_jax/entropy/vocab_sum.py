r"""Sums over the vocabulary whose float32 rounding error does not grow with its size.

Every statistic of a softmax policy is a sum over the vocabulary: the normaliser, the entropy,
:math:`\sum_i p_i^2`, the derivatives' inner products. Summed in one sequential loop, each
of :math:`V` terms passes through up to :math:`V - 1` additions, and the error bound is
:math:`\gamma_{V-1} \sum_i |x_i|` with :math:`\gamma_n = n u / (1 - n u)` and
:math:`u = 2^{-24}` in float32 (Higham, *Accuracy and Stability of Numerical Algorithms*,
2nd ed., §4.2): about :math:`9 \times 10^{-3}` of the terms' magnitude at Qwen's 151,936
entries. That is what a variadic ``lax.reduce`` gives on XLA:CPU, which emits it as one loop per
row (it vectorises single-output reductions only): the chunked token statistics' entropy was
far less accurate at Qwen's vocabulary than with separate sums (issue 59; figures:
``docs/results/precision.md``).

:func:`vocab_sums` fixes the order instead of leaving it to the backend: consecutive blocks of
:math:`b` entries (:func:`vocab_block`, at most 128) are summed in one pass (one read of the terms,
however many there are), then the :math:`\lceil V / b \rceil` block sums are added pairwise,
halving the columns until one is left. Each entry passes through at most
:math:`b - 1 + \lceil \log_2 \lceil V / b \rceil \rceil` additions, in any order the backend
takes within a block, so

.. math:: \Big| \widehat{\textstyle\sum_i} x_i - \sum_i x_i \Big| \le
          \gamma_{b - 1 + \lceil \log_2 \lceil V / b \rceil \rceil} \sum_i |x_i|,

:math:`138 u` of the absolute sum at :math:`V = 151{,}936` (:math:`b = 128`), :math:`69 u` at
4,096 (:math:`b = 64`), against :math:`V - 1` for the loop: the bound grows with the logarithm of
the vocabulary, not with the vocabulary. The block sums are a ``[..., V / b]`` array, 1/128 of
the terms' bytes at a real vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

# The largest block: its sums are 1/128 of the terms' bytes, and its own bound (127 additions)
# about that of the pairwise stage over Qwen's 1,187 blocks.
MAX_VOCAB_BLOCK = 128


def vocab_block(vocab: int) -> int:
  """Entries summed one after another: the power of two at or above :math:`\\sqrt{V}`, at most
  :data:`MAX_VOCAB_BLOCK` (8 at 64 entries, 64 at 4,096, 128 from 16,385 on)."""
  return min(MAX_VOCAB_BLOCK, 1 << math.isqrt(max(vocab - 1, 0)).bit_length())


def _pairwise(sums: tuple[Float[Array, "... n"], ...]) -> tuple[Float[Array, "..."], ...]:
  """Each array's last axis added pairwise: zero-padded to a power of two, then halved."""
  n = sums[0].shape[-1]
  width = 1 << (n - 1).bit_length()
  pad = [(0, 0)] * (sums[0].ndim - 1) + [(0, width - n)]
  sums = tuple(jnp.pad(s, pad) for s in sums)
  while width > 1:
    width //= 2
    sums = tuple(s[..., :width] + s[..., width:] for s in sums)
  return tuple(s[..., 0] for s in sums)


def vocab_sums(terms: tuple[Float[Array, "... V"], ...], *, fused: bool = True) -> tuple[Float[Array, "..."], ...]:
  """Each term summed over its last axis, blocked then pairwise (the module's bound).

  Args:
    terms: arrays of one shape and dtype, usually elementwise expressions of the same logits.
    fused: sum the blocks of every term in one variadic ``lax.reduce``, so that XLA fuses the
      terms into a single pass that stores nothing ``[..., V]``-sized (the forward of a chunk of
      :func:`rft_jax.entropy.token_stats`). A variadic reduce has no derivative: differentiated
      (or transposed) sums take ``fused=False``, one ``jnp.sum`` per term and block.

  Returns:
    The sums, one ``[...]`` array per term.
  """
  shape, vocab = terms[0].shape[:-1], terms[0].shape[-1]
  block = vocab_block(vocab)
  blocks = -(-vocab // block)
  pad = [(0, 0)] * len(shape) + [(0, blocks * block - vocab)]
  terms = tuple(jnp.pad(t, pad).reshape(*shape, blocks, block) for t in terms)
  if fused:
    zeros = tuple(jnp.zeros((), t.dtype) for t in terms)
    sums = jax.lax.reduce(terms, zeros, lambda a, b: tuple(x + y for x, y in zip(a, b)), (len(shape) + 1,))
  else:
    sums = tuple(jnp.sum(t, axis=-1) for t in terms)
  return _pairwise(sums)


def vocab_sum(x: Float[Array, "... V"]) -> Float[Array, "..."]:
  """One differentiable sum over the last axis, in :func:`vocab_sums`' order."""
  return vocab_sums((x,), fused=False)[0]
