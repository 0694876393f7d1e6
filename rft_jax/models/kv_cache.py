r"""The key/value cache of incremental decoding: a plain pytree, carried and donated by samplers.

A left-padded prompt of length T fills slots ``[0, T)`` of every row (padding slots flagged off
in ``slot_mask``), and each decode step writes slot ``index`` of every row: one shared index (a
static batch), or one per row (``index`` of shape ``[B]``: continuous batching, where each row
holds a different completion at its own length; :func:`write_slots`). A query at slot ``t`` sees
slot ``s`` iff ``s <= t`` and ``slot_mask[b, s]``. RoPE positions count real tokens per row, so
row ``b`` of a padded batch sees exactly what it would see alone.

Layout, chosen for decoding (one query per row reading every slot):

* one array per layer, not one stacked ``[L, ...]`` array: a decode step updates and reads each
  layer's cache in place, where a stacked cache in a ``scan`` carry is sliced (copied) per layer;
* keys transposed, ``[B, K, H, S]``: the score product ``q k^T`` is then a plain row-by-matrix
  product over contiguous slots (faster on CPU than the ``[B, S, K, H]`` layout:
  ``docs/results/cpu.md#the-caches-layout``);
  values stay ``[B, K, S, H]`` for the probability-by-value product.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rft_jax.models.config import QwenConfig

# Logical axis names of one layer's arrays and of the shared fields (rft_jax.parallel.sharding).
KEY_AXES = ("batch", "kv_heads", "head_dim", "cache_seq")
TILED_KEY_AXES = ("batch", "kv_heads", "cache_seq", "head_dim", None)  # cpu_attention.tile_keys
VALUE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")


@flax.struct.dataclass
class KVCache:
  """Cached keys and values of every layer.

  Attributes:
    k: per layer, ``[B, K, H, S]`` keys after RoPE (and q/k norm), slots last (in the CPU
      sampler's pool, tiled: ``[B, K, S / T, H, T]``,
      :func:`rft_jax.models.decode.cpu_attention.tile_keys`).
    v: per layer, ``[B, K, S, H]`` values.
    slot_mask: ``[B, S]`` True where a slot holds a real token.
    positions: ``[B]`` int32 RoPE position of each row's next token (its real-token count).
    index: int32 next slot to write: ``[]`` shared by all rows, or ``[B]`` one per row.
  """

  k: tuple[Float[Array, "B K H S"], ...]
  v: tuple[Float[Array, "B K S H"], ...]
  slot_mask: Bool[Array, "B S"]
  positions: Int[Array, "B"]
  index: Int[Array, ""] | Int[Array, "B"]

  def logical_axes(self) -> KVCache:
    """This cache's structure with logical axis names as leaves (``parallel.tree_shardings``)."""
    key_axes = TILED_KEY_AXES if self.k[0].ndim == 5 else KEY_AXES
    return KVCache(k=(key_axes,) * len(self.k), v=(VALUE_AXES,) * len(self.v),
                   slot_mask=("batch", "cache_seq"), positions=("batch",),
                   index=("batch",) if jnp.ndim(self.index) else ())

  @property
  def max_len(self) -> int:
    """S, the number of slots."""
    return self.slot_mask.shape[1]

  @property
  def dtype(self):
    """The dtype of the cached keys and values."""
    return self.k[0].dtype


def init_cache(config: QwenConfig, batch: int, max_len: int, dtype=None) -> KVCache:
  """An empty cache of ``max_len`` slots for ``batch`` rows (dtype: the compute dtype)."""
  dtype = config.dtype if dtype is None else dtype
  k, h, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
  return KVCache(
      k=tuple(jnp.zeros((batch, k, h, max_len), dtype) for _ in range(layers)),
      v=tuple(jnp.zeros((batch, k, max_len, h), dtype) for _ in range(layers)),
      slot_mask=jnp.zeros((batch, max_len), jnp.bool_),
      positions=jnp.zeros((batch,), jnp.int32),
      index=jnp.zeros((), jnp.int32),
  )


def write_slots(array: Array, update: Array, index: Int[Array, ""] | Int[Array, "B"],
                axis: int) -> Array:
  """``array`` (``[B, ...]``, one cache layer or the slot mask) with ``update`` written from slot
  ``index`` on along ``axis``: one ``dynamic_update_slice`` for a shared index, a per-row
  one (a scatter) for ``[B]`` indices. Writes past the last slot are clamped, as
  ``dynamic_update_slice`` clamps them."""
  if jnp.ndim(index) == 0:
    start = [0] * array.ndim
    start[axis] = index
    return jax.lax.dynamic_update_slice(array, update.astype(array.dtype), start)

  def row(a, u, i):
    start = [0] * a.ndim
    start[axis - 1] = i
    return jax.lax.dynamic_update_slice(a, u.astype(a.dtype), start)
  return jax.vmap(row)(array, update, index)


def visible_slots(slot_mask: Bool[Array, "B S"], query_slots: Int[Array, "B T"]
                  ) -> Bool[Array, "B T S"]:
  """Which slots each query sees: those at or before its own slot that hold a real token."""
  slots = jnp.arange(slot_mask.shape[1])
  return (slots[None, None, :] <= query_slots[:, :, None]) & slot_mask[:, None, :]


def query_slots(index: Int[Array, ""] | Int[Array, "B"], batch: int, tokens: int
                ) -> Int[Array, "B T"]:
  """``[B, T]`` the slots that ``tokens`` new tokens per row are written to from ``index``."""
  return jnp.broadcast_to(jnp.reshape(index, (-1, 1)) + jnp.arange(tokens), (batch, tokens))
