r"""The key/value cache of incremental decoding: a plain pytree, carried and donated by samplers.

Slots are shared by all rows: a left-padded prompt of length T fills slots ``[0, T)`` of every
row (padding slots flagged off in ``slot_mask``), and each decode step writes slot ``index`` of
every row. A query at slot ``t`` sees slot ``s`` iff ``s <= t`` and ``slot_mask[b, s]``. RoPE
positions count real tokens per row, so row ``b`` of a padded batch sees exactly what it would
see alone.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rft_jax.models.config import QwenConfig

# Logical axis names of the cache arrays, for rft_jax.parallel.sharding.
CACHE_AXES = {
    "k": ("layers", "batch", "cache_seq", "kv_heads", "head_dim"),
    "v": ("layers", "batch", "cache_seq", "kv_heads", "head_dim"),
    "slot_mask": ("batch", "cache_seq"),
    "positions": ("batch",),
    "index": (),
}


@flax.struct.dataclass
class KVCache:
  """Cached keys and values of every layer.

  Attributes:
    k: ``[L, B, S, K, H]`` keys after RoPE (and q/k norm).
    v: ``[L, B, S, K, H]`` values.
    slot_mask: ``[B, S]`` True where a slot holds a real token.
    positions: ``[B]`` int32 RoPE position of each row's next token (its real-token count).
    index: ``[]`` int32 next slot to write, shared by all rows.
  """

  k: Float[Array, "L B S K H"]
  v: Float[Array, "L B S K H"]
  slot_mask: Bool[Array, "B S"]
  positions: Int[Array, "B"]
  index: Int[Array, ""]

  @classmethod
  def logical_axes(cls) -> KVCache:
    """A KVCache whose fields are the logical axis names (for ``parallel.tree_shardings``)."""
    return cls(**CACHE_AXES)

  @property
  def max_len(self) -> int:
    """S, the number of slots."""
    return self.k.shape[2]


def init_cache(config: QwenConfig, batch: int, max_len: int, dtype=None) -> KVCache:
  """An empty cache of ``max_len`` slots for ``batch`` rows (dtype: the compute dtype)."""
  dtype = config.dtype if dtype is None else dtype
  shape = (config.num_hidden_layers, batch, max_len, config.num_key_value_heads, config.head_dim)
  return KVCache(
      k=jnp.zeros(shape, dtype),
      v=jnp.zeros(shape, dtype),
      slot_mask=jnp.zeros((batch, max_len), jnp.bool_),
      positions=jnp.zeros((batch,), jnp.int32),
      index=jnp.zeros((), jnp.int32),
  )
