r"""One decode step of attention against a dense KV cache layer in one Pallas GPU kernel.

For one new token per row, :func:`fused_decode_attention` does in a single ``pallas_call`` what
``DecoderLayer.extend`` (``rft_jax.models.model``) does with about six XLA kernels: the
optional Qwen3 q/k RMSNorm, RoPE of the new query and key, the writes of the new key and value
into the cache (in place: the cache layers are aliased to the kernel's outputs), and the masked
softmax attention of the new query over the cache
(:func:`~rft_jax.models.attention.attend_cache`).

Layout, that of :class:`~rft_jax.models.kv_cache.KVCache`: keys ``[B, K, H, S]`` (slots last),
values ``[B, K, S, H]``; B rows, K kv heads, N query heads (query head ``n`` reads kv head
``n // G``, G = N / K), H head width (even), S slots (a multiple of 16).

Kernel (Triton; on CPU it runs in Pallas' interpret mode): grid ``(B, K)``, one program per row
and kv head, which handles that head's G query heads as one ``[Gp, H]`` tile (Gp: G rounded up
to a power of two, at least 16, the least a Triton product takes; the rows past G are masked).
RoPE works on the two halves of the head width, so keys are read as two ``[H/2, block]``
halves and each score is the sum of two products. The program writes the new key column and
value row of its slot, then walks the cache in blocks of ``block`` slots (the largest of
128/64/32/16 dividing S) up to the block holding the new slot, with an online (flash-decoding)
softmax in float32. The new slot's key and value are substituted in registers for what the
block read (so the result never depends on the order of the write and the reads of the aliased
buffer), which makes it equal to the XLA path, where the cache is written first.

Differences from the XLA path, beyond float rounding: probabilities enter the value product
unnormalised (cast to the value dtype, divided by their sum afterwards, as flash attention
does) instead of normalised and then cast; and a row that sees no slot at all (its slot mask
all false up to its index) gets the mean of the values of the blocks up to its slot rather
than of all S slots: finite, and unused by the sampler. Float32 products follow
``jax_default_matmul_precision`` as XLA's do (TF32 on GPUs by default, IEEE under ``highest``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Bool, Float, Int

from rft_jax.models.attention import MASKED_SCORE

SLOT_BLOCKS = (128, 64, 32, 16)  # slots per step of the kernel's loop: the largest dividing S


def slot_block(slots: int) -> int:
  """Slots per step of the kernel's loop over the cache: the largest power of two in
  ``SLOT_BLOCKS`` dividing ``slots`` (a ValueError when none does)."""
  for block in SLOT_BLOCKS:
    if slots % block == 0:
      return block
  raise ValueError(f"fused_decode_attention: {slots} cache slots are not a multiple of 16")


def _rope(x1, x2, c1, c2, s1, s2):
  """``rotate`` (layers.py) on the two halves: ``x cos + [-x2, x1] sin``."""
  return x1 * c1 + (-x2) * s1, x2 * c2 + x1 * s2


def _norm_scale(x, eps):
  """The float32 ``1 / rms`` of ``rms_norm`` over the last axis of ``x``, ``[..., 1]``."""
  x32 = x.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


def _normed(x, inv_rms, scale):
  """``rms_norm``'s result from its ``inv_rms``: normalised in float32, cast, then scaled."""
  return scale.astype(x.dtype) * (x.astype(jnp.float32) * inv_rms).astype(x.dtype)


def _kernel(*refs, groups: int, block_q: int, block_s: int, slots: int, has_q_norm: bool,
            has_k_norm: bool, eps: float):
  q_ref, k_ref, v_ref, pos_ref, freq_ref, kc_ref, vc_ref, mask_ref, index_ref, *rest = refs
  qn_ref = rest.pop(0) if has_q_norm else None
  kn_ref = rest.pop(0) if has_k_norm else None
  o_ref, kc_out_ref, vc_out_ref = rest
  head_dim = v_ref.shape[0]
  half = head_dim // 2
  lo, hi = pl.ds(0, half), pl.ds(half, half)
  dtype = q_ref.dtype

  index = index_ref[()]  # the new token's slot; writes clamp it to the cache
  slot = jnp.clip(index, 0, slots - 1)
  # RoPE's cos and sin at the row's position, as rope_cos_sin makes them (float32 angles, cast
  # to the compute dtype); both halves of the head width share them.
  angles = pos_ref[()].astype(jnp.float32) * freq_ref[...]  # [H/2]
  c1 = c2 = jnp.cos(angles).astype(dtype)
  s1 = s2 = jnp.sin(angles).astype(dtype)

  # The new key: norm, RoPE, cast to the cache dtype; written with the value at `slot`.
  k1, k2 = k_ref[lo], k_ref[hi]
  if kn_ref is not None:
    inv_rms = _norm_scale(k_ref[...], eps)
    k1, k2 = _normed(k1, inv_rms, kn_ref[lo]), _normed(k2, inv_rms, kn_ref[hi])
  k1, k2 = _rope(k1, k2, c1, c2, s1, s2)
  k1, k2 = k1.astype(kc_ref.dtype), k2.astype(kc_ref.dtype)
  v_new = v_ref[...].astype(vc_ref.dtype)
  kc_out_ref[lo, slot] = k1
  kc_out_ref[hi, slot] = k2
  vc_out_ref[slot, :] = v_new

  # This kv head's G queries as a [block_q, H] tile (rows past G masked to zero).
  rows = pl.ds(pl.program_id(1) * groups, block_q)
  row_ok = jnp.arange(block_q) < groups

  def load_q(cols, width):
    mask = jnp.broadcast_to(row_ok[:, None], (block_q, width))
    return plgpu.load(q_ref.at[rows, cols], mask=mask, other=0)

  q1, q2 = load_q(lo, half), load_q(hi, half)
  if qn_ref is not None:
    inv_rms = _norm_scale(load_q(pl.ds(0, head_dim), head_dim), eps)
    q1, q2 = _normed(q1, inv_rms, qn_ref[lo][None, :]), _normed(q2, inv_rms, qn_ref[hi][None, :])
  q1, q2 = _rope(q1, q2, c1[None, :], c2[None, :], s1[None, :], s2[None, :])
  scale = head_dim ** -0.5

  def body(i, carry):
    o, m, l = carry
    start = pl.multiple_of(i * block_s, block_s)
    cols = pl.ds(start, block_s)
    ids = start + jnp.arange(block_s)
    new = ids == slot
    key1 = jnp.where(new[None, :], k1[:, None], kc_ref[lo, cols]).astype(dtype)
    key2 = jnp.where(new[None, :], k2[:, None], kc_ref[hi, cols]).astype(dtype)
    s = (plgpu.dot(q1, key1) + plgpu.dot(q2, key2)) * scale  # [block_q, block_s] float32
    visible = mask_ref[cols] & (ids <= index)
    s = jnp.where(visible[None, :], s, MASKED_SCORE)
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp(m - m_next)
    p = jnp.exp(s - m_next[:, None])
    value = jnp.where(new[:, None], v_new[None, :], vc_ref[cols, :]).astype(dtype)
    o = correction[:, None] * o + plgpu.dot(p.astype(dtype), value)
    return o, m_next, correction * l + jnp.sum(p, axis=1)

  init = (jnp.zeros((block_q, head_dim), jnp.float32),
          jnp.full((block_q,), jnp.finfo(jnp.float32).min, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  o, _, l = jax.lax.fori_loop(0, slot // block_s + 1, body, init)
  o = (o / l[:, None]).astype(o_ref.dtype)
  plgpu.store(o_ref.at[rows, :], o,
              mask=jnp.broadcast_to(row_ok[:, None], (block_q, head_dim)))


def fused_decode_attention(q: Float[Array, "B N H"], k: Float[Array, "B K H"],
                           v: Float[Array, "B K H"], positions: Int[Array, "B"],
                           inv_freq: Float[Array, "H/2"], k_cache: Float[Array, "B K H S"],
                           v_cache: Float[Array, "B K S H"], slot_mask: Bool[Array, "B S"],
                           index: Int[Array, ""] | Int[Array, "B"], *,
                           q_norm: Float[Array, "H"] | None = None,
                           k_norm: Float[Array, "H"] | None = None, norm_eps: float = 1e-6,
                           interpret: bool = False,
                           ) -> tuple[Float[Array, "B N H"], Float[Array, "B K H S"],
                                      Float[Array, "B K S H"]]:
  r"""RoPE, cache write and attention of one new token per row, in one kernel.

  Args:
    q: ``[B, N, H]`` the new queries (projected, before norm and RoPE).
    k: ``[B, K, H]`` the new keys (projected, before norm and RoPE).
    v: ``[B, K, H]`` the new values.
    positions: ``[B]`` each row's RoPE position; the kernel makes the row's cos and sin from it
      as ``rope_cos_sin`` does (a table gathered outside was a kernel of its own).
    inv_freq: ``[H/2]`` float32, ``rope_inv_freq(H, theta)``.
    k_cache: ``[B, K, H, S]`` this layer's keys; updated in place (aliased to the output).
    v_cache: ``[B, K, S, H]`` this layer's values; updated in place.
    slot_mask: ``[B, S]`` the real slots, the new token's slot already set (or not).
    index: the new token's slot, ``[]`` shared or ``[B]`` per row; writes past the last slot
      are clamped to it, as ``write_slots`` clamps them.
    q_norm, k_norm: ``[H]`` Qwen3's per-head RMSNorm scales of q and k, or None.
    norm_eps: their epsilon.
    interpret: run in Pallas' interpret mode (any backend; for tests).

  Returns:
    ``(o, k_cache, v_cache)``: ``[B, N, H]`` the attention output in ``q.dtype``, softmax over
    slots ``s <= index`` with ``slot_mask``, scores ``q.k / sqrt(H)`` in float32; and the
    caches with the rotated key and the value written at slot ``index`` of each row.
  """
  b, n, h = q.shape
  kv_heads, s = k_cache.shape[1], k_cache.shape[3]
  if n % kv_heads or h % 2 or k.shape != (b, kv_heads, h) or v.shape != k.shape:
    raise ValueError(f"fused_decode_attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit "
                     f"a cache of {kv_heads} kv heads of width {h}")
  if k_cache.shape != (b, kv_heads, h, s) or v_cache.shape != (b, kv_heads, s, h):
    raise ValueError(f"fused_decode_attention: cache layers {k_cache.shape}, {v_cache.shape} "
                     f"are not [B, K, H, S] and [B, K, S, H]")
  if positions.shape != (b,) or inv_freq.shape != (h // 2,):
    raise ValueError(f"fused_decode_attention: positions {positions.shape} or inverse frequencies "
                     f"{inv_freq.shape} do not fit {b} rows of head width {h}")
  if slot_mask.shape != (b, s) or jnp.ndim(index) not in (0, 1):
    raise ValueError(f"fused_decode_attention: slot mask {slot_mask.shape} or index "
                     f"{jnp.shape(index)} do not fit {b} rows of {s} slots")
  groups = n // kv_heads
  block_q = max(16, pl.next_power_of_2(groups))
  index = jnp.asarray(index, jnp.int32)
  per_row = index.ndim == 1
  index = index if per_row else index.reshape(1)

  row = lambda *tail: pl.BlockSpec((None, *tail), lambda i, j: (i,) + (0,) * len(tail))
  head = lambda *tail: pl.BlockSpec((None, None, *tail), lambda i, j: (i, j) + (0,) * len(tail))
  whole = pl.BlockSpec((h,), lambda i, j: (0,))
  in_specs = [row(n, h), head(h), head(h), pl.BlockSpec((None,), lambda i, j: (i,)),
              pl.BlockSpec((h // 2,), lambda i, j: (0,)), head(h, s), head(s, h), row(s),
              pl.BlockSpec((None,), lambda i, j: (i,) if per_row else (0,))]
  args = [q, k, v, jnp.asarray(positions, jnp.int32), jnp.asarray(inv_freq, jnp.float32),
          k_cache, v_cache, slot_mask, index]
  for scale in (q_norm, k_norm):
    if scale is not None:
      in_specs.append(whole)
      args.append(scale)
  kernel = functools.partial(_kernel, groups=groups, block_q=block_q, block_s=slot_block(s),
                             slots=s, has_q_norm=q_norm is not None,
                             has_k_norm=k_norm is not None, eps=norm_eps)
  return pl.pallas_call(
      kernel,
      grid=(b, kv_heads),
      in_specs=in_specs,
      out_specs=[row(n, h), head(h, s), head(s, h)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
      input_output_aliases={5: 1, 6: 2},
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="fused_decode_attention",
  )(*args)
