"""Real sizes without memory: parameter counts of the presets and their shardings on 8 devices,
all through ``nnx.eval_shape`` / ``jax.eval_shape``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from rft_jax.models import QwenConfig, abstract_model
from rft_jax.parallel import make_mesh, state_shardings

# Published parameter counts (safetensors metadata of the Hugging Face repositories).
KNOWN = {"qwen2_5_0_5b": 494_032_768, "qwen2_5_1_5b": 1_543_714_304,
         "qwen2_5_7b": 7_615_616_512, "qwen3_4b": 4_022_468_096}


def formula(c: QwenConfig) -> int:
  """Parameters of a Qwen decoder from its config."""
  d, f, h = c.hidden_size, c.intermediate_size, c.head_dim
  q, kv = c.num_attention_heads * h, c.num_key_value_heads * h
  attn = d * q + 2 * d * kv + q * d
  if c.attention_bias:
    attn += q + 2 * kv
  if c.attention_out_bias:
    attn += d
  if c.qk_norm:
    attn += 2 * h
  layer = attn + 3 * d * f + 2 * d
  embed = c.vocab_size * d * (1 if c.tie_word_embeddings else 2)
  return c.num_hidden_layers * layer + embed + d


@pytest.mark.parametrize("preset", sorted(KNOWN))
def test_parameter_count(preset):
  config = getattr(QwenConfig, preset)(param_dtype=jnp.bfloat16)
  model = abstract_model(config)
  leaves = jax.tree.leaves(nnx.state(model))
  assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype == jnp.bfloat16 for x in leaves)
  count = sum(math.prod(x.shape) for x in leaves)
  assert count == formula(config) == KNOWN[preset]


# Qwen2.5-7B has 28 query heads: tensor parallelism of 8 cannot split them (nor could vLLM).
@pytest.mark.parametrize("preset,data,model", [
    (p, d, m) for p in ("qwen2_5_7b", "qwen3_4b") for d, m in ((4, 2), (8, 1), (2, 4))
] + [("qwen3_4b", 1, 8)])
def test_shardings_valid_on_8_devices(preset, data, model):
  config = getattr(QwenConfig, preset)(param_dtype=jnp.bfloat16)
  mesh = make_mesh(data=data, model=model)
  state = nnx.state(abstract_model(config))
  shardings = state_shardings(state, mesh)
  total = per_device = 0
  for (path, var), (_, sh) in zip(nnx.to_flat_state(state), nnx.to_flat_state(shardings)):
    x, s = var.get_value(), sh.get_value()
    assert isinstance(s, NamedSharding) and s.mesh == mesh
    shard = s.shard_shape(x.shape)  # raises unless every sharded dim divides
    total += math.prod(x.shape)
    per_device += math.prod(shard)
    if math.prod(x.shape) > 10_000_000:
      assert any(a is not None for a in s.spec), f"{path} {x.shape} left replicated"
  # Only the norms stay replicated: close to 1/8 of the parameters per device.
  assert per_device < total / 8 * 1.01, (per_device, total)


@pytest.mark.parametrize("preset", ["qwen2_5_7b", "qwen3_4b"])
def test_forward_and_cache_shapes_at_full_size(preset):
  config = getattr(QwenConfig, preset)(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  model = abstract_model(config)
  ids = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  logits = nnx.eval_shape(lambda m, x: m(x), model, ids)
  assert logits.shape == (2, 16, config.vocab_size) and logits.dtype == jnp.float32
  cache = jax.eval_shape(lambda: model.init_cache(2, 64))
  step, cache = nnx.eval_shape(lambda m, t, c: m.decode_step(t, c), model,
                               jax.ShapeDtypeStruct((2,), jnp.int32), cache)
  assert step.shape == (2, config.vocab_size)
  assert len(cache.k) == config.num_hidden_layers
  assert cache.k[0].shape == (2, config.num_key_value_heads, config.head_dim, 64)
  assert cache.v[-1].shape == (2, config.num_key_value_heads, 64, config.head_dim)
  assert cache.dtype == jnp.bfloat16
