r"""One decoder layer of the Qwen models: attention, then a dense SwiGLU MLP or a sparse
mixture of experts (:mod:`rft_jax.models.moe`), each pre-normed and residual.

The full forward (:meth:`DecoderLayer.__call__`) can route an MoE layer by given expert ids and
return its :class:`~rft_jax.models.moe.Routing`; the cache paths (prefill, extend, attend_with)
route by the layer's own top-k. (``Qwen``: :class:`rft_jax.models.model.Qwen`.)
"""

from __future__ import annotations

from typing import Callable

import jax
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from rft_jax.models.attention import Attention, attend, attend_cache
from rft_jax.models.config import QwenConfig
from rft_jax.models.kv_cache import write_slots
from rft_jax.models.layers import MLP, RMSNorm
from rft_jax.models.moe import MoE, Routing

# (q, k, v, valid) -> attention output: causal_self_attention with the model's kind and mesh.
SelfAttention = Callable[..., Float[Array, "B T N H"]]
Rope = tuple[Float[Array, "B T 1 H"], Float[Array, "B T 1 H"]]


class DecoderLayer(nnx.Module):
  """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (``mlp``: an
  :class:`~rft_jax.models.layers.MLP`, or an :class:`~rft_jax.models.moe.MoE` when
  ``config.is_moe``)."""

  def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
    c = config
    self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype,
                                   rngs=rngs)
    self.attn = Attention(c, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps,
                                            param_dtype=c.param_dtype, rngs=rngs)
    if c.is_moe:
      self.mlp = MoE(c, rngs=rngs)
    else:
      self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype=c.dtype,
                     param_dtype=c.param_dtype, rngs=rngs, lora=c.lora)

  def __call__(self, x: Float[Array, "B T D"], rope: Rope, valid: Bool[Array, "B T"],
               attention: SelfAttention, expert_ids: Int[Array, "B T k"] | None = None, *,
               return_routing: bool = False, mesh: Mesh | None = None
               ) -> Float[Array, "B T D"] | tuple[Float[Array, "B T D"], Routing]:
    """One layer, causal self-attention within ``x`` (``valid``: the real tokens; ``rope``:
    :meth:`Qwen.rope` of the tokens' positions, shared by the layers). An MoE layer routes by
    ``expert_ids`` when given (replay) and, with ``return_routing``, returns its
    :class:`~rft_jax.models.moe.Routing` too: ``(x, routing)``; ``mesh``: the mesh the arrays
    live on (the MoE block's expert parallelism and product; None: one device)."""
    q, k, v = self.attn.qkv(self.input_layernorm(x), rope)
    x = x + self.attn.out(attention(q, k, v, valid))
    y, routing = self.feed_forward(self.post_attention_layernorm(x), expert_ids, mesh=mesh)
    return (x + y, routing) if return_routing else x + y

  def feed_forward(self, h: Float[Array, "B T D"], expert_ids: Int[Array, "B T k"] | None = None,
                   *, decoding: bool = False, mesh: Mesh | None = None
                   ) -> tuple[Float[Array, "B T D"], Routing | None]:
    """The MLP or MoE block on the normed residual ``h``: ``(y, routing)``, routing None for
    a dense layer (which takes no ``expert_ids``). ``decoding``: the cache paths' MoE form,
    which ``jax.vmap`` takes and ``jax.grad`` does not
    (:func:`~rft_jax.models.moe.grouped_experts`)."""
    if isinstance(self.mlp, MoE):
      return self.mlp(h, expert_ids, vmappable=decoding, mesh=mesh)
    if expert_ids is not None:
      raise ValueError("DecoderLayer: expert_ids given to a dense layer (no experts)")
    return self.mlp(h), None

  def prefill(self, x: Float[Array, "B T D"], rope: Rope, valid: Bool[Array, "B T"],
              attention: SelfAttention, k_cache: Float[Array, "B K H S"],
              v_cache: Float[Array, "B K S H"], *, last_only: bool = False,
              return_routing: bool = False):
    """:meth:`__call__` on a prompt that also writes its keys/values at slots ``[0, T)`` of an
    empty cache layer. Attention reads them as stored (in the cache dtype), as decoding will.
    With ``last_only`` only the last position goes on past the cache write (``[B, 1, D]``).

    Returns:
      ``(x, k_cache, v_cache)``, and with ``return_routing`` the MoE block's
      :class:`~rft_jax.models.moe.Routing` of the positions that went on (None when dense).
    """
    q, k, v = self.attn.qkv(self.input_layernorm(x), rope)
    k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 3, 1), (0, 0, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3), (0, 0, 0, 0))
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    if last_only:  # one query: the plain product, against the real keys
      x, o = x[:, -1:], attend(q[:, -1:], k, v, valid[:, None, :])
    else:
      o = attention(q, k, v, valid)
    x, routing = self._residual(x, o)
    return (x, k_cache, v_cache, routing) if return_routing else (x, k_cache, v_cache)

  def extend(self, x: Float[Array, "B T D"], rope: Rope, mask: Bool[Array, "B T S"],
             k_cache: Float[Array, "B K H S"], v_cache: Float[Array, "B K S H"],
             index: Int[Array, ""] | Int[Array, "B"], *, return_routing: bool = False):
    """One layer on T new tokens: writes their keys/values at slots ``[index, index + T)`` of
    this layer's cache (``index``: shared, or ``[B]`` one per row), then attends to the cache
    (``mask``: which slots each query sees; ``rope``: :meth:`Qwen.rope` of the tokens'
    positions, shared by the layers).

    Returns:
      ``(x, k_cache, v_cache)``, and with ``return_routing`` the MoE block's
      :class:`~rft_jax.models.moe.Routing` (None when dense).
    """
    q, k, v = self.attn.qkv(self.input_layernorm(x), rope)
    k_cache = write_slots(k_cache, k.transpose(0, 2, 3, 1), index, axis=3)
    v_cache = write_slots(v_cache, v.transpose(0, 2, 1, 3), index, axis=2)
    o = attend_cache(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)
    x, routing = self._residual(x, o)
    return (x, k_cache, v_cache, routing) if return_routing else (x, k_cache, v_cache)

  def attend_with(self, x: Float[Array, "B T D"], rope: Rope, attention, *,
                  return_routing: bool = False):
    """One layer on new tokens whose attention another cache computes: ``attention(q, k, v)``
    (``[B, T, N, H]``, ``[B, T, K, H]`` twice) returns ``(o, cache)``, the output and that
    cache with the tokens' keys and values (a paged cache's, :meth:`Qwen.paged_decode_step`).

    Returns:
      ``(x, cache)``, and with ``return_routing`` the MoE block's
      :class:`~rft_jax.models.moe.Routing` (None when dense).
    """
    q, k, v = self.attn.qkv(self.input_layernorm(x), rope)
    o, cache = attention(q, k, v)
    x, routing = self._residual(x, o)
    return (x, cache, routing) if return_routing else (x, cache)

  def _residual(self, x: Float[Array, "B T D"], o: Float[Array, "B T N H"]
                ) -> tuple[Float[Array, "B T D"], Routing | None]:
    """The cache paths' rest of the layer: ``(x, routing)`` after the attention output ``o``."""
    x = x + self.attn.out(o)
    y, routing = self.feed_forward(self.post_attention_layernorm(x), decoding=True)
    return x + y, routing
