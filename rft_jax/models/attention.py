r"""Grouped-query self-attention with RoPE, optional q/k/v biases (Qwen2) and q/k RMSNorm (Qwen3).

Shapes: B batch, T query positions, S key positions (T without a cache, the cache length with
one), N query heads, K key/value heads, G = N / K, H head width, D model width.

Two kinds of attention run here:

* **causal self-attention over a padded batch** (the learner's forward, the sampler's prefill):
  :func:`causal_self_attention`. A plain implementation materialises ``[B, N, T, T]`` float32
  scores, 7.5 GB per sequence at T = 8,192 with 28 heads, so it dispatches to an
  implementation that never does (``QwenConfig.attention``): cuDNN flash attention on GPUs,
  the Pallas splash-attention kernel on TPUs (both in :mod:`rft_jax.models.attention_kernels`)
  and, elsewhere, :func:`blockwise_self_attention`, whose memory grows linearly in T;
* **attention against a KV cache** (decoding, one query per row): :func:`attend_cache`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from rft_jax.models.attention_kernels import cudnn_self_attention, splash_self_attention
from rft_jax.models.config import ATTENTION_KINDS, QwenConfig
from rft_jax.models.layers import RMSNorm, normal_init, param, rotate
from rft_jax.models.lora import adapter_delta, projection_adapter
from rft_jax.parallel.mesh import platform_of

# Scores of masked keys. Finite, so a query that sees no key (a left-padding position) gets a
# uniform (unused) distribution instead of NaN.
MASKED_SCORE = -1e30

# Queries per block of blockwise_self_attention: a block holds [B, N, BLOCK, T] float32 scores.
ATTENTION_BLOCK = 512


def causal_padding_mask(attention_mask: Int[Array, "B T"]) -> Bool[Array, "B T T"]:
  """``mask[b, t, s]``: query ``t`` may attend to key ``s`` (``s <= t`` and ``s`` a real token)."""
  t = attention_mask.shape[1]
  causal = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))
  return causal[None] & attention_mask.astype(jnp.bool_)[:, None, :]


def attend(q: Float[Array, "B T N H"], k: Float[Array, "B S K H"], v: Float[Array, "B S K H"],
           mask: Bool[Array, "B T S"]) -> Float[Array, "B T N H"]:
  r"""Masked softmax attention :math:`\mathrm{softmax}(q k^\top / \sqrt{H}) v`, heads grouped.

  Query head ``n`` reads key/value head ``n // G`` (HF ``repeat_kv`` order). Scores and softmax
  run in float32; probabilities are cast to ``v.dtype`` for the value product. Materialises
  the ``[B, N, T, S]`` scores: the reference, and the path for a few queries.
  """
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, n // kv_heads, h)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores * (h ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, MASKED_SCORE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
  return out.reshape(b, t, n, h)


def blockwise_self_attention(q: Float[Array, "B T N H"], k: Float[Array, "B T K H"],
                             v: Float[Array, "B T K H"], valid: Bool[Array, "B T"] | Int[Array, "B T"], *,
                             block_size: int = ATTENTION_BLOCK) -> Float[Array, "B T N H"]:
  r"""Causal self-attention, ``block_size`` queries at a time: memory linear in T.

  Query ``t`` sees key ``s`` iff ``s <= t`` and ``valid[b, s] == valid[b, t]``: a real query
  sees the real keys up to itself (the mask of :func:`causal_padding_mask`), a padding query the
  padding keys up to itself (so its unused output is finite). ``valid`` may also be int segment
  ids (packed rows: 0 on padding, ``k > 0`` per sequence): a query then sees its own segment. Each block of queries is
  :func:`attend` against all T keys, under ``jax.checkpoint``: the forward pass keeps no
  block's scores and the backward pass recomputes one block at a time, so the largest
  temporaries are ``[B, N, block_size, T]`` instead of ``[B, N, T, T]``. Keys after a block
  are masked rather than skipped (static shapes): twice the score FLOPs of a causal kernel,
  the price of running on any backend.
  """
  b, t, n, h = q.shape
  if t <= block_size:
    return attend(q, k, v, _self_mask(jnp.arange(t), valid, valid))
  pad = -t % block_size
  blocks = (t + pad) // block_size
  q_pad = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  valid_pad = jnp.pad(valid, ((0, 0), (0, pad)))
  q_blocks = q_pad.reshape(b, blocks, block_size, n, h).swapaxes(0, 1)  # [blocks, B, bs, N, H]
  valid_blocks = valid_pad.reshape(b, blocks, block_size).swapaxes(0, 1)
  starts = jnp.arange(blocks) * block_size

  @jax.checkpoint
  def one_block(xs):
    q_block, q_valid, start = xs
    return attend(q_block, k, v, _self_mask(start + jnp.arange(block_size), q_valid, valid))

  out = jax.lax.map(one_block, (q_blocks, valid_blocks, starts))  # [blocks, B, bs, N, H]
  return out.swapaxes(0, 1).reshape(b, t + pad, n, h)[:, :t]


def _self_mask(query_index: Int[Array, "T"], query_valid: Bool[Array, "B T"] | Int[Array, "B T"],
               key_valid: Bool[Array, "B S"] | Int[Array, "B S"]) -> Bool[Array, "B T S"]:
  causal = jnp.arange(key_valid.shape[1])[None, :] <= query_index[:, None]
  return causal[None] & (query_valid[:, :, None] == key_valid[:, None, :])


def attention_kind(kind: str, platform: str, dtype) -> str:
  """The implementation ``kind`` stands for on ``platform`` (``cpu``, ``gpu``/``cuda``, ``tpu``).

  ``auto``: splash on TPUs; cuDNN on GPUs for 16-bit activations (its flash kernel has no
  float32 form), blockwise otherwise. Any other kind is taken as asked.
  """
  if kind not in ATTENTION_KINDS:
    raise ValueError(f"attention kind {kind!r} is not one of {ATTENTION_KINDS}")
  if kind != "auto":
    return kind
  if platform == "tpu":
    return "splash"
  if platform in ("gpu", "cuda") and jnp.dtype(dtype).itemsize == 2:
    return "cudnn"
  return "blockwise"


def causal_self_attention(q: Float[Array, "B T N H"], k: Float[Array, "B T K H"],
                          v: Float[Array, "B T K H"], valid: Bool[Array, "B T"] | Int[Array, "B T"], *,
                          kind: str = "auto", mesh: Mesh | None = None
                          ) -> Float[Array, "B T N H"]:
  """Causal self-attention of a padded batch with the implementation ``kind`` chooses.

  At every real query position (``valid``) the result is that of :func:`attend` with
  :func:`causal_padding_mask`; outputs at padding positions are finite and unused. ``mesh``:
  the mesh the arrays are laid out on (rows over ``data``); it names the backend, and the
  splash kernel runs per device under ``shard_map`` on it. The cuDNN path needs each row's
  real tokens to be contiguous (left and/or right padding only), as the learner's and the
  sampler's rows are.

  ``valid`` may instead be ``[B, T]`` int segment ids (packed rows, several sequences per row:
  0 on padding, ``k > 0`` per sequence): a query sees the earlier keys of its own segment. The
  reference, blockwise and splash paths take them as they are; cuDNN's masks only padding, so
  packed rows run blockwise there.
  """
  kind = attention_kind(kind, platform_of(mesh), q.dtype)
  if kind == "cudnn" and valid.dtype != jnp.bool_:
    kind = "blockwise"
  if kind == "reference":
    return attend(q, k, v, _self_mask(jnp.arange(q.shape[1]), valid, valid))
  if kind == "blockwise":
    return blockwise_self_attention(q, k, v, valid)
  if kind == "cudnn":
    return cudnn_self_attention(q, k, v, valid)
  return splash_self_attention(q, k, v, valid, mesh=mesh)


def attend_cache(q: Float[Array, "B T N H"], k_cache: Float[Array, "B K H S"],
                 v_cache: Float[Array, "B K S H"], mask: Bool[Array, "B T S"]
                 ) -> Float[Array, "B T N H"]:
  r""":func:`attend` against a :class:`~rft_jax.models.kv_cache.KVCache` layer's layout.

  The same masked softmax attention, with keys stored transposed (slots last) so that both
  products are plain batched matrix products over contiguous slots.
  """
  b, t, n, h = q.shape
  kv_heads = k_cache.shape[1]
  q = q.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
  scores = jnp.einsum("bkgth,bkhs->bkgts", q, k_cache, preferred_element_type=jnp.float32)
  scores = scores * (h ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, MASKED_SCORE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
  out = jnp.einsum("bkgts,bksh->bkgth", probs, v_cache)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


class Attention(nnx.Module):
  """The projections around :func:`attend`; the caller chooses the keys (fresh or cached)."""

  def __init__(self, config: QwenConfig, *, rngs: nnx.Rngs):
    c = config
    d, n, k, h = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    pd = c.param_dtype
    self.dtype = c.dtype
    self.q_proj = param(normal_init, rngs.params(), (d, n, h), pd, ("embed", "heads", "head_dim"))
    self.k_proj = param(normal_init, rngs.params(), (d, k, h), pd,
                        ("embed", "kv_heads", "head_dim"))
    self.v_proj = param(normal_init, rngs.params(), (d, k, h), pd,
                        ("embed", "kv_heads", "head_dim"))
    self.o_proj = param(normal_init, rngs.params(), (n, h, d), pd, ("heads", "head_dim", "embed"))
    zeros = nnx.initializers.zeros_init()
    if c.attention_bias:
      self.q_bias = param(zeros, rngs.params(), (n, h), pd, ("heads", "head_dim"))
      self.k_bias = param(zeros, rngs.params(), (k, h), pd, ("kv_heads", "head_dim"))
      self.v_bias = param(zeros, rngs.params(), (k, h), pd, ("kv_heads", "head_dim"))
    if c.attention_out_bias:
      self.o_bias = param(zeros, rngs.params(), (d,), pd, ("norm",))
    if c.qk_norm:
      self.q_norm = RMSNorm(h, c.rms_norm_eps, param_dtype=pd, rngs=rngs, axes=("head_dim",))
      self.k_norm = RMSNorm(h, c.rms_norm_eps, param_dtype=pd, rngs=rngs, axes=("head_dim",))
    # LoRA adapters (rft_jax.models.lora) of the targeted projections, None elsewhere.
    self.lora_scale = None if c.lora is None else c.lora.scale
    shapes = {"q": (d, n * h, "embed", "heads"), "k": (d, k * h, "embed", "kv_heads"),
              "v": (d, k * h, "embed", "kv_heads"), "o": (n * h, d, "heads", "embed")}
    for name, (width, out_width, in_axis, out_axis) in shapes.items():
      setattr(self, f"{name}_lora", projection_adapter(
          c.lora, f"{name}_proj", width, out_width, in_axis, out_axis, dtype=c.dtype, rngs=rngs))

  def _proj(self, x: Array, name: str) -> Array:
    out = jnp.einsum("btd,dnh->btnh", x, getattr(self, f"{name}_proj")[...].astype(self.dtype))
    delta = adapter_delta(getattr(self, f"{name}_lora"), self.lora_scale, x)
    if delta is not None:
      out = out + delta.reshape(out.shape)
    bias = getattr(self, f"{name}_bias", None)
    return out if bias is None else out + bias[...].astype(self.dtype)

  def qkv(self, x: Float[Array, "B T D"],
          rope: tuple[Float[Array, "B T 1 H"], Float[Array, "B T 1 H"]]
          ) -> tuple[Float[Array, "B T N H"], Float[Array, "B T K H"], Float[Array, "B T K H"]]:
    """Projections, then (Qwen3) per-head RMSNorm of q and k, then RoPE (``rope``: the
    ``Qwen.rope`` tables at the tokens' positions)."""
    x = x.astype(self.dtype)
    q, k, v = self._proj(x, "q"), self._proj(x, "k"), self._proj(x, "v")
    if hasattr(self, "q_norm"):
      q, k = self.q_norm(q), self.k_norm(k)
    return rotate(q, *rope), rotate(k, *rope), v

  def out(self, o: Float[Array, "B T N H"]) -> Float[Array, "B T D"]:
    """Output projection (and its bias when the config has one)."""
    b, t, n, h = o.shape
    # Heads and head width flattened into one contracted axis (a free reshape of both operands):
    # with two contracted axes, XLA:CPU may transpose the weight to (h, n) order at every call.
    o = o.astype(self.dtype).reshape(b, t, n * h)
    y = o @ self.o_proj[...].astype(self.dtype).reshape(n * h, -1)
    delta = adapter_delta(self.o_lora, self.lora_scale, o)
    if delta is not None:
      y = y + delta
    bias = getattr(self, "o_bias", None)
    return y if bias is None else y + bias[...].astype(self.dtype)
