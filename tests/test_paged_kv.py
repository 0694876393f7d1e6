"""The paged KV cache (``rft_jax.models.decode.paged_kv``): prompts shifted into pages, one token
written per slot, and paged attention equal to the dense cache's, by XLA and by jax's Pallas
GPU kernel (in Pallas' interpret mode here; on a GPU, also the real Triton kernel)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax.models.attention import attend_cache
from rft_jax.models.decode.paged_kv import (PagedKVCache, paged_attention, pages_for, prompt_pages,
                                     resolve_kind, tpu_kernel_fits, write_token)

RNG = np.random.default_rng(0)
K, N, P, H, G = 2, 24, 4, 16, 3  # kv heads, pages, page size, head width, queries per kv head
# The kinds this backend runs, and how close each is to the dense float32 reference (Triton's
# float32 products on a GPU round their inputs to TF32).
KINDS = ["xla", "pallas_gpu_interpret"] + (["pallas_gpu"] if jax.default_backend() == "gpu" else [])
ATOL = {"xla": 2e-6, "pallas_gpu_interpret": 2e-6, "pallas_gpu": 5e-3}


def _pages_and_tables(slots=5, width=4):
  k = jnp.asarray(RNG.normal(size=(K, N, P, H)), jnp.float32)
  v = jnp.asarray(RNG.normal(size=(K, N, P, H)), jnp.float32)
  tables = jnp.asarray(RNG.permutation(N)[:slots * width].reshape(slots, width), jnp.int32)
  return k, v, tables


def _dense_reference(q, k, v, tables, lengths):
  """attend_cache on each slot's pages laid end to end, the slots past its length masked."""
  s, w = tables.shape
  keys = k[:, tables].reshape(K, s, w * P, H).transpose(1, 0, 3, 2)  # [S, K, H, W*P]
  values = v[:, tables].reshape(K, s, w * P, H).transpose(1, 0, 2, 3)  # [S, K, W*P, H]
  mask = (jnp.arange(w * P)[None, :] < lengths[:, None])[:, None, :]
  return attend_cache(q[:, None], keys, values, mask)[:, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_paged_attention_equals_the_dense_cache(kind):
  k, v, tables = _pages_and_tables()
  lengths = jnp.asarray([1, 5, 16, 9, 4], jnp.int32)  # one token, a page, a full table, ...
  q = jnp.asarray(RNG.normal(size=(5, K * G, H)), jnp.float32)
  np.testing.assert_allclose(paged_attention(q, k, v, tables, lengths, kind=kind),
                             _dense_reference(q, k, v, tables, lengths), atol=ATOL[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_tokens_past_the_length_do_not_count(kind):
  k, v, tables = _pages_and_tables()
  lengths = jnp.asarray([3, 4, 7, 1, 9], jnp.int32)
  q = jnp.asarray(RNG.normal(size=(5, K * G, H)), jnp.float32)
  before = paged_attention(q, k, v, tables, lengths, kind=kind)
  unused = jnp.asarray([t for row, n in zip(np.asarray(tables), np.asarray(lengths))
                        for t in row[pages_for(int(n), P):]])  # (a freed page's old tokens)
  k2, v2 = k.at[:, unused].set(1e4), v.at[:, unused].set(-1e4)
  np.testing.assert_array_equal(paged_attention(q, k2, v2, tables, lengths, kind=kind), before)


@pytest.mark.parametrize("kind", KINDS)
def test_paged_attention_under_vmap_reads_each_shards_own_pages(kind):
  """Per-data-shard pools (``rft_jax.sampling.paged_shards``) vmap the decode step over a
  leading shard axis: each shard's block tables index its own pages."""
  shards = [_pages_and_tables() for _ in range(2)]
  k, v, tables = (jnp.stack(x) for x in zip(*shards))  # [2, K, N, P, H], [2, S, W]
  lengths = jnp.asarray([[1, 5, 16, 9, 4], [7, 2, 11, 16, 3]], jnp.int32)
  q = jnp.asarray(RNG.normal(size=(2, 5, K * G, H)), jnp.float32)
  out = jax.vmap(functools.partial(paged_attention, kind=kind))(q, k, v, tables, lengths)
  for d in range(2):
    np.testing.assert_allclose(out[d], _dense_reference(q[d], k[d], v[d], tables[d], lengths[d]),
                               atol=ATOL[kind])


def test_prompt_pages_shift_left_padded_rows_to_their_pages():
  lengths = np.array([3, 7, 1])
  b, s = 3, 7
  layer = np.zeros((b, K, s, H), np.float32)
  for row, n in enumerate(lengths):  # token j of row b (left-padded) holds 100 b + j
    layer[row, :, s - n:, :] = (100 * row + np.arange(n))[None, :, None]
  pages = np.asarray(prompt_pages(jnp.asarray(layer), jnp.asarray(lengths), P))
  per_row = pages_for(s, P)
  assert pages.shape == (K, b * per_row, P, H)
  for row, n in enumerate(lengths):
    tokens = pages[:, row * per_row:(row + 1) * per_row].reshape(K, per_row * P, H)[:, :n]
    np.testing.assert_array_equal(tokens, np.broadcast_to(
        (100 * row + np.arange(n))[None, :, None], (K, n, H)))


def test_write_token_goes_to_the_slots_page_and_offset():
  k, v, tables = _pages_and_tables(slots=3)
  cache = PagedKVCache(k=(k,), v=(v,), pages=tables, lengths=jnp.asarray([0, 6, 13], jnp.int32))
  new_k = jnp.full((3, K, H), 7.0)
  out = write_token(cache, 0, new_k, new_k, jnp.asarray([True, True, False]))
  t = np.asarray(tables)
  changed = np.argwhere(np.any(np.asarray(out.k[0]) != np.asarray(k), axis=(0, 3)))
  assert sorted(map(tuple, changed)) == sorted([(t[0, 0], 0), (t[1, 1], 2)])  # slot 2 idle
  assert np.all(np.asarray(out.v[0])[:, t[1, 1], 2] == 7.0)


def _v5p_chip_arrays():
  """``shape(*dims, dtype=bfloat16)``: abstract arrays on one chip of a v5p topology
  (deviceless, libtpu)."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as Spec

  from rft_jax.plan.devices import topology
  chip = NamedSharding(Mesh(topology("v5p:2x2x1").devices[:1], ("x",)), Spec())
  return lambda *dims, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(dims, dtype, sharding=chip)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tpu_kernel_fits_is_what_mosaic_lowers(head_dim):
  """Lowered for a v5p chip (deviceless, libtpu): jax's TPU kernel takes a head dimension of 128
  and refuses 64, as :func:`tpu_kernel_fits` says, so ``auto`` never picks a kernel that fails."""
  shape = _v5p_chip_arrays()
  kernel = jax.jit(functools.partial(paged_attention, kind="pallas_tpu"))
  args = (shape(8, 8, head_dim), shape(2, 64, 16, head_dim), shape(2, 64, 16, head_dim),
          shape(8, 16, dtype=jnp.int32), shape(8, dtype=jnp.int32))
  if tpu_kernel_fits(head_dim):
    kernel.lower(*args)
  else:
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
      kernel.lower(*args)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kv_heads,slots,mode", [(2, 7, "kv_head"), (1, 8, "batch"), (1, 7, None)])
def test_tpu_megacore_kind_lowers_split_over_heads_or_slots(kv_heads, slots, mode):
  """``pallas_tpu_megacore`` lowers jax's TPU kernel for v5p with ``megacore_mode`` by KV head
  where a device holds an even number of them, else by slot; with neither even, one line."""
  from jax.experimental.pallas.ops.tpu import paged_attention as tpu_module

  shape = _v5p_chip_arrays()
  args = (shape(slots, 4 * kv_heads, 128), shape(kv_heads, 64, 16, 128),
          shape(kv_heads, 64, 16, 128), shape(slots, 16, dtype=jnp.int32),
          shape(slots, dtype=jnp.int32))
  seen = []
  kernel = tpu_module.paged_attention
  with pytest.MonkeyPatch.context() as patch:  # record the mode the kernel is given
    patch.setattr(tpu_module, "paged_attention",
                  lambda *a, **kw: seen.append(kw["megacore_mode"]) or kernel(*a, **kw))
    run = jax.jit(functools.partial(paged_attention, kind="pallas_tpu_megacore"))
    if mode is None:
      with pytest.raises(ValueError, match="splits 1 KV heads or 7 slots over two TensorCores"):
        run.lower(*args)
    else:
      with jax.default_matmul_precision("default"):  # Mosaic: bfloat16 products
        run.lower(*args).compile()
      assert seen == [mode]


def test_resolve_kind():
  assert resolve_kind("auto", "tpu") == "pallas_tpu"
  assert resolve_kind("auto", "gpu") == "pallas_gpu"
  # Triton's blocks are powers of two and its products need 16 or more: else XLA's gather.
  assert resolve_kind("auto", "gpu", page_size=16, head_dim=64) == "pallas_gpu"
  assert resolve_kind("auto", "gpu", page_size=12, head_dim=64) == "xla"
  assert resolve_kind("auto", "gpu", page_size=16, head_dim=8) == "xla"
  # Mosaic's blocks need a head dimension of a multiple of 128 (any page size): else XLA's gather.
  assert resolve_kind("auto", "tpu", page_size=12, head_dim=128) == "pallas_tpu"
  assert resolve_kind("auto", "tpu", page_size=16, head_dim=64) == "xla"
  with pytest.raises(ValueError, match="pallas_tpu needs a head dimension that is a multiple of "
                                       "128, not 64"):
    resolve_kind("pallas_tpu", "tpu", page_size=16, head_dim=64)
  with pytest.raises(ValueError, match="pallas_gpu needs power-of-two pages"):
    resolve_kind("pallas_gpu", "gpu", page_size=12, head_dim=64)
  assert resolve_kind("auto", "cpu") == "xla"
  assert resolve_kind("xla", "gpu") == "xla"
  # Megacore only where asked for, and only on chips whose device is two TensorCores.
  assert resolve_kind("auto", "tpu", device_kind="TPU v5") == "pallas_tpu"
  assert resolve_kind("pallas_tpu_megacore", "tpu", device_kind="TPU v5") == "pallas_tpu_megacore"
  assert resolve_kind("pallas_tpu_megacore", "tpu", device_kind="TPU v4") == "pallas_tpu_megacore"
  with pytest.raises(ValueError, match="megacore needs a chip whose device is two TensorCores "
                                       r"\(TPU v4, TPU v5\), not 'TPU v5 lite'"):
    resolve_kind("pallas_tpu_megacore", "tpu", device_kind="TPU v5 lite")
  with pytest.raises(ValueError, match="pallas_tpu_megacore needs a head dimension"):
    resolve_kind("pallas_tpu_megacore", "tpu", head_dim=64, device_kind="TPU v5")
  with pytest.raises(ValueError, match="not one of"):
    resolve_kind("flash", "gpu")
