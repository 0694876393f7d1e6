"""The tiled expert product (rft_jax/models/expert_tiles.py), its two forms, and the rule that picks it
(issue 54)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax.models.moe import _grouped_experts, differentiable_product, expert_product, grouped_experts
from rft_jax.models.expert_tiles import tile_rows, tiled_experts


def experts(n: int, num_experts: int = 8, k: int = 2, d: int = 16, i: int = 12, seed: int = 0,
            skewed: bool = False):
  """Tokens ``[n, d]``, their top-k routing and random experts; ``skewed``: most tokens to one
  expert (tiles of several rows, experts without rows)."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(n, num_experts))
  if skewed:
    logits[:, 3] += 4.0
  weights, ids = jax.lax.top_k(jax.nn.softmax(jnp.asarray(logits, jnp.float32)), k)
  x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  gate, up = (jnp.asarray(0.3 * rng.normal(size=(num_experts, d, i)), jnp.float32)
              for _ in range(2))
  down = jnp.asarray(0.3 * rng.normal(size=(num_experts, i, d)), jnp.float32)
  return x, ids, weights, gate, up, down


@pytest.mark.parametrize("n, tile, skewed", [(1, None, False), (5, 2, False), (40, None, True),
                                             (40, 8, True), (64, 3, False)])
def test_tiled_equals_ragged(n, tile, skewed):
  args = experts(n, skewed=skewed)
  want = _grouped_experts(*args)
  got = jax.jit(tiled_experts, static_argnames="tile")(*args, tile=tile)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_tile_rows():
  assert [tile_rows(a, 64) for a in (8, 64, 512, 4096, 32768, 10 ** 6)] == [8, 8, 8, 64, 256, 256]


def test_expert_product_rule():
  assert expert_product("cpu", differentiable=False) == "tiled"
  assert expert_product("cpu", differentiable=True) == "tiled"
  assert expert_product("gpu", differentiable=True) == "tiled"
  assert expert_product("gpu", differentiable=False) == "tiled"
  assert [expert_product("tpu", differentiable=d) for d in (False, True)] == ["ragged", "gmm"]


@pytest.mark.parametrize("n, tile, skewed", [(1, None, False), (5, 2, False), (40, 8, True), (64, 3, False)])
def test_differentiable_tiles_equal_the_ragged_product_and_its_gradients(n, tile, skewed):
  """The map over every possible tile: the ragged product's values and gradients (to rounding),
  with experts that get no rows (skewed) and tiles past the data's."""
  x, ids, weights, gate, up, down = experts(n, skewed=skewed)

  def loss(product, x, weights, gate, up, down):
    return jnp.sum(jnp.sin(product(x, ids, weights, gate, up, down)))

  tiles = lambda *a: tiled_experts(*a, tile=tile, differentiable=True)
  np.testing.assert_allclose(jax.jit(tiles)(x, ids, weights, gate, up, down),
                             _grouped_experts(x, ids, weights, gate, up, down), rtol=2e-5, atol=2e-5)
  got = jax.jit(jax.grad(lambda *a: loss(tiles, *a), argnums=(0, 1, 2, 3, 4)))(x, weights, gate, up, down)
  want = jax.grad(lambda *a: loss(_grouped_experts, *a), argnums=(0, 1, 2, 3, 4))(x, weights, gate, up, down)
  for i, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=f"grad {i}")
  assert float(jnp.max(jnp.abs(got[2]))) > 0


def test_the_gpu_learners_expert_product_is_the_tiles_not_an_expanded_ragged_dot():
  """On a GPU XLA expands ragged_dot into a [N k, E D] copy of the rows, and a TPU's derivative
  of it runs over every expert: the differentiated form (the learner's) has no ragged_dot on
  any platform (the tiles on CPU and GPU, megablox's kernels on TPU; traced on CPU)."""
  x, ids, weights, gate, up, down = experts(32, num_experts=16)
  for platform, ragged in (("gpu", False), ("tpu", False), ("cpu", False)):
    product = differentiable_product(platform)
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(product(x, ids, weights, gate, up, down))))(x)
    assert ("ragged_dot" in str(jaxpr)) == ragged, platform


def test_cache_form_jits_and_vmaps_as_the_ragged_product():
  """The cache paths' form (tiled on CPU) under jit and under vmap over a data-shard axis, as
  the paged sampler runs it, equals the ragged product of each shard's tokens."""
  x, ids, weights, gate, up, down = experts(24, skewed=True)
  cache_form = jax.jit(lambda *a: grouped_experts(*a, vmappable=True))
  np.testing.assert_allclose(cache_form(x, ids, weights, gate, up, down),
                             _grouped_experts(x, ids, weights, gate, up, down), rtol=2e-5, atol=2e-5)
  shards = [a.reshape(3, 8, -1) for a in (x, ids, weights)]
  got = jax.jit(jax.vmap(lambda *a: grouped_experts(*a, gate, up, down, vmappable=True)))(*shards)
  want = jnp.stack([_grouped_experts(*(a[s] for a in shards), gate, up, down) for s in range(3)])
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_differentiated_form_on_cpu_is_the_tiles():
  """The learner's form on CPU is the differentiable tiles: its gradients are theirs exactly."""
  x, ids, weights, gate, up, down = experts(12)

  def loss(product, x, weights, gate, up, down):
    return jnp.sum(jnp.sin(product(x, ids, weights, gate, up, down)))

  plain = jax.grad(lambda *a: loss(grouped_experts, *a), argnums=(0, 1, 2, 3, 4))
  tiles = jax.grad(lambda *a: loss(functools.partial(tiled_experts, differentiable=True), *a),
                   argnums=(0, 1, 2, 3, 4))
  for got, want in zip(plain(x, weights, gate, up, down), tiles(x, weights, gate, up, down)):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n, skewed", [(5, False), (40, True), (64, False)])
def test_megablox_kernels_equal_the_ragged_product_and_its_gradients(n, skewed):
  """The TPU learner's product, megablox's gmm / tgmm in Pallas interpret mode: the ragged
  product's values and gradients, with rows padded to the kernel's row tile (none at 64 x 2)."""
  from rft_jax.models.expert_gmm import gmm_experts

  x, ids, weights, gate, up, down = experts(n, skewed=skewed)

  def loss(product, x, weights, gate, up, down):
    return jnp.sum(jnp.sin(product(x, ids, weights, gate, up, down)))

  kernels = functools.partial(gmm_experts, interpret=True, row_tile=8)
  np.testing.assert_allclose(jax.jit(kernels)(x, ids, weights, gate, up, down),
                             _grouped_experts(x, ids, weights, gate, up, down), rtol=2e-5, atol=2e-5)
  got = jax.jit(jax.grad(lambda *a: loss(kernels, *a), argnums=(0, 1, 2, 3, 4)))(x, weights, gate, up, down)
  want = jax.grad(lambda *a: loss(_grouped_experts, *a), argnums=(0, 1, 2, 3, 4))(x, weights, gate, up, down)
  for i, (a, b) in enumerate(zip(got, want)):
    assert np.all(np.isfinite(a)), i
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=f"grad {i}")


def test_the_cache_form_runs_long_prompts_in_chunks(monkeypatch):
  """A prefill of more assignments than CACHE_PATH_ASSIGNMENTS runs in token chunks (the last one
  padded): the same outputs as one product."""
  from rft_jax.models import moe

  x, ids, weights, gate, up, down = experts(37, skewed=True)
  want = _grouped_experts(x, ids, weights, gate, up, down)
  monkeypatch.setattr(moe, "CACHE_PATH_ASSIGNMENTS", 16)  # 8 tokens a chunk at k = 2: 5 chunks
  jaxpr = str(jax.make_jaxpr(lambda *a: grouped_experts(*a, vmappable=True))(x, ids, weights, gate, up, down))
  assert "length=5" in jaxpr.replace(" ", "")
  got = jax.jit(lambda *a: grouped_experts(*a, vmappable=True))(x, ids, weights, gate, up, down)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("product", ["tiles", "gmm"])
@pytest.mark.parametrize("data, model", [(2, 4), (1, 8)])
def test_expert_parallel_products_equal_one_device(product, data, model):
  """On the fake 8-device mesh, each ``model`` device computing only its own experts' rows and a
  sum over ``model``: the one-device product's values and gradients (tokens, routing weights,
  the three stacked weights), for the tiles and megablox's kernels (interpret mode)."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from rft_jax.models.expert_gmm import gmm_experts
  from rft_jax.models.expert_parallel import expert_parallel
  from rft_jax.parallel import make_mesh

  mesh = make_mesh(data, model)
  fn = (functools.partial(tiled_experts, differentiable=True) if product == "tiles"
        else functools.partial(gmm_experts, interpret=True, row_tile=8))
  x, ids, weights, gate, up, down = experts(24, num_experts=8, k=2, skewed=True)

  def loss(parallel, x, weights, gate, up, down):
    y = (expert_parallel(fn, x, ids, weights, gate, up, down, mesh=mesh) if parallel
         else fn(x, ids, weights, gate, up, down))
    return jnp.sum(jnp.sin(y)), y

  placed = [jax.device_put(a, NamedSharding(mesh, P("model"))) for a in (gate, up, down)]
  (_, got), got_grads = jax.jit(jax.value_and_grad(lambda *a: loss(True, *a), argnums=(0, 1, 2, 3, 4),
                                                   has_aux=True))(x, weights, *placed)
  (_, want), want_grads = jax.value_and_grad(lambda *a: loss(False, *a), argnums=(0, 1, 2, 3, 4),
                                             has_aux=True)(x, weights, gate, up, down)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  for i, (a, b) in enumerate(zip(got_grads, want_grads)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=f"grad {i}")
