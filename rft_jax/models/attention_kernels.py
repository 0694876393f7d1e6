r"""Memory-efficient causal self-attention over a padded batch: splash (TPU) and cuDNN (GPU).

Both compute :func:`rft_jax.models.attention.attend` with
``causal_padding_mask(valid)`` at the real (``valid``) query positions without materialising the
``[B, N, T, T]`` scores. Query ``t`` attends key ``s`` iff ``s <= t`` and ``valid[b, s] ==
valid[b, t]``: real queries see the real keys up to themselves; a padding query sees padding keys
(or, in the cuDNN path, gets zeros), so its output is finite and unused. Query head ``n`` reads
key/value head ``n // G`` (HF ``repeat_kv`` order); neither path repeats K/V. Scale ``H ** -0.5``,
float32 softmax, output in ``q.dtype``; both are differentiable.

Shapes: B batch, T positions, N query heads, K key/value heads, G = N / K, H head width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from rft_jax.parallel.mesh import axis_if_divides

_LANES = 128  # splash blocks are multiples of the TPU lane width


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _splash_local(q: Float[Array, "B T N H"], k: Float[Array, "B T K H"],
                  v: Float[Array, "B T K H"], valid: Bool[Array, "B T"], *, block_size: int,
                  interpret: bool) -> Float[Array, "B T N H"]:
  """:func:`splash_self_attention` on one device's shard (all of ``T``, some batch and heads)."""
  b, t, n, h = q.shape
  block = min(_round_up(block_size, _LANES), _round_up(t, _LANES))
  tp = _round_up(t, block)
  # Kernel layout [B, heads, Tp, H]. Padded positions (segment 0, after every real token) are
  # never seen by a real query and are sliced off.
  def layout(x):
    return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  segments = jnp.pad(valid.astype(jnp.int32), ((0, 0), (0, tp - t)))
  mask = splash.MultiHeadMask([splash.CausalMask((tp, tp))] * n)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                            block_q_dq=block, block_kv_dq=block)
  # The MHA kernel takes K < N key/value heads itself (query head n reads n // G, dK/dV summed).
  kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)
  out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(s1, s1)))(
      layout(q * h ** -0.5), layout(k), layout(v), segments)  # [B, N, Tp, H]
  return out[:, :, :t].transpose(0, 2, 1, 3).astype(q.dtype)


def splash_self_attention(q: Float[Array, "B T N H"], k: Float[Array, "B T K H"],
                          v: Float[Array, "B T K H"], valid: Bool[Array, "B T"], *,
                          mesh: Mesh | None = None, interpret: bool = False,
                          block_size: int = 512) -> Float[Array, "B T N H"]:
  """Causal padded self-attention with the Pallas TPU splash kernel (``interpret``: on any backend).

  Causal block mask plus segment ids ``valid``; ``T`` is padded to a multiple of the block
  (``block_size`` rounded up to 128, capped at ``T`` rounded up to 128) and sliced back. The
  query is scaled (in ``q.dtype``) before the kernel. With ``mesh`` (axes ``('data', 'model')``)
  the kernel runs under :func:`jax.shard_map`: batch over ``'data'`` (``B`` must divide evenly),
  heads over ``'model'`` when ``K`` divides evenly, else replicated (each ``'model'`` device then
  computes all heads, and the gradients are all-reduced over ``'model'``); each device sees whole
  sequences. This composes with a jit over ``NamedSharding``'d inputs.

  On TPU, trace bfloat16 inputs under the default matmul precision: with
  ``jax_default_matmul_precision="highest"`` (as ``tests/conftest.py`` sets) Mosaic rejects the
  kernels' bfloat16 products ("Bad lhs type").
  """
  fn = functools.partial(_splash_local, block_size=block_size, interpret=interpret)
  if mesh is not None:
    heads = axis_if_divides(mesh, k.shape[2])
    spec = P("data", None, heads, None)
    fn = jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, P("data", None)),
                       out_specs=spec, check_vma=False)
  return fn(q, k, v, valid)


def cudnn_self_attention(q: Float[Array, "B T N H"], k: Float[Array, "B T K H"],
                         v: Float[Array, "B T K H"], valid: Bool[Array, "B T"], *,
                         implementation: str | None = "cudnn") -> Float[Array, "B T N H"]:
  """Causal padded self-attention with :func:`jax.nn.dot_product_attention` (cuDNN flash on GPU).

  cuDNN masks only right padding (sequence lengths) plus causality, so each row's valid tokens
  must be contiguous (left and/or right padding, nothing in between; not checked). Each row is
  rolled left by its count of leading padding tokens (a gather), attended with
  ``query_seq_lengths = key_value_seq_lengths = L`` (``L`` = valid count, at least 1 so an
  all-padding row has a key and no empty softmax) and rolled back; padding outputs are zeros.
  ``implementation="cudnn"`` needs an NVIDIA GPU and float16 / bfloat16 inputs;
  ``"xla"`` / ``None`` runs the same masking with XLA anywhere (what the CPU tests check).
  """
  t = q.shape[1]
  lengths = jnp.maximum(valid.sum(axis=1, dtype=jnp.int32), 1)  # [B]
  first = jnp.argmax(valid, axis=1)  # [B] leading padding count (0 for an all-padding row)
  positions = jnp.arange(t)[None, :]

  def take(x, index):  # x[b, index[b, i]] for every row b
    return jnp.take_along_axis(x, index[:, :, None, None], axis=1)

  left = (positions + first[:, None]) % t  # [B, T] rolled position -> original position
  out = jax.nn.dot_product_attention(
      take(q, left), take(k, left), take(v, left), is_causal=True, query_seq_lengths=lengths,
      key_value_seq_lengths=lengths, implementation=implementation)
  out = take(out, (positions - first[:, None]) % t)
  return jnp.where(valid[:, :, None, None], out, 0).astype(q.dtype)
