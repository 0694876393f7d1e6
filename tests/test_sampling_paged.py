"""Continuous batching on a paged KV cache (``rft_jax.sampling.paged_pool``): the static
program's samples whatever the page budget, including budgets small enough that samples are
evicted and decoded again; on one device and on the fake data mesh; memory that follows the
pages, not the slots."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from flax import nnx

from hf_fixtures import make_tiny_qwen
from rft_jax.models import load_hf
from rft_jax.parallel import make_mesh
from rft_jax.sampling import generate
from rft_jax.sampling.continuous import PoolSpec, sample_pool_cpu
from rft_jax.sampling.generate import sampler_rules
from rft_jax.sampling.loop import layer_indices
from test_sampling_continuous import PROMPTS, STATIC, _assert_same_samples  # the same case

@pytest.fixture(scope="module")
def model(tmp_path_factory):
  return load_hf(make_tiny_qwen(tmp_path_factory.mktemp("ckpt"), "qwen2", tie=False, kv_heads=2))


def _paged(params, **kw):
  return dataclasses.replace(params, scheduler="continuous", **kw)


@pytest.mark.parametrize("temperature,budgets", [
    (0.0, ((90, 4, 8),)),
    # (pages, page size, slots). 8 prompts (6 and 2 dummies) of 32 slots take 64 pages of 4
    # (32 of 8); a sample takes up to 18 (9). 82 and 45: barely one sample beside the prompts,
    # so samples are evicted and decoded again, with a slot per row and with refills (12
    # slots); pages of 4 and 8.
    (1.0, ((82, 4, None), (45, 8, 12)))])
def test_paged_equals_static_whatever_the_pages(model, temperature, budgets):
  static = dataclasses.replace(STATIC, temperature=temperature)
  reference = generate(model, PROMPTS, static, seed=3)
  assert reference.completion_lengths.max() == 40 and reference.completion_lengths.min() <= 3
  evictions = {}
  for pages, page_size, slots in budgets:
    out = generate(model, PROMPTS, _paged(static, kv_pages=pages, page_size=page_size,
                                          decode_slots=slots), seed=3)
    _assert_same_samples(out, reference)
    evictions[pages] = out.evictions
  assert min(evictions.values()) > 5, evictions


def test_paged_on_the_mesh_equals_one_device(tmp_path):
  """One pool per data shard: each shard's 2 prompts (8 buckets over data=4) take 16 pages of
  4 and a sample up to 18: 34 pages per shard, the least, evict (one global pool of 34 could not
  even hold the 8 prompts); 16 slots, then 8: 4, then 2 per shard; every device holds its
  shard's pages of its kv head, not every page."""
  ckpt = make_tiny_qwen(tmp_path, "qwen2", tie=False, kv_heads=2)
  mesh = make_mesh(data=4, model=2)
  pages, page_size = 34, 4
  params = _paged(STATIC, decode_slots=16, kv_pages=pages, page_size=page_size)
  model = load_hf(ckpt, mesh=mesh)
  sharded = generate(model, PROMPTS, params, seed=3, mesh=mesh)
  _assert_same_samples(sharded, generate(load_hf(ckpt), PROMPTS, STATIC, seed=3))
  assert sharded.evictions > 0

  graphdef, state = nnx.split(model)
  b, p = 8, 32
  args = (np.zeros((b, p), np.int32), np.ones((b, p), np.int32), np.zeros((b, 3), np.uint32),
          np.ones(b, bool), np.uint32(0), np.float32(1), np.int32(0), np.float32(1),
          layer_indices(model.config.num_hidden_layers))
  spec = PoolSpec.of(params, b * params.n, data=4)
  assert spec.slots == (16, 8)
  hlo = sample_pool_cpu.lower(graphdef, state, *args, spec=spec, mesh=mesh,
                              rules=sampler_rules()).compile().as_text()
  c = model.config
  # Per device, a layer's pages [shards, K, N, P, H] are [1, K / 2, N, P, H]: one shard's.
  held = set(re.findall(rf"f32\[([\d,]+),{pages},{page_size},{c.head_dim}\]", hlo))
  assert held == {f"1,{c.num_key_value_heads // 2}"}, held


def test_pallas_gpu_kernel_in_the_shards_pools(tmp_path):
  """jax's Pallas GPU paged attention (interpret mode on CPU) vmapped over two data shards'
  pools, evicting: the static program's samples."""
  ckpt = make_tiny_qwen(tmp_path, "qwen2", tie=False, kv_heads=2)
  reference = generate(load_hf(ckpt), PROMPTS, STATIC, seed=3)
  mesh = make_mesh(data=2, model=1)
  params = _paged(STATIC, decode_slots=8, kv_pages=54, page_size=4,  # 4 prompts: 32 + 18 + 4
                  paged_attention="pallas_gpu_interpret")
  out = generate(load_hf(ckpt, mesh=mesh), PROMPTS, params, seed=3, mesh=mesh)
  _assert_same_samples(out, reference)
  assert out.evictions > 0


def test_too_few_pages_and_the_static_scheduler_are_refused(model):
  with pytest.raises(ValueError, match=r"kv_pages=70 pages of 4 tokens \(per data shard\) cannot "
                     r"hold the shard's 8 prompts of 32 slots \(64 pages\) and one whole sample "
                     r"\(18 pages\); give at least 82"):
    generate(model, PROMPTS, _paged(STATIC, kv_pages=70, page_size=4), seed=3)
  with pytest.raises(ValueError, match="kv_pages .* needs sampling.scheduler=continuous"):
    dataclasses.replace(STATIC, kv_pages=100)


def test_the_paged_cache_follows_the_pages_not_the_slots(model):
  """128 slots of 544 tokens take a dense pool's cache of 128 full rows; on pages the
  compiled program's temporaries grow with the page budget instead (on CPU the XLA paged
  attention also gathers one layer's slots at full width for a step)."""
  graphdef, state = nnx.split(model)
  b, p, m = 16, 32, 512
  args = (np.zeros((b, p), np.int32), np.ones((b, p), np.int32), np.zeros((b, 3), np.uint32),
          np.ones(b, bool), np.uint32(0), np.float32(1), np.int32(0), np.float32(1),
          layer_indices(model.config.num_hidden_layers))
  params = dataclasses.replace(STATIC, n=8, max_new_tokens=m, scheduler="continuous",
                               pool_stages=1, page_size=16)

  def temp_bytes(**kw):
    spec = PoolSpec.of(dataclasses.replace(params, **kw), b * 8)
    compiled = sample_pool_cpu.lower(graphdef, state, *args, spec=spec, mesh=None, rules=()
                                     ).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  c = model.config
  token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # f32 K and V
  dense = temp_bytes()
  small, large = temp_bytes(kv_pages=200), temp_bytes(kv_pages=1200)
  assert large - small >= 0.9 * 1000 * 16 * token, (small, large, token)
  dense_cache = 128 * (p + m) * token
  one_layer = dense_cache // c.num_hidden_layers
  assert dense - small >= 0.9 * (dense_cache - one_layer - 200 * 16 * token), (dense, small)


def test_the_tpu_program_holds_each_layers_pages_once():
  """Compiled for v5p (deviceless, libtpu) with jax's TPU kernel under the shard vmap: every
  layer's pages stay in the one layout the kernel reads, so the program holds them once and
  copies none of them in a step. The pages were once written by a scatter whose layout the TPU
  compiler put the heads' axis second-minor in: it then copied each layer's whole page pool
  into the kernel's layout and back at every step (temporaries 2.2 times the pages' bytes
  where they are now 1.1, ``benchmarks/plan/sampler_memory.py --head-dim 128``)."""
  import jax
  import jax.numpy as jnp

  from rft_jax.models import QwenConfig
  from rft_jax.models.hf import abstract_model
  from rft_jax.parallel.sharding import state_shardings, with_shardings
  from rft_jax.plan.devices import topology
  from rft_jax.plan.fit import compile_sampler_call
  from rft_jax.sampling import SamplingParams
  from rft_jax.sampling.generate import call_spec

  mesh = make_mesh(data=2, model=2, devices=topology("v5p:2x2x1").devices)
  config = QwenConfig(model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=128, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  graphdef, abstract = nnx.split(abstract_model(config))
  state = with_shardings(abstract, state_shardings(abstract, mesh))
  pages, page_size = 1000, 16
  params = SamplingParams(n=4, max_new_tokens=256, stop_token_ids=(0,), kv_pages=pages,
                          page_size=page_size, paged_attention="pallas_tpu")
  # The kernel's bfloat16 products need the default precision (conftest sets "highest").
  with jax.default_matmul_precision("default"):
    compiled = compile_sampler_call(mesh, graphdef, state, call_spec(params, 16, 2), 4, 32)
  hlo = compiled.as_text()
  # One layer's keys (or values) on a device: its 2 kv heads (4 over model=2), all its shard's
  # pages.
  page_shape = re.compile(rf"= bf16\[(?:1,)*2,{pages},{page_size},128\]\{{[^}}]*\}} ([\w-]+)\(")
  ops = page_shape.findall(hlo)
  page_bytes = 2 * config.num_hidden_layers * 2 * pages * page_size * 128 * 2  # K and V, bfloat16
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert "scatter" in ops and "copy" not in ops, (sorted(set(ops)), temp / page_bytes)
  assert temp < 1.6 * page_bytes, temp / page_bytes  # 1.32 (2026-11-27); 2.35 with the copies
