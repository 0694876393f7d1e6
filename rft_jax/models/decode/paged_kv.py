r"""A paged key/value cache: memory that follows the live tokens, not rows x maximum length.

Every layer's keys and values live in a pool of ``N`` pages of ``P`` tokens; each decode slot
has a block table, the pages that hold its tokens in order: token ``t`` of slot ``s`` is at
offset ``t % P`` of page ``pages[s, t // P]``. A slot's tokens are contiguous from position 0
(no padding: a left-padded prompt is shifted to the start of its pages, :func:`prompt_pages`),
so a slot is described by its page list and its length, which is also the RoPE position of its
next token. Pages are shared: the samples of one prompt point at the prompt's full pages and
only copy its last, partial one before writing after it (the sampler's allocator,
:mod:`rft_jax.sampling.paged_pool`, hands the pages out and takes them back).

The layout of one layer is that of the paged-attention kernels that ship with jax (Pallas):
``[K, N, P, H]`` for keys and for values. :func:`paged_attention` runs

* ``pallas_tpu``: ``jax.experimental.pallas.ops.tpu.paged_attention`` on TPUs;
* ``pallas_tpu_megacore``: the same kernel split over the two TensorCores of a megacore chip
  (v4, v5p; ``megacore_mode``: by KV head where a device holds an even number, else by slot).
  Without it the kernel's grid runs on one of them. Opt-in, never picked by ``auto``: jax's
  kernel says it may hang on a chip without megacore, it compiles for v5e and v6e all the same
  (so a compile cannot catch that), and it has not been run here (no TPU was lent);
* ``pallas_gpu``: ``jax.experimental.pallas.ops.gpu.paged_attention`` on GPUs (Triton), which
  also runs on CPU in Pallas' interpret mode (``pallas_gpu_interpret``, for tests);
* ``xla``: a gather of each slot's pages, then the masked softmax of
  :func:`~rft_jax.models.attention.attend_cache` (any backend; it reads every page of the
  block table, a temporary of one layer's slots at full width).

All three compute ``softmax(q k^T / sqrt(H)) v`` over a slot's ``lengths[s]`` tokens, scores in
float32.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from rft_jax.models.attention import MASKED_SCORE
from rft_jax.models.config import QwenConfig
from rft_jax.parallel.mesh import axis_if_divides

PAGED_ATTENTION_KINDS = ("auto", "xla", "pallas_gpu", "pallas_gpu_interpret", "pallas_tpu",
                         "pallas_tpu_megacore")
TPU_KERNEL_KINDS = ("pallas_tpu", "pallas_tpu_megacore")  # jax's TPU kernel, one or two cores
# The TPU chips whose jax device is two TensorCores (megacore): v4 and v5p (v5e is "TPU v5 lite").
MEGACORE_DEVICE_KINDS = ("TPU v4", "TPU v5")


@flax.struct.dataclass
class PagedKVCache:
  """Pages of every layer and the slots' block tables.

  Attributes:
    k: per layer, ``[K, N, P, H]`` keys after RoPE (and q/k norm).
    v: per layer, ``[K, N, P, H]`` values.
    pages: ``[S, W]`` each slot's block table (``W`` pages: the longest sequence a slot holds
      is ``W * P`` tokens); entries past a slot's length are unused.
    lengths: ``[S]`` tokens each slot holds, the position of its next token.
  """

  k: tuple[Float[Array, "K N P H"], ...]
  v: tuple[Float[Array, "K N P H"], ...]
  pages: Int[Array, "S W"]
  lengths: Int[Array, "S"]

  @property
  def page_size(self) -> int:
    return self.k[0].shape[2]

  @property
  def num_pages(self) -> int:
    return self.k[0].shape[1]


def init_paged_cache(config: QwenConfig, num_pages: int, page_size: int, slots: int,
                     pages_per_slot: int, dtype=None) -> PagedKVCache:
  """Empty pages (dtype: the compute dtype) and block tables of ``slots`` slots."""
  dtype = config.dtype if dtype is None else dtype
  shape = (config.num_key_value_heads, num_pages, page_size, config.head_dim)
  layers = config.num_hidden_layers
  return PagedKVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
                      v=tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
                      pages=jnp.zeros((slots, pages_per_slot), jnp.int32),
                      lengths=jnp.zeros((slots,), jnp.int32))


def pages_for(tokens: int, page_size: int) -> int:
  """Pages that hold ``tokens`` tokens."""
  return -(-tokens // page_size)


def prompt_pages(layer: Float[Array, "B K S H"], lengths: Int[Array, "B"], page_size: int
                 ) -> Float[Array, "K N P H"]:
  """One layer of a left-padded prompt cache (``[B, K, S, H]``, ``S`` slots, row ``b``'s
  ``lengths[b]`` tokens at its last slots) as pages: row ``b``'s tokens shifted to the start
  of its own ``ceil(S / P)`` pages, pages ``b * ceil(S / P) ...``; the slots after its tokens
  hold its padding (never read: a slot reads ``lengths`` tokens)."""
  b, k, s, h = layer.shape
  per_row = pages_for(s, page_size)
  shift = s - lengths  # the row's padding slots
  slots = (jnp.arange(s)[None, :] + shift[:, None]) % s  # [B, S]: a rotation of each row
  layer = jnp.take_along_axis(layer, slots[:, None, :, None], axis=2)
  layer = jnp.pad(layer, ((0, 0), (0, 0), (0, per_row * page_size - s), (0, 0)))
  layer = layer.reshape(b, k, per_row, page_size, h).transpose(1, 0, 2, 3, 4)
  return layer.reshape(k, b * per_row, page_size, h)


def write_token(cache: PagedKVCache, layer: int, k: Float[Array, "S K H"],
                v: Float[Array, "S K H"], writing: Array) -> PagedKVCache:
  """``cache`` with each writing slot's new key and value (``[S, K, H]``) stored at its
  position ``lengths[s]`` in layer ``layer`` (the page must be in its block table already);
  slots that do not write (``writing[s]`` False) change nothing. Lengths are not advanced.

  Each (head, slot) pair's ``[H]`` row is one update of the scatter, indexed by head, page and
  offset, so the pages keep the layout the kernels read. Indexed by page and offset only, each
  update a ``[K, H]`` window, the TPU compiler laid the pages out with the heads second-minor
  and copied each layer's whole page pool into the kernel's layout and back at every step
  (``tests/test_sampling_paged.py::test_the_tpu_program_holds_each_layers_pages_once``)."""
  page_size, n = cache.page_size, cache.num_pages
  page = jnp.take_along_axis(cache.pages, (cache.lengths // page_size)[:, None], axis=1,
                             mode="clip")[:, 0]
  page = jnp.where(writing, page, n)  # out of range: dropped
  offset = cache.lengths % page_size
  heads = jnp.arange(cache.k[layer].shape[0])[:, None]  # [K, 1]

  def put(pool, new):
    return pool.at[heads, page[None], offset[None]].set(new.transpose(1, 0, 2).astype(pool.dtype),
                                                        mode="drop")

  k_all, v_all = list(cache.k), list(cache.v)
  k_all[layer], v_all[layer] = put(k_all[layer], k), put(v_all[layer], v)
  return cache.replace(k=tuple(k_all), v=tuple(v_all))


def paged_attention(q: Float[Array, "S N H"], k_pages: Float[Array, "K N P H"],
                    v_pages: Float[Array, "K N P H"], pages: Int[Array, "S W"],
                    lengths: Int[Array, "S"], *, kind: str = "xla", mesh: Mesh | None = None
                    ) -> Float[Array, "S N H"]:
  """One query per slot against its first ``lengths[s]`` tokens (``kind``: see the module
  docstring; ``auto`` is not resolved here). Query head ``n`` reads key/value head ``n // G``;
  a slot of length 0 gets a finite, unused output.

  With ``mesh`` (axes ``('data', 'model')``) a Pallas kernel runs under :func:`jax.shard_map`
  (the compiler cannot partition a Mosaic or Triton call): heads over ``'model'`` when ``K``
  divides evenly, else replicated; slots and pages whole. The sampler calls this under a
  :func:`jax.vmap` over its data shards with ``spmd_axis_name='data'``, which puts that axis on
  ``'data'``."""
  if mesh is not None and kind != "xla" and mesh.size > 1:
    heads = axis_if_divides(mesh, k_pages.shape[0])
    local = functools.partial(paged_attention, kind=kind)
    return jax.shard_map(local, mesh=mesh, check_vma=False,
                         in_specs=(P(None, heads, None), P(heads), P(heads), P(), P()),
                         out_specs=P(None, heads, None))(q, k_pages, v_pages, pages, lengths)
  s, n_heads, h = q.shape
  scaled = q * jnp.asarray(h ** -0.5, q.dtype)  # the kernels do not scale
  if kind in TPU_KERNEL_KINDS:
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_kernel
    per_block = _pages_per_block(pages.shape[1])
    megacore = None
    if kind == "pallas_tpu_megacore":
      megacore = "kv_head" if k_pages.shape[0] % 2 == 0 else "batch" if s % 2 == 0 else None
      if megacore is None:
        raise ValueError(f"paged attention pallas_tpu_megacore splits {k_pages.shape[0]} KV heads "
                         f"or {s} slots over two TensorCores: one must be even")
    return tpu_kernel(scaled, k_pages, v_pages, lengths, pages, pages_per_compute_block=per_block,
                      megacore_mode=megacore)
  if kind in ("pallas_gpu", "pallas_gpu_interpret"):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_kernel
    pages, per_block, splits = _gpu_block_tables(pages, k_pages.shape[2])
    return gpu_kernel(scaled, k_pages, v_pages, pages, lengths, pages_per_compute_block=per_block,
                      k_splits=splits,
                      interpret=kind == "pallas_gpu_interpret")
  if kind != "xla":
    raise ValueError(f"paged attention kind {kind!r} is not one of {PAGED_ATTENTION_KINDS}")
  kv_heads, _, page_size, _ = k_pages.shape
  width = pages.shape[1] * page_size
  k = k_pages[:, pages].reshape(kv_heads, s, width, h)  # [K, S, W * P, H]
  v = v_pages[:, pages].reshape(kv_heads, s, width, h)
  q = q.reshape(s, kv_heads, n_heads // kv_heads, h)
  scores = jnp.einsum("skgh,kswh->skgw", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
  scores = scores * (h ** -0.5)
  seen = jnp.arange(width)[None, :] < lengths[:, None]  # [S, W * P]
  scores = jnp.where(seen[:, None, None, :], scores, MASKED_SCORE)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  out = jnp.einsum("skgw,kswh->skgh", probs, v.astype(q.dtype))
  return out.reshape(s, n_heads, h)


def _pages_per_block(pages_per_slot: int, most: int = 8) -> int:
  """The largest divisor of ``pages_per_slot`` up to ``most``: the kernels' pages per
  compute block must divide a block table's width."""
  return max(d for d in range(1, min(most, pages_per_slot) + 1) if pages_per_slot % d == 0)


def _gpu_block_tables(pages: Int[Array, "S W"], page_size: int, block_keys: int = 64,
                      most_splits: int = 16) -> tuple[Int[Array, "S W2"], int, int]:
  """Block tables for the Pallas GPU kernel (Triton): ``(tables, pages per compute block,
  splits)``. A compute block holds ``block_keys`` keys (a power of two of pages, at least 16
  keys); each of at most ``most_splits`` splits of a table takes a power of two of blocks, and
  the tables are padded with page 0 to fill them (the kernel stops at a slot's length, so the
  padding is never read)."""
  per_block = max(1, block_keys // page_size)
  blocks = -(-pages.shape[1] // per_block)
  splits = min(most_splits, blocks)
  per_split = 1 << (-(-blocks // splits) - 1).bit_length()
  width = splits * per_split * per_block
  return jnp.pad(pages, ((0, 0), (0, width - pages.shape[1]))), per_block, splits


def gpu_kernel_fits(page_size: int, head_dim: int) -> bool:
  """Whether the Pallas GPU kernel (Triton) takes these shapes: power-of-two pages and a head
  dimension of a power of two of at least 16 (Triton's matrix products)."""
  def power_of_two(x):
    return x > 0 and x & (x - 1) == 0
  return power_of_two(page_size) and power_of_two(head_dim) and head_dim >= 16


def tpu_kernel_fits(head_dim: int) -> bool:
  """Whether the Pallas TPU kernel (Mosaic) takes this head dimension: a multiple of 128, the
  lane width its blocks' last axis needs (Qwen2.5-0.5B's 64 does not lower; the page size does
  not matter: ``docs/results/plans.md#a-paged-kv-cache-at-the-papers-scale``)."""
  return head_dim % 128 == 0


def resolve_kind(kind: str, platform: str, page_size: int = 16, head_dim: int = 128,
                 device_kind: str | None = None) -> str:
  """``auto``: the Pallas kernel of ``platform`` where it takes the shapes
  (:func:`tpu_kernel_fits`, :func:`gpu_kernel_fits`), ``xla`` elsewhere. A kernel named
  explicitly that cannot take them is refused, in one line; so is ``pallas_tpu_megacore`` on a
  device (``device_kind``, when given) that is not a megacore chip."""
  if kind not in PAGED_ATTENTION_KINDS:
    raise ValueError(f"paged attention kind {kind!r} is not one of {PAGED_ATTENTION_KINDS}")
  tpu_fits, gpu_fits = tpu_kernel_fits(head_dim), gpu_kernel_fits(page_size, head_dim)
  if kind in TPU_KERNEL_KINDS and not tpu_fits:
    raise ValueError(f"paged attention {kind} needs a head dimension that is a multiple of "
                     f"128, not {head_dim}: use auto or xla")
  if (kind == "pallas_tpu_megacore" and device_kind is not None
      and device_kind not in MEGACORE_DEVICE_KINDS):
    raise ValueError(f"paged attention pallas_tpu_megacore needs a chip whose device is two "
                     f"TensorCores ({', '.join(MEGACORE_DEVICE_KINDS)}), not {device_kind!r}: "
                     f"use auto or pallas_tpu")
  if kind == "pallas_gpu" and not gpu_fits:
    raise ValueError(f"paged attention pallas_gpu needs power-of-two pages and a power-of-two "
                     f"head dimension of at least 16, not page_size={page_size}, head_dim="
                     f"{head_dim}: use auto or xla")
  if kind != "auto":
    return kind
  if platform in ("gpu", "cuda"):
    return "pallas_gpu" if gpu_fits else "xla"
  return "pallas_tpu" if platform == "tpu" and tpu_fits else "xla"
