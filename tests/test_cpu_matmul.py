"""The CPU panel product (``rft_jax.models.cpu_matmul``) against the products it replaces, its
packing, its batch invariance and when the sampler's pool uses it. Built by
``tests/conftest.py`` (``cpu_kernel``) with the attention kernel, as ``rft-jax build-kernels``
builds them; every array here is on the CPU backend."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import make_tiny_qwen
from rft_jax.models import Qwen, QwenConfig, cpu_attention, cpu_matmul, feature_major, load_hf
from rft_jax.sampling import SamplingParams, continuous, generate


@pytest.fixture(autouse=True)
def on_cpu():
  with jax.default_device(jax.devices("cpu")[0]):
    yield


@pytest.fixture
def panel_kernel(cpu_kernel):
  if not cpu_matmul.available():  # the library holds it where built for x86-64-v3
    pytest.skip(f"this CPU builds {cpu_attention.target()}: no panel product, XLA's products run")


def test_panels_hold_eight_rows_a_column_padded_with_zeros():
  w = np.arange(13 * 5, dtype=np.float32).reshape(13, 5)
  packed = np.asarray(cpu_matmul.panels(jnp.asarray(w)))
  assert packed.shape == (2, 5, 8)
  for row in range(16):
    for i in range(5):
      assert packed[row // 8, i, row % 8] == (w[row, i] if row < 13 else 0.0)


@pytest.mark.parametrize("rows,inputs", [(8, 1), (13, 17), (40, 64), (64, 300)])
def test_panel_product_equals_the_product(panel_kernel, rows, inputs):
  """Every batch of 1-16 columns (one pass of up to 12 registers, two passes above), rows not a
  multiple of 8 (padded panels, sliced off): float32 within rounding of the float64 product."""
  rng = np.random.default_rng(rows)
  w = rng.standard_normal((rows, inputs)).astype(np.float32)
  packed = cpu_matmul.panels(jnp.asarray(w))
  for columns in (1, 5, 8, 12, 13, 16):
    h = rng.standard_normal((inputs, columns)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_matmul.matmul, static_argnums=2)(packed, jnp.asarray(h), rows))
    assert got.shape == (rows, columns) and got.dtype == np.float32
    want = w.astype(np.float64) @ h.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(inputs))


def test_panel_product_gives_each_column_the_same_bits_at_any_batch(panel_kernel):
  """A column's outputs do not depend on the batch around it (one chain of FMAs per output),
  where XLA's products block by shape: a row's logits are the same in any pool stage."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((96, 200)).astype(np.float32)
  packed = cpu_matmul.panels(jnp.asarray(w))
  h = jnp.asarray(rng.standard_normal((200, 16)).astype(np.float32))
  full = np.asarray(cpu_matmul.matmul(packed, h, 96))
  for columns in (1, 3, 12, 13):
    part = np.asarray(cpu_matmul.matmul(packed, h[:, :columns], 96))
    np.testing.assert_array_equal(part.view(np.int32), full[:, :columns].view(np.int32))


def test_packed_decode_step_equals_the_unpacked_one(panel_kernel, tmp_path):
  """``feature_major.decode_step`` on packed weights: the same logits and cache as on the
  ``[out, in]`` weights (XLA's products) to float32 rounding, over two steps."""
  model = load_hf(make_tiny_qwen(tmp_path, "qwen3", tie=False, kv_heads=2))
  rng = np.random.default_rng(1)
  cache = model.init_cache(3, 12)
  prompt = jnp.asarray(rng.integers(3, 128, (3, 4)), jnp.int32)
  _, cache = nnx.jit(lambda m, i, c: m.prefill(i, jnp.ones_like(i), c))(model, prompt, cache)

  @functools.partial(nnx.jit, static_argnums=2)
  def two_steps(m, cache, packed):
    weights = feature_major.decode_weights(m, packed=packed)
    out = []
    for tokens in (jnp.asarray([3, 5, 7]), jnp.asarray([11, 2, 9])):
      logits, cache = feature_major.decode_step(m, weights, tokens, cache, cpu_attention.attend)
      out.append(logits)
    return out, cache

  plain, plain_cache = two_steps(model, cache, False)
  packed, packed_cache = two_steps(model, cache, True)
  for a, b in zip(plain, packed):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(plain_cache), jax.tree.leaves(packed_cache)):
    np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                               rtol=1e-5, atol=1e-5)


def test_packed_weights_are_float32_only():
  config = QwenConfig("qwen3", 128, 64, 96, 2, 4, 2, head_dim=16, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="float32 only"):
    feature_major.decode_weights(Qwen(config, rngs=nnx.Rngs(0)), packed=True)


def test_the_pools_small_stages_multiply_by_the_panel_kernel(panel_kernel, tmp_path, monkeypatch):
  """On one CPU device a pool stage of at most ``MAX_COLUMNS`` slots runs the panel product
  (and the larger ones XLA's); its samples equal the static program's."""
  model = load_hf(make_tiny_qwen(tmp_path, "qwen2", tie=True, kv_heads=2))
  jax.clear_caches()  # the pool's program traced anew, through the spy below
  traced = []
  matmul = cpu_matmul.matmul
  monkeypatch.setattr(cpu_matmul, "matmul",
                      lambda w, h, rows: traced.append(h.shape[1]) or matmul(w, h, rows))
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, 128, rng.integers(2, 9)).tolist() for _ in range(4)]
  static = SamplingParams(n=8, max_new_tokens=40, stop_token_ids=tuple(range(3, 10)),
                          scheduler="static", min_segment_tokens=16)
  pooled = dataclasses.replace(static, scheduler="continuous", decode_slots=32)
  assert continuous.PoolSpec.of(pooled, 32, platform="cpu").slots == (32, 16, 8, 4, 2, 1)
  got = generate(model, prompts, pooled, seed=4)
  assert traced and set(traced) == {8, 4, 2, 1}  # the stages of 8 slots and fewer
  want = generate(model, prompts, static, seed=4)
  np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_no_panel_products_without_the_attention_kernel(panel_kernel):
  assert continuous.panel_products_for(cpu_attention.attend, jnp.float32)
  assert not continuous.panel_products_for(cpu_attention.attend, jnp.bfloat16)
  assert not continuous.panel_products_for(feature_major.attend, jnp.float32)
