"""The sampler on a fake 8-device CPU mesh (data=4, model=2): rows and KV cache over ``data``,
weights where the learner put them, the same greedy tokens as one device."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from hf_fixtures import make_tiny_qwen
from rft_jax.models import load_hf
from rft_jax.parallel import make_mesh
from rft_jax.sampling import SamplingParams, empty_cache, generate

PROMPTS = [[5, 17, 9, 33, 71, 2, 40], [88, 3], [12, 99, 64, 120, 7], [101], [3, 3, 8]]
PARAMS = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return make_tiny_qwen(tmp_path_factory.mktemp("ckpt"), "qwen2", tie=False, kv_heads=2)


def test_mesh_generate_equals_one_device(ckpt):
  mesh = make_mesh(data=4, model=2)
  sharded = load_hf(ckpt, mesh=mesh)
  before = {k: v.get_value().sharding for k, v in nnx.to_flat_state(nnx.state(sharded))}
  out = generate(sharded, PROMPTS, PARAMS, seed=0, mesh=mesh)  # 5 prompts -> bucket 8
  single = generate(load_hf(ckpt), PROMPTS, PARAMS, seed=0)
  np.testing.assert_array_equal(out.completion_ids, single.completion_ids)
  np.testing.assert_array_equal(out.completion_lengths, single.completion_lengths)
  np.testing.assert_allclose(out.logprobs, single.logprobs, atol=1e-5)
  after = {k: v.get_value().sharding for k, v in nnx.to_flat_state(nnx.state(sharded))}
  assert after == before  # the weights stayed where the learner put them
  assert before[("layers", "attn", "q_proj")] == NamedSharding(mesh, P(None, "data", "model",
                                                                       None))
  # Sampling (T > 0) on the mesh runs, and gives valid completions.
  sampled = generate(sharded, PROMPTS, dataclasses.replace(PARAMS, temperature=1.0), seed=3,
                     mesh=mesh)
  assert sampled.completion_ids.shape == (10, 8) and (sampled.completion_lengths == 8).all()


def test_cache_and_errors_on_mesh(ckpt):
  mesh = make_mesh(data=4, model=2)
  model = load_hf(ckpt)
  cache = empty_cache(model.config, 16, 24, mesh=mesh)
  assert cache.k[0].sharding == NamedSharding(mesh, P("data", "model", None, None))
  assert cache.v[-1].sharding == NamedSharding(mesh, P("data", "model", None, None))
  assert cache.slot_mask.sharding == NamedSharding(mesh, P("data", None))
  with pytest.raises(ValueError, match="is not laid out on the given mesh"):
    generate(model, PROMPTS, PARAMS, seed=0, mesh=mesh)
  other = jax.make_mesh((8,), ("x",))
  with pytest.raises(ValueError, match="has no 'data' axis"):
    generate(model, PROMPTS, PARAMS, seed=0, mesh=other)
