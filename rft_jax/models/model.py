r"""The Qwen2 / Qwen2.5 / Qwen3 decoder in Flax NNX, with an incremental-decoding path.

Layers are stacked (every layer parameter has a leading ``layers`` axis, built with
``nnx.vmap``) and run with ``jax.lax.scan``: compile time does not grow with depth, and
``config.remat`` checkpoints one layer at a time. Forward::

  logits = model(input_ids, attention_mask)              # [B, T, V] float32
  hidden = model(input_ids, attention_mask, return_hidden=True)   # [B, T, D]
  logits = hidden @ model.unembedding()                  # the same, chunk by chunk if needed

Decoding (``cache`` is a :class:`~rft_jax.models.kv_cache.KVCache` pytree)::

  cache = model.init_cache(batch, max_len)
  logits, cache = model.prefill(prompt_ids, prompt_mask, cache)   # left-padded prompts
  logits, cache = model.decode_step(next_tokens, cache)           # one token per row
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from rft_jax.models.attention import Attention, attend, causal_padding_mask
from rft_jax.models.config import QwenConfig
from rft_jax.models.kv_cache import KVCache, init_cache
from rft_jax.models.layers import MLP, RMSNorm, normal_init, param


def positions_from_mask(attention_mask: Int[Array, "B T"]) -> Int[Array, "B T"]:
  """RoPE positions of a (left-)padded batch: ``cumsum(mask) - 1`` clipped at 0."""
  return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


class DecoderLayer(nnx.Module):
  """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

  def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
    c = config
    self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype,
                                   rngs=rngs)
    self.attn = Attention(c, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps,
                                            param_dtype=c.param_dtype, rngs=rngs)
    self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype=c.dtype,
                   param_dtype=c.param_dtype, rngs=rngs)

  def __call__(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"],
               mask: Bool[Array, "B T S"], kv=None, layer=None, index=None):
    """One layer.

    Args:
      x: residual stream.
      positions: RoPE positions of the T queries.
      mask: which keys each query sees (S = T without a cache, S = cache length with one).
      kv: ``None`` (attend within ``x``) or ``(k_all, v_all)`` ``[L, B, S, K, H]`` caches, into
        which this layer writes its T new keys/values at slot ``index`` of layer ``layer``.

    Returns:
      ``(x, kv)`` with ``kv`` updated (``None`` without a cache).
    """
    q, k, v = self.attn.qkv(self.input_layernorm(x), positions)
    if kv is None:
      o = attend(q, k, v, mask)
    else:
      k_all, v_all = kv
      start = (layer, 0, index, 0, 0)
      k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), start)
      v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), start)
      kv = (k_all, v_all)
      k_layer = jax.lax.dynamic_index_in_dim(k_all, layer, 0, keepdims=False)
      v_layer = jax.lax.dynamic_index_in_dim(v_all, layer, 0, keepdims=False)
      o = attend(q, k_layer.astype(q.dtype), v_layer.astype(q.dtype), mask)
    x = x + self.attn.out(o)
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, kv


class Qwen(nnx.Module):
  """Decoder-only language model covering Qwen2, Qwen2.5 and Qwen3 (see :class:`QwenConfig`)."""

  def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.embed_tokens = param(normal_init, rngs.params(), (c.vocab_size, c.hidden_size),
                              c.param_dtype, ("vocab", "embed"))

    @nnx.split_rngs(splits=c.num_hidden_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
      return DecoderLayer(c, rngs=rngs)

    self.layers = make_layers(rngs)
    self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, rngs=rngs)
    if not c.tie_word_embeddings:
      self.lm_head = param(normal_init, rngs.params(), (c.hidden_size, c.vocab_size),
                           c.param_dtype, ("embed", "vocab"))

  # ------------------------------------------------------------------------------------------
  # Pieces shared by the full forward and the cache path.

  def unembedding(self) -> Float[Array, "D V"]:
    """The output matrix (the embedding table transposed when tied), in the param dtype."""
    if self.config.tie_word_embeddings:
      return self.embed_tokens[...].T
    return self.lm_head[...]

  def logits(self, hidden: Float[Array, "... D"]) -> Float[Array, "... V"]:
    """``hidden @ unembedding()`` in the compute dtype, accumulated and returned in float32."""
    dtype = self.config.dtype
    return jnp.einsum("...d,dv->...v", hidden.astype(dtype), self.unembedding().astype(dtype),
                      preferred_element_type=jnp.float32)

  def _embed(self, input_ids: Int[Array, "B T"]) -> Float[Array, "B T D"]:
    return jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.config.dtype)

  def _layers(self, x, positions, mask, kv=None, index=None):
    """Scans the stacked layers; ``kv`` (the two cache arrays) rides in the carry."""
    graphdef, state = nnx.split(self.layers)

    def body(carry, xs):
      x, kv = carry
      layer_state, layer = xs
      x, kv = nnx.merge(graphdef, layer_state)(x, positions, mask, kv, layer, index)
      return (x, kv), None

    if self.config.remat:
      body = jax.checkpoint(body, prevent_cse=False)
    layer_ids = jnp.arange(self.config.num_hidden_layers, dtype=jnp.int32)
    (x, kv), _ = jax.lax.scan(body, (x, kv), (state, layer_ids))
    return self.norm(x), kv

  # ------------------------------------------------------------------------------------------
  # Full forward.

  def __call__(self, input_ids: Int[Array, "B T"], attention_mask: Int[Array, "B T"] | None = None,
               positions: Int[Array, "B T"] | None = None, *, return_hidden: bool = False
               ) -> Float[Array, "B T V"] | Float[Array, "B T D"]:
    """Logits (float32) of every position, or the final normed hidden states.

    Args:
      input_ids: token ids, left-padded when rows differ in length.
      attention_mask: 1 for tokens, 0 for padding; all ones when omitted.
      positions: RoPE positions; ``positions_from_mask(attention_mask)`` when omitted.
      return_hidden: return ``[B, T, D]`` hidden states after the final norm instead of logits.
    """
    if attention_mask is None:
      attention_mask = jnp.ones(input_ids.shape, jnp.int32)
    if positions is None:
      positions = positions_from_mask(attention_mask)
    hidden, _ = self._layers(self._embed(input_ids), positions,
                             causal_padding_mask(attention_mask))
    return hidden if return_hidden else self.logits(hidden)

  # ------------------------------------------------------------------------------------------
  # Incremental decoding.

  def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty :class:`KVCache` with ``max_len`` slots (dtype defaults to the compute dtype)."""
    return init_cache(self.config, batch, max_len, dtype)

  def extend(self, input_ids: Int[Array, "B T"], token_mask: Int[Array, "B T"], cache: KVCache
             ) -> tuple[Float[Array, "B T D"], KVCache]:
    """Appends T slots to every row and returns their final hidden states.

    Slot ``cache.index + t`` of row ``b`` holds ``input_ids[b, t]`` if ``token_mask[b, t]``,
    else padding. Each query attends to the real tokens in slots up to its own. The caller keeps
    ``cache.index + T <= cache.max_len`` (the write is clamped otherwise).
    """
    t = input_ids.shape[1]
    if t > cache.max_len:
      raise ValueError(f"extend: {t} new tokens exceed the cache length {cache.max_len}")
    token_mask = token_mask.astype(jnp.int32)
    positions = jnp.maximum(
        cache.positions[:, None] + jnp.cumsum(token_mask, axis=-1) - 1, 0)
    slot_mask = jax.lax.dynamic_update_slice(cache.slot_mask, token_mask.astype(jnp.bool_),
                                             (0, cache.index))
    slots = jnp.arange(cache.max_len)
    query_slots = cache.index + jnp.arange(t)
    mask = (slots[None, :] <= query_slots[:, None])[None] & slot_mask[:, None, :]
    hidden, (k, v) = self._layers(self._embed(input_ids), positions, mask,
                                  (cache.k, cache.v), cache.index)
    cache = KVCache(k=k, v=v, slot_mask=slot_mask,
                    positions=cache.positions + jnp.sum(token_mask, axis=-1),
                    index=cache.index + t)
    return hidden, cache

  def prefill(self, input_ids: Int[Array, "B T"], attention_mask: Int[Array, "B T"],
              cache: KVCache) -> tuple[Float[Array, "B V"], KVCache]:
    """Runs a left-padded prompt batch into ``cache``; returns the last position's logits."""
    hidden, cache = self.extend(input_ids, attention_mask, cache)
    return self.logits(hidden[:, -1]), cache

  def decode_step(self, tokens: Int[Array, "B"], cache: KVCache
                  ) -> tuple[Float[Array, "B V"], KVCache]:
    """Feeds one token per row; returns the next-token logits ``[B, V]`` and the cache."""
    hidden, cache = self.extend(tokens[:, None], jnp.ones((tokens.shape[0], 1), jnp.int32), cache)
    return self.logits(hidden[:, 0]), cache
