r"""The Qwen2 / Qwen2.5 / Qwen3 decoder in Flax NNX, with an incremental-decoding path.

Layers are stacked (every layer parameter has a leading ``layers`` axis, built with
``nnx.vmap``) and run with ``jax.lax.scan``: compile time does not grow with depth, and
``config.remat`` checkpoints one layer at a time. Forward::

  logits = model(input_ids, attention_mask)              # [B, T, V] float32
  hidden = model(input_ids, attention_mask, return_hidden=True)   # [B, T, D]
  logits = hidden @ model.unembedding()                  # the same, chunk by chunk if needed

An MoE model (``config.is_moe``: :mod:`rft_jax.models.moe`) can also return its routing and
replay a given one::

  logits, routing = model(input_ids, attention_mask, return_routing=True)
  # routing.router_logits [L, B, T, E] float32, routing.expert_ids [L, B, T, k] int32
  logits = model(input_ids, attention_mask, expert_ids=routing.expert_ids)   # replayed

The full forward and the prefill run causal self-attention with ``config.attention``
(:func:`~rft_jax.models.attention.causal_self_attention`: memory linear in T); pass
``mesh=`` the mesh the arrays live on, which names the backend and lets the TPU kernel run per
device.

Decoding (``cache`` is a :class:`~rft_jax.models.kv_cache.KVCache` pytree)::

  cache = model.init_cache(batch, max_len)
  logits, cache = model.prefill(prompt_ids, prompt_mask, cache)   # left-padded prompts
  logits, cache = model.decode_step(next_tokens, cache)           # one token per row

A decode loop on CPU runs :mod:`rft_jax.models.decode.feature_major` instead (the same step with
weight-first products on weights transposed once per loop; ``[V, B]`` logits), its attention by
a compiled kernel on one device (:mod:`rft_jax.models.decode.cpu_attention`).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from rft_jax.models.attention import causal_self_attention
from rft_jax.models.config import QwenConfig
from rft_jax.models.decoder_layer import DecoderLayer, Rope, SelfAttention
from rft_jax.models.kv_cache import (KVCache, init_cache, query_slots, visible_slots,
                                     write_slots)
from rft_jax.models.decode.paged_kv import PagedKVCache, paged_attention, write_token
from rft_jax.models.layers import RMSNorm, normal_init, param, rope_cos_sin
from rft_jax.models.moe import Routing


def positions_from_mask(attention_mask: Int[Array, "B T"]) -> Int[Array, "B T"]:
  """RoPE positions of a (left-)padded batch: ``cumsum(mask) - 1`` clipped at 0."""
  return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


class Qwen(nnx.Module):
  """Decoder-only language model covering Qwen2, Qwen2.5, Qwen3 and their MoE forms (see
  :class:`QwenConfig`)."""

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

  def rope(self, positions: Int[Array, "B T"]) -> Rope:
    """The RoPE cos/sin tables at ``positions``: the same for every layer, so computed once
    per forward pass (or decode loop), outside the layers."""
    c = self.config
    return rope_cos_sin(positions, c.head_dim, c.rope_theta, c.dtype)

  def self_attention(self, mesh: Mesh | None = None) -> SelfAttention:
    """The causal self-attention of the full forward and the prefill (``config.attention``)."""
    return functools.partial(causal_self_attention, kind=self.config.attention, mesh=mesh)

  def _layers(self, x, positions, valid, mesh, expert_ids=None, return_routing=False):
    """Scans the stacked layers (the full forward); ``(hidden, routing)``, routing stacked
    ``[L, ...]`` with ``return_routing``, else None."""
    graphdef, state = nnx.split(self.layers)
    rope = self.rope(positions)
    attention = self.self_attention(mesh)

    def body(x, inputs):
      layer_state, ids = inputs
      out = nnx.merge(graphdef, layer_state)(x, rope, valid, attention, ids,
                                             return_routing=return_routing, mesh=mesh)
      return out if return_routing else (out, None)

    if self.config.remat:
      body = jax.checkpoint(body, prevent_cse=False)
    x, routing = jax.lax.scan(body, x, (state, expert_ids))
    return self.norm(x), routing

  def unstacked_layers(self, at: Sequence[Int[Array, ""]] | None = None
                       ) -> tuple[DecoderLayer, ...]:
    """The stacked layers as L separate modules, each parameter sliced at its layer index.

    The cache path runs the layers one by one. On XLA:CPU and XLA:GPU a slice that feeds a
    matrix product is a copy of that layer's weights (on TPUs it is not), so a loop that slices
    inside its ``while_loop`` body copies every layer's weights at every step; one that calls
    this once outside and passes the result as ``layers=`` copies them once per call (and holds
    the copy while it runs). The sampler's GPU loop does so; its CPU loop holds
    :func:`~rft_jax.models.decode.feature_major.decode_weights` instead.

    Args:
      at: the layer indices ``0 .. L-1`` as traced int32 scalars, one per layer, to slice at
        those instead of at constant offsets. XLA compiles a kernel once for all the places
        that run the same computation; a constant offset makes every kernel that reads a
        layer's weights (the slices, and the norms and transposes they fuse into) a different
        computation per layer, L copies to compile. Indices that arrive as arguments of the
        program keep them one (on XLA:CPU; the sampler slices at constant offsets on GPUs and
        TPUs, see ``sample_loop``), and the sampler's CPU program compiles faster
        (``docs/results/cpu.md#the-cpu-samplers-compile-time``). Indices made inside the
        program are constants, which XLA folds back into the slices.
    """
    graphdef, state = nnx.split(self.layers)
    if at is None:
      return tuple(nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
                   for i in range(self.config.num_hidden_layers))
    if len(at) != self.config.num_hidden_layers:
      raise ValueError(f"unstacked_layers: {len(at)} layer indices for "
                       f"{self.config.num_hidden_layers} layers")
    return tuple(nnx.merge(graphdef, jax.tree.map(
        lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), state)) for i in at)

  def state_in_compute_dtype(self) -> nnx.State:
    """The model's state with its matrices and biases in ``config.dtype``, the dtype every
    product casts them to before use; the norm scales, which RMSNorm casts to its input's dtype,
    as stored. A model merged from it computes the same results; with float32 parameters and
    bfloat16 compute its weights take half the bytes."""
    def cast(path, a):
      norm_scale = any(getattr(k, "key", None) == "scale" for k in path)
      return a if norm_scale else a.astype(self.config.dtype)

    return jax.tree_util.tree_map_with_path(cast, nnx.state(self))

  def _check_routing(self, return_routing: bool) -> None:
    if return_routing and not self.config.is_moe:
      raise ValueError(f"Qwen: expert_ids / return_routing need an MoE model; model_type "
                       f"{self.config.model_type!r} has no experts")

  def _cached_layers(self, x, positions, mask, cache: KVCache,
                     layers: tuple[DecoderLayer, ...] | None):
    """The layers one by one over their own caches (decoding; see ``kv_cache``'s layout note);
    ``(hidden, k, v, expert_ids)``, expert ids stacked ``[L, B, T, k]`` (None when dense).

    Unrolled rather than scanned: each layer's cache is then read and written in place.
    ``layers``: :meth:`unstacked_layers`, or None to slice them here.
    """
    # RoPE tables of positions 0 .. S-1 (a row's position never exceeds its slot count): they
    # depend on shapes only, so XLA computes them once, outside a decode loop, and a step only
    # gathers its rows (computed per step, the cos/sin were fused into, and recomputed by, every
    # layer's q and k).
    tables = self.rope(jnp.arange(cache.max_len)[None])  # [1, S, 1, H] each
    rope = tuple(jnp.take(t[0], positions, axis=0, mode="clip") for t in tables)
    k_all, v_all, routings = [], [], []
    for i, layer in enumerate(self.unstacked_layers() if layers is None else layers):
      x, k, v, routing = layer.extend(x, rope, mask, cache.k[i], cache.v[i], cache.index,
                                      return_routing=True)
      k_all.append(k)
      v_all.append(v)
      routings.append(routing)
    return self.norm(x), tuple(k_all), tuple(v_all), _stacked_expert_ids(routings)

  # ------------------------------------------------------------------------------------------
  # Full forward.

  def __call__(self, input_ids: Int[Array, "B T"], attention_mask: Int[Array, "B T"] | None = None,
               positions: Int[Array, "B T"] | None = None, *, segment_ids: Int[Array, "B T"] | None = None,
               return_hidden: bool = False, mesh: Mesh | None = None,
               expert_ids: Int[Array, "L B T k"] | None = None, return_routing: bool = False
               ) -> Float[Array, "B T V"] | Float[Array, "B T D"] | tuple[Array, Routing]:
    """Logits (float32) of every position, or the final normed hidden states.

    Args:
      input_ids: token ids, left-padded when rows differ in length.
      attention_mask: 1 for tokens, 0 for padding; all ones when omitted.
      positions: RoPE positions; ``positions_from_mask(attention_mask)`` when omitted.
      segment_ids: packed rows (``rft_jax.rl.token_batches``): several sequences per row, 0 on
        padding, ``k > 0`` on the tokens of the row's ``k``-th sequence; a query attends to the
        earlier keys of its own segment only. Replaces ``attention_mask`` and needs
        ``positions`` (each sequence's own).
      return_hidden: return ``[B, T, D]`` hidden states after the final norm instead of logits.
      mesh: the mesh the inputs and parameters are laid out on (see the module docstring).
      expert_ids: an MoE model's routing to replay: every layer's experts of every token
        (:attr:`~rft_jax.models.moe.Routing.expert_ids` of an earlier forward, or the sampler's);
        the routing weights still come from the live routers at those ids.
      return_routing: an MoE model also returns its layers'
        :class:`~rft_jax.models.moe.Routing` (``router_logits [L, B, T, E]`` float32,
        ``expert_ids [L, B, T, k]``): ``(logits or hidden, routing)``.

    Raises:
      ValueError: ``expert_ids`` or ``return_routing`` on a dense model.
    """
    self._check_routing(expert_ids is not None or return_routing)
    if segment_ids is not None:
      if positions is None:
        raise ValueError("Qwen: segment_ids (packed rows) need each sequence's positions")
      valid = segment_ids.astype(jnp.int32)
    else:
      if attention_mask is None:
        attention_mask = jnp.ones(input_ids.shape, jnp.int32)
      if positions is None:
        positions = positions_from_mask(attention_mask)
      valid = attention_mask.astype(jnp.bool_)
    hidden, routing = self._layers(self._embed(input_ids), positions, valid, mesh, expert_ids,
                                   return_routing)
    out = hidden if return_hidden else self.logits(hidden)
    return (out, routing) if return_routing else out

  # ------------------------------------------------------------------------------------------
  # Incremental decoding.

  def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty :class:`KVCache` with ``max_len`` slots (dtype defaults to the compute dtype)."""
    return init_cache(self.config, batch, max_len, dtype)

  def extend(self, input_ids: Int[Array, "B T"], token_mask: Int[Array, "B T"], cache: KVCache,
             *, layers: tuple[DecoderLayer, ...] | None = None, return_routing: bool = False
             ) -> tuple[Float[Array, "B T D"], KVCache]:
    """Appends T slots to every row and returns their final hidden states (and with
    ``return_routing``, an MoE model's expert ids of the new tokens, ``[L, B, T, k]``, as a
    third element: what rollout routing replay records).

    Slot ``cache.index + t`` of row ``b`` (``cache.index[b] + t`` with per-row indices) holds
    ``input_ids[b, t]`` if ``token_mask[b, t]``, else padding. Each query attends to the real
    tokens in slots up to its own. The caller keeps ``cache.index + T <= cache.max_len`` (the
    write is clamped otherwise). ``layers``: this model's :meth:`unstacked_layers`, sliced once
    by a caller that runs many steps.
    """
    self._check_routing(return_routing)
    b, t = input_ids.shape
    if t > cache.max_len:
      raise ValueError(f"extend: {t} new tokens exceed the cache length {cache.max_len}")
    token_mask = token_mask.astype(jnp.int32)
    positions = jnp.maximum(
        cache.positions[:, None] + jnp.cumsum(token_mask, axis=-1) - 1, 0)
    slot_mask = write_slots(cache.slot_mask, token_mask.astype(jnp.bool_), cache.index, axis=1)
    mask = visible_slots(slot_mask, query_slots(cache.index, b, t))
    hidden, k, v, expert_ids = self._cached_layers(self._embed(input_ids), positions, mask, cache,
                                                   layers)
    cache = KVCache(k=k, v=v, slot_mask=slot_mask,
                    positions=cache.positions + jnp.sum(token_mask, axis=-1),
                    index=cache.index + t)
    return (hidden, cache, expert_ids) if return_routing else (hidden, cache)

  def prefill(self, input_ids: Int[Array, "B T"], attention_mask: Int[Array, "B T"],
              cache: KVCache, *, mesh: Mesh | None = None,
              layers: tuple[DecoderLayer, ...] | None = None, return_routing: bool = False
              ) -> tuple[Float[Array, "B V"], KVCache]:
    """Runs a left-padded prompt batch into the empty ``cache`` (slots ``[0, T)``); returns the
    last position's logits (and with ``return_routing``, an MoE model's expert ids of every
    prompt position, ``[L, B, T, k]``).

    The prompt attends within itself with :meth:`self_attention` (memory linear in T), not
    against the cache's slots. ``mesh``: as for :meth:`__call__`; ``layers``: this model's
    :meth:`unstacked_layers` (sliced here when None).
    """
    t = input_ids.shape[1]
    if t > cache.max_len:
      raise ValueError(f"prefill: {t} prompt tokens exceed the cache length {cache.max_len}")
    layers = self.unstacked_layers() if layers is None else layers
    valid = attention_mask.astype(jnp.bool_)
    rope = self.rope(positions_from_mask(attention_mask))
    attention = self.self_attention(mesh)
    self._check_routing(return_routing)
    x, k_all, v_all, routings = self._embed(input_ids), [], [], []
    for i, layer in enumerate(layers):
      x, k, v, routing = layer.prefill(x, rope, valid, attention, cache.k[i], cache.v[i],
                                       last_only=i == len(layers) - 1 and not return_routing,
                                       return_routing=True)
      k_all.append(k)
      v_all.append(v)
      routings.append(routing)
    cache = KVCache(k=tuple(k_all), v=tuple(v_all),
                    slot_mask=jax.lax.dynamic_update_slice(cache.slot_mask, valid, (0, 0)),
                    positions=jnp.sum(attention_mask.astype(jnp.int32), axis=-1),
                    index=jnp.asarray(t, jnp.int32))
    logits = self.logits(self.norm(x)[:, -1])
    return (logits, cache, _stacked_expert_ids(routings)) if return_routing else (logits, cache)

  def decode_step(self, tokens: Int[Array, "B"], cache: KVCache, *,
                  layers: tuple[DecoderLayer, ...] | None = None, return_routing: bool = False
                  ) -> tuple[Float[Array, "B V"], KVCache]:
    """Feeds one token per row; returns the next-token logits ``[B, V]`` and the cache
    (``layers``, ``return_routing``: as for :meth:`extend`; the expert ids ``[L, B, k]``)."""
    out = self.extend(tokens[:, None], jnp.ones((tokens.shape[0], 1), jnp.int32), cache,
                      layers=layers, return_routing=return_routing)
    logits = self.logits(out[0][:, 0])
    return (logits, out[1], out[2][:, :, 0]) if return_routing else (logits, out[1])

  def paged_decode_step(self, tokens: Int[Array, "S"], cache: PagedKVCache, writing: Bool[Array, "S"],
                        *, layers: tuple[DecoderLayer, ...] | None = None, kind: str = "xla",
                        mesh: Mesh | None = None, return_routing: bool = False
                        ) -> tuple[Float[Array, "S V"], PagedKVCache]:
    """:meth:`decode_step` on a :class:`~rft_jax.models.decode.paged_kv.PagedKVCache`: each writing
    slot's token goes at its position ``cache.lengths[s]`` (RoPE position and cache slot are
    the same there) and its query reads the slot's tokens up to itself; ``kind``: the paged
    attention (:func:`~rft_jax.models.decode.paged_kv.paged_attention`, a Pallas kernel laid out on
    ``mesh``). The lengths of the writing slots advance by one; the others change nothing.
    ``return_routing``: an MoE model's expert ids ``[L, S, k]`` as a third element."""
    self._check_routing(return_routing)
    lengths = cache.lengths
    rope = self.rope(lengths[:, None])
    x, routings = self._embed(tokens[:, None]), []
    for i, layer in enumerate(self.unstacked_layers() if layers is None else layers):
      def attention(q, k, v, i=i, cache=cache):
        cache = write_token(cache, i, k[:, 0], v[:, 0], writing)
        o = paged_attention(q[:, 0], cache.k[i], cache.v[i], cache.pages, lengths + 1, kind=kind,
                            mesh=mesh)
        return o[:, None].astype(q.dtype), cache
      x, cache, routing = layer.attend_with(x, rope, attention, return_routing=True)
      routings.append(routing)
    cache = cache.replace(lengths=lengths + writing.astype(lengths.dtype))
    logits = self.logits(self.norm(x)[:, 0])
    if return_routing:
      return logits, cache, _stacked_expert_ids(routings)[:, :, 0]
    return logits, cache


def _stacked_expert_ids(routings: Sequence[Routing | None]) -> Int[Array, "L ..."] | None:
  """The layers' expert ids stacked on a leading layer axis (None for a dense model)."""
  if routings[0] is None:
    return None
  return jnp.stack([r.expert_ids for r in routings])
