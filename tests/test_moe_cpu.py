"""The CPU expert product (rft_jax/models/moe_cpu.py) and the rule that picks it (issue 54)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax.models.moe import _grouped_experts, expert_product, grouped_experts
from rft_jax.models.moe_cpu import tile_rows, tiled_experts


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
  assert expert_product("cpu", differentiable=True) == "ragged"
  assert expert_product("gpu", differentiable=False) == "ragged"
  assert expert_product("tpu", differentiable=False) == "ragged"


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


def test_differentiated_form_keeps_the_ragged_product():
  """The learner's form is the ragged product on CPU too: its gradients are the ragged ones."""
  x, ids, weights, gate, up, down = experts(12)

  def loss(product, x, weights, gate, up, down):
    return jnp.sum(jnp.sin(product(x, ids, weights, gate, up, down)))

  plain = jax.grad(lambda *a: loss(grouped_experts, *a), argnums=(0, 1, 2, 3, 4))
  ragged = jax.grad(lambda *a: loss(_grouped_experts, *a), argnums=(0, 1, 2, 3, 4))
  for got, want in zip(plain(x, weights, gate, up, down), ragged(x, weights, gate, up, down)):
    np.testing.assert_array_equal(got, want)
