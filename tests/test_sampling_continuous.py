"""Continuous batching (``rft_jax.sampling.continuous``): the same samples as the static program
whatever the pool size, its stages and the order samples enter it; greedy and sampled, mixed
prompt and completion lengths; on one device and on the fake data mesh; a cache sized by the
pool."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

from hf_fixtures import make_tiny_qwen
from rft_jax.models import load_hf
from rft_jax.parallel import make_mesh
from rft_jax.sampling import SamplingParams, generate
from rft_jax.sampling.continuous import (PoolSpec, min_pool_slots, pool_sizes,
                                         sample_pool_cpu)
from rft_jax.sampling.loop import layer_indices

RNG = np.random.default_rng(7)
# Mixed prompt lengths (1-29 tokens, two buckets' worth); stop tokens 3-9 out of a vocabulary of
# 128 end about one step in twenty of a random model, so completion lengths spread from 1 to M.
PROMPTS = [RNG.integers(3, 128, RNG.integers(1, 30)).tolist() for _ in range(6)]
STOPS = tuple(range(3, 10))
STATIC = SamplingParams(n=4, temperature=1.0, max_new_tokens=40, stop_token_ids=STOPS,
                        scheduler="static", min_segment_tokens=16)  # the pool shrinks at 40


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  return load_hf(make_tiny_qwen(tmp_path_factory.mktemp("ckpt"), "qwen2", tie=False, kv_heads=2))


def _assert_same_samples(a, b, atol=1e-5):
  np.testing.assert_array_equal(a.completion_lengths, b.completion_lengths)
  np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
  np.testing.assert_array_equal(a.finish_reason, b.finish_reason)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=atol)


@pytest.mark.parametrize("temperature,pools", [
    (0.0, ((8, 3),)),
    # None: one slot per row (shrinking only); 8: refills, then 8 -> 4 -> 2 -> 1 (on CPU the
    # pool shrinks below 8 slots, down to one); 5: an odd pool (one stage); pool_stages=1:
    # refills without shrinking.
    (1.0, ((None, 3), (8, 4), (5, 3), (12, 1)))])
def test_continuous_equals_static_whatever_the_pool(model, temperature, pools):
  static = dataclasses.replace(STATIC, temperature=temperature)
  reference = generate(model, PROMPTS, static, seed=3)
  lengths = reference.completion_lengths
  # The case is long-tailed enough to exercise refills and shrinking: lengths spread, some rows
  # stop at their first tokens, some run to the limit, and both finish reasons occur.
  assert lengths.min() <= 3 and lengths.max() == 40 and np.ptp(lengths) > 20
  assert set(reference.finish_reason) == {"stop", "length"}
  for slots, stages in pools:
    continuous = dataclasses.replace(static, scheduler="continuous", decode_slots=slots,
                                     pool_stages=stages)
    _assert_same_samples(generate(model, PROMPTS, continuous, seed=3), reference)


def test_samples_follow_the_seed_and_prompt_not_the_slot(model):
  params = dataclasses.replace(STATIC, scheduler="continuous", decode_slots=8)
  out = generate(model, PROMPTS, params, seed=11)
  order = [4, 1, 5, 0, 3, 2]  # the prompts in another order enter other slots at other steps
  shuffled = generate(model, [PROMPTS[i] for i in order], params, seed=11)
  rows = np.concatenate([np.arange(i * 4, i * 4 + 4) for i in order])
  np.testing.assert_array_equal(shuffled.completion_ids, out.completion_ids[rows])
  np.testing.assert_allclose(shuffled.logprobs, out.logprobs[rows], atol=1e-5)
  other_seed = generate(model, PROMPTS, params, seed=12)
  assert not np.array_equal(other_seed.completion_ids, out.completion_ids)


def test_first_token_stops_and_single_token_completions(model):
  # Every completion of one token: nothing enters the pool, the first draws are the samples.
  one = dataclasses.replace(STATIC, max_new_tokens=1)
  _assert_same_samples(generate(model, PROMPTS, dataclasses.replace(one, scheduler="continuous"),
                                seed=5), generate(model, PROMPTS, one, seed=5))
  # Almost every token stops a completion: most never enter a slot.
  stop_most = dataclasses.replace(STATIC, stop_token_ids=tuple(range(3, 120)))
  reference = generate(model, PROMPTS, stop_most, seed=5)
  assert (reference.completion_lengths == 1).mean() > 0.5
  _assert_same_samples(generate(model, PROMPTS, dataclasses.replace(
      stop_most, scheduler="continuous", decode_slots=4), seed=5), reference)


def test_continuous_on_the_mesh_equals_one_device(tmp_path):
  ckpt = make_tiny_qwen(tmp_path, "qwen2", tie=False, kv_heads=2)
  mesh = make_mesh(data=4, model=2)
  params = dataclasses.replace(STATIC, scheduler="continuous", decode_slots=8)
  sharded = generate(load_hf(ckpt, mesh=mesh), PROMPTS, params, seed=3, mesh=mesh)
  single = generate(load_hf(ckpt), PROMPTS, STATIC, seed=3)
  _assert_same_samples(sharded, single)


def test_short_calls_do_not_shrink():
  spec = lambda **kw: PoolSpec.of(dataclasses.replace(STATIC, **kw), 128)  # noqa: E731
  assert spec().slots == (128, 64, 32, 16, 8)
  assert spec(min_segment_tokens=64).slots == (128,)  # 40 < 2 x 64: one compiled decode body
  assert spec(min_segment_tokens=64, max_new_tokens=128).slots == (128, 64, 32, 16, 8)
  cpu = PoolSpec.of(dataclasses.replace(STATIC, decode_slots=64), 128, platform="cpu")
  assert cpu.slots == (64, 32, 16, 8, 4, 2, 1)  # on CPU down to one slot


def test_pool_sizes():
  assert pool_sizes(128, 64, 3) == (64, 32, 16)
  assert pool_sizes(128, None, 3) == (128, 64, 32)
  assert pool_sizes(32, None, 1) == (32,)
  assert pool_sizes(24, 5, 3) == (5,)  # odd: no halving
  assert pool_sizes(24, 5, 3, data=4) == (8,)  # a multiple of the data axis, never below 8
  assert pool_sizes(64, 48, 4, data=8) == (48, 24)  # 12 is not a multiple of 8
  assert pool_sizes(10, 100, 3) == (10,)  # never more slots than rows
  assert pool_sizes(64, None, 8, min_slots=1) == (64, 32, 16, 8, 4, 2, 1)
  assert pool_sizes(64, None, 8, data=4, min_slots=1) == (64, 32, 16, 8, 4)  # shards keep one
  assert min_pool_slots("cpu") == 1 and min_pool_slots("gpu") == min_pool_slots(None) == 8


def test_the_cache_follows_the_pool_not_the_rows(model):
  """The compiled program's temporaries (the pool's cache among them) shrink with the pool."""
  graphdef, state = nnx.split(model)
  b, p = 16, 32
  args = (np.zeros((b, p), np.int32), np.ones((b, p), np.int32), np.zeros((b, 3), np.uint32),
          np.ones(b, bool), np.uint32(0), np.float32(1), np.int32(0), np.float32(1),
          layer_indices(model.config.num_hidden_layers))
  params = dataclasses.replace(STATIC, n=8, max_new_tokens=512, scheduler="continuous")

  def temp_bytes(slots):
    spec = PoolSpec.of(dataclasses.replace(params, decode_slots=slots, pool_stages=1), b * 8)
    compiled = sample_pool_cpu.lower(graphdef, state, *args, spec=spec, mesh=None, rules=()
                                     ).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  c = model.config
  row = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * (p + 512) * 4  # f32 K, V
  full, pooled = temp_bytes(None), temp_bytes(16)
  assert full - pooled >= 0.9 * (128 - 16) * row, (full, pooled, row)


def test_the_cpu_pool_tiles_its_keys_for_the_kernel(model, cpu_kernel, monkeypatch):
  """With the CPU attention kernel, the pool holds its keys tiled (``[S, K, W / 64, H, 64]``,
  ``cpu_attention.tile_keys``) and the static program its ``[B, K, H, S]`` keys; the samples are
  the same (the kernel reads both layouts to the same bits; log-probabilities to float32
  rounding, as XLA's products may round a row differently at another batch size)."""
  import jax
  from rft_jax.models.decode import cpu_attention
  ranks = set()
  attend = cpu_attention.attend

  def recording(q, k_cache, v_cache, mask):
    ranks.add(k_cache.ndim)
    return attend(q, k_cache, v_cache, mask)
  monkeypatch.setattr(cpu_attention, "attend", recording)
  jax.clear_caches()  # traced afresh, through the recorder
  reference = generate(model, PROMPTS, STATIC, seed=5)
  assert ranks == {4}
  ranks.clear()
  pooled = generate(model, PROMPTS, dataclasses.replace(STATIC, scheduler="continuous",
                                                        decode_slots=8), seed=5)
  assert ranks == {5}
  _assert_same_samples(pooled, reference)
