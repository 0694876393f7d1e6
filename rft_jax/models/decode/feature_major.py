r"""Decoding with feature-major activations: the CPU form of :meth:`Qwen.decode_step`.

A decode step multiplies a few rows (the batch, ``B`` of 8-256) by every weight matrix. On
XLA:CPU the products run faster weight-first, ``W^T [out, in] x h [in, B]``, than row-first,
``h^T [B, in] x W [in, out]``: the kernels tile the long ``out`` axis, where row-first tiles
leave a remainder of the few ``B`` rows, and split unevenly over the cores (figures:
``docs/results/cpu.md#feature-major-decoding``).

So this path keeps every activation feature-major (``[D, B]``, ``[N, H, B]``, ``[F, B]``) from
the embedding to the logits (``[V, B]``, which the samplers take with ``vocab_axis=0``), with
weights transposed once per decode loop into a :class:`DecodeWeights` (each layer's q, k and v
projections stacked into one matrix, gate and up into another). Attention reads the same
:class:`~rft_jax.models.kv_cache.KVCache` as :meth:`Qwen.decode_step` (rows transposed in and
out: ``B x N x H`` values). The arithmetic is that of :meth:`Qwen.decode_step` in the same dtypes
(RMSNorm and softmax in float32, products in the compute dtype); only the summation order of
the products differs (``tests/test_models_cache.py`` compares the two).

The transposed weights are a copy of the layer weights, held while the loop runs (slicing the
stacked weights inside the loop instead would copy them at every step: on XLA:CPU a slice
feeding a matrix product is a copy)::

  weights = decode_weights(model)               # once, outside the loop
  logits, cache = decode_step(model, weights, next_tokens, cache)   # [V, B] float32
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rft_jax.models.decode import cpu_attention
from rft_jax.models.attention import MASKED_SCORE
from rft_jax.models.kv_cache import KVCache, query_slots, visible_slots, write_slots
from rft_jax.models.layers import rms_norm, rotate
from rft_jax.models.moe import ExpertWeights, sparse_block


@flax.struct.dataclass
class LayerWeights:
  """One decoder layer's weights, transposed to ``[out, in]`` and cast to the compute dtype.

  Attributes:
    input_norm, post_norm: ``[D]`` RMSNorm scales.
    qkv: ``[(N + 2K) H, D]`` the q, k and v projections, stacked.
    qkv_bias: ``[(N + 2K) H]`` or None.
    q_norm, k_norm: ``[H]`` per-head RMSNorm scales (Qwen3) or None.
    o: ``[D, N H]`` the output projection; ``o_bias``: ``[D]`` or None.
    gate_up: ``[2F, D]`` the gate and up projections, stacked; ``down``: ``[D, F]`` (None in
      an MoE layer).
    moe: an MoE layer's :class:`~rft_jax.models.moe.ExpertWeights` in the compute dtype, as
      stored (the block runs token-major on the few rows: ``[B, D]`` in and out); None when
      dense.
  """

  input_norm: Array
  qkv: Array
  qkv_bias: Array | None
  q_norm: Array | None
  k_norm: Array | None
  o: Array
  o_bias: Array | None
  post_norm: Array
  gate_up: Array | None
  down: Array | None
  moe: ExpertWeights | None = None


@flax.struct.dataclass
class DecodeWeights:
  """Every weight a feature-major decode step reads.

  Attributes:
    layers: one :class:`LayerWeights` per layer.
    norm: ``[D]`` the final RMSNorm scale.
    embed: ``[V, D]`` the embedding table (as stored).
    unembed: ``[V, D]`` the output matrix, vocabulary-major (the embedding table when tied).
  """

  layers: tuple[LayerWeights, ...]
  norm: Array
  embed: Array
  unembed: Array


def decode_weights(model, layers: Sequence | None = None) -> DecodeWeights:
  """The :class:`DecodeWeights` of a :class:`~rft_jax.models.Qwen` (one copy of the layers:
  ``layers``, the model's :meth:`~rft_jax.models.Qwen.unstacked_layers`, transposed; sliced here
  when None). A model with LoRA adapters is refused: decode its
  :func:`~rft_jax.models.lora_model.merged` model."""
  c = model.config
  if c.lora is not None:
    raise ValueError("decode_weights: the model has LoRA adapters, which this path does not read; "
                     "decode rft_jax.models.lora_model.merged(model)")
  dtype = c.dtype

  def stack_rows(names, module):  # [D, ...] projections -> [sum(out), D]
    return jnp.concatenate([getattr(module, n)[...].reshape(c.hidden_size, -1) for n in names],
                           axis=1).T.astype(dtype)

  def transposed(layer) -> LayerWeights:  # one DecoderLayer
    attn, mlp = layer.attn, layer.mlp
    bias = None
    if c.attention_bias:
      bias = jnp.concatenate([getattr(attn, f"{n}_bias")[...].reshape(-1) for n in "qkv"])
      bias = bias.astype(dtype)
    return LayerWeights(
        input_norm=layer.input_layernorm.scale[...],
        qkv=stack_rows(("q_proj", "k_proj", "v_proj"), attn),
        qkv_bias=bias,
        q_norm=attn.q_norm.scale[...] if c.qk_norm else None,
        k_norm=attn.k_norm.scale[...] if c.qk_norm else None,
        o=attn.o_proj[...].reshape(-1, c.hidden_size).T.astype(dtype),
        o_bias=attn.o_bias[...].astype(dtype) if c.attention_out_bias else None,
        post_norm=layer.post_attention_layernorm.scale[...],
        gate_up=None if c.is_moe else stack_rows(("gate_proj", "up_proj"), mlp),
        down=None if c.is_moe else mlp.down_proj[...].T.astype(dtype),
        moe=mlp.expert_weights().astype(dtype) if c.is_moe else None,
    )

  embed = model.embed_tokens[...]
  unembed = embed if c.tie_word_embeddings else model.lm_head[...].T
  layers = model.unstacked_layers() if layers is None else layers
  return DecodeWeights(layers=tuple(map(transposed, layers)),
                       norm=model.norm.scale[...], embed=embed, unembed=unembed.astype(dtype))


def attend(q: Float[Array, "B K G H"], k_cache: Float[Array, "B K H S"],
           v_cache: Float[Array, "B K S H"], mask: Bool[Array, "B S"]) -> Float[Array, "B K G H"]:
  r"""One query per row against its cache: :func:`~rft_jax.models.attention.attend_cache` with
  the scores summed elementwise in float32 instead of a batched matrix product.

  Each of the ``B K`` products has only ``G`` (query heads per key head) rows, which XLA:CPU's
  matrix kernels tile poorly; the elementwise sum reads each cached key once, along contiguous
  slots, and makes the decode step a little faster than the product. Attention is still a large
  share of that step: the sum over ``H`` is a reduction, which XLA:CPU runs on one thread (a
  ``jax.profiler`` trace shows it); summed as 64 products added pairwise, an elementwise fusion
  split over the cores, the step gains too little for 64-term kernels. So on one CPU device the
  sampler runs :func:`rft_jax.models.decode.cpu_attention.attend` instead, a compiled kernel that reads
  only each row's live slots, on both cores, a faster step. Figures:
  ``docs/results/cpu.md#feature-major-decoding``.
  """
  h = q.shape[-1]
  scores = jnp.sum(q[..., None].astype(jnp.float32) * k_cache[:, :, None].astype(jnp.float32),
                   axis=3) * (h ** -0.5)  # [B, K, G, S]
  scores = jnp.where(mask[:, None, None, :], scores, MASKED_SCORE)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum("bkgs,bksh->bkgh", probs, v_cache.astype(q.dtype))


def decode_step(model, weights: DecodeWeights, tokens: Int[Array, "B"], cache: KVCache,
                attention: Callable = attend, live: Bool[Array, "B"] | None = None,
                return_routing: bool = False) -> tuple[Float[Array, "V B"], KVCache]:
  """:meth:`Qwen.decode_step` (one token per row), returning the logits vocabulary-major.

  Args:
    model: the :class:`~rft_jax.models.Qwen` (its config and RoPE tables).
    weights: :func:`decode_weights` of ``model``.
    tokens: ``[B]`` each row's latest token.
    cache: the decode cache; slot ``cache.index`` (shared or per row) receives the tokens. Its
      keys may be tiled (:func:`rft_jax.models.decode.cpu_attention.tile_keys`) when ``attention`` is
      the kernel, which reads both layouts.
    attention: :func:`attend`, or what computes the same
      (:func:`rft_jax.models.decode.cpu_attention.attend`, a compiled kernel).
    live: ``[B]`` the rows whose logits the caller keeps (None: all). The others, such as a
      continuous pool's stopped slots, attend to the slot they write only, so that the kernel,
      which reads a row's live slots only, skips their caches; their logits mean nothing.
    return_routing: an MoE model also returns each layer's expert ids of the tokens.

  Returns:
    ``(logits [V, B] float32, cache)``, and with ``return_routing`` the expert ids
    ``[L, B, k]`` int32 as a third element.
  """
  c = model.config
  dtype, eps = c.dtype, c.rms_norm_eps
  n, k, h = c.num_attention_heads, c.num_key_value_heads, c.head_dim
  b = tokens.shape[0]
  slots = jnp.arange(cache.max_len)
  slot_mask = write_slots(cache.slot_mask, jnp.ones((b, 1), bool), cache.index, axis=1)
  mask = visible_slots(slot_mask, query_slots(cache.index, b, 1))[:, 0]  # [B, S]
  if live is not None:  # the slot written (clamped to the last, as the write is)
    written = slots == jnp.minimum(jnp.reshape(cache.index, (-1, 1)), cache.max_len - 1)
    mask = jnp.where(live[:, None], mask, written)
  # RoPE at each row's position, [H, B]: from the tables of every slot, computed once per loop.
  tables = model.rope(slots[None])  # [1, S, 1, H] each
  cos, sin = (jnp.take(t[0, :, 0], cache.positions, axis=0, mode="clip").T for t in tables)

  x = jnp.take(weights.embed, tokens, axis=0).astype(dtype).T  # [D, B]
  if return_routing and not c.is_moe:
    raise ValueError(f"decode_step: return_routing needs an MoE model, not {c.model_type!r}")
  k_all, v_all, expert_ids = [], [], []
  for layer, k_cache, v_cache in zip(weights.layers, cache.k, cache.v):
    qkv = layer.qkv @ rms_norm(x, layer.input_norm, eps, axis=0)  # [(N + 2K) H, B]
    if layer.qkv_bias is not None:
      qkv = qkv + layer.qkv_bias[:, None]
    qkv = qkv.reshape(n + 2 * k, h, -1)
    q, key, value = qkv[:n], qkv[n:n + k], qkv[n + k:]  # [heads, H, B]
    if layer.q_norm is not None:
      q, key = rms_norm(q, layer.q_norm, eps, axis=1), rms_norm(key, layer.k_norm, eps, axis=1)
    q, key = rotate(q, cos, sin, axis=1), rotate(key, cos, sin, axis=1)
    if k_cache.ndim == 5:  # keys tiled for the CPU kernel (cpu_attention.tile_keys)
      k_cache = cpu_attention.write_tiled_keys(k_cache, key.transpose(2, 0, 1), cache.index)
    else:
      k_cache = write_slots(k_cache, key.transpose(2, 0, 1)[..., None], cache.index, axis=3)
    v_cache = write_slots(v_cache, value.transpose(2, 0, 1)[:, :, None], cache.index, axis=2)
    o = attention(q.reshape(k, n // k, h, -1).transpose(3, 0, 1, 2), k_cache, v_cache, mask)
    x = x + layer.o @ o.reshape(o.shape[0], n * h).T  # o: [B, K, G, H]
    if layer.o_bias is not None:
      x = x + layer.o_bias[:, None]
    if layer.moe is not None:  # token-major: [B, D] rows through the grouped products
      y, routing = sparse_block(rms_norm(x, layer.post_norm, eps, axis=0).T, layer.moe,
                                c.num_experts_per_tok, c.norm_topk_prob, vmappable=True)
      x = x + y.T
      expert_ids.append(routing.expert_ids)
    else:
      gate_up = layer.gate_up @ rms_norm(x, layer.post_norm, eps, axis=0)  # [2F, B]
      gate, up = jnp.split(gate_up, 2)
      x = x + layer.down @ (jax.nn.silu(gate) * up)
    k_all.append(k_cache)
    v_all.append(v_cache)
  hidden = rms_norm(x, weights.norm, eps, axis=0)
  logits = jnp.matmul(weights.unembed, hidden, preferred_element_type=jnp.float32)
  cache = KVCache(k=tuple(k_all), v=tuple(v_all), slot_mask=slot_mask,
                  positions=cache.positions + 1, index=cache.index + 1)
  return (logits, cache, jnp.stack(expert_ids)) if return_routing else (logits, cache)
