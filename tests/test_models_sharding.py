"""Loading onto a fake 8-device CPU mesh: sharded parameters, the same logits; the rules table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from hf_fixtures import make_tiny_qwen
from rft_jax.models import load_hf
from rft_jax.parallel import (DEFAULT_RULES, FSDP_RULES, TP_RULES, logical_to_spec, make_mesh,
                              shard_model, state_shardings, tree_shardings)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  # heads=4, kv_heads=2, hidden=32, mlp=64, vocab=128: every sharded dim divides 2, 4 and 8
  # except kv_heads on 4 or 8 devices, which must fall back to replicated.
  return make_tiny_qwen(tmp_path_factory.mktemp("ckpt"), "qwen2", tie=False, kv_heads=2)


def _batch():
  mask = np.array([[0, 0, 1, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 0, 1], [0, 1, 1, 1, 1, 1]] * 2,
                  np.int32)
  return np.random.default_rng(0).integers(1, 128, mask.shape) * mask, mask


_forward = nnx.jit(lambda m, ids, mask: m(ids, mask))
_prefill = nnx.jit(lambda m, ids, mask, cache: m.prefill(ids, mask, cache))


def test_fake_devices():
  assert jax.device_count() == 8


@pytest.mark.parametrize("data,model,expected", [
    (4, 2, {"embed_tokens": P("model", "data"), "lm_head": P("data", "model"),
            "layers.attn.q_proj": P(None, "data", "model", None),
            "layers.attn.k_proj": P(None, "data", "model", None),
            "layers.attn.o_proj": P(None, "model", None, "data"),
            "layers.mlp.down_proj": P(None, "model", "data"),
            "layers.input_layernorm.scale": P(None, None)}),
    (8, 1, {"embed_tokens": P("data", None), "lm_head": P("data", None),
            "layers.attn.q_proj": P(None, "data", None, None),
            "layers.attn.k_proj": P(None, "data", None, None),
            "layers.mlp.up_proj": P(None, "data", None),
            "layers.mlp.down_proj": P(None, "data", None)}),
    (2, 4, {"layers.attn.k_proj": P(None, "data", None, None),  # kv_heads=2 on model=4
            "layers.attn.q_proj": P(None, "data", "model", None)}),
])
def test_load_onto_mesh_shards_parameters_and_keeps_logits(ckpt, data, model, expected):
  mesh = make_mesh(data=data, model=model)
  sharded = load_hf(ckpt, mesh=mesh)
  flat = {".".join(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(sharded))}
  for name, spec in expected.items():
    assert flat[name].sharding == NamedSharding(mesh, spec), name
  assert all(isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
             for x in flat.values())
  assert len(flat["embed_tokens"].addressable_shards) == 8
  assert flat["embed_tokens"].addressable_shards[0].data.shape == (
      128 // (model if model > 1 else data), 32 // (data if model > 1 else 1))

  ids, mask = (jnp.asarray(a) for a in _batch())
  single = load_hf(ckpt)
  ref = np.asarray(_forward(single, ids, mask))
  out = _forward(sharded, ids, mask)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)
  if (data, model) != (4, 2):
    return
  # The cache path on the mesh, with the cache sharded by its logical axes.
  cache = sharded.init_cache(ids.shape[0], 8)
  cache = jax.device_put(cache, tree_shardings(cache, cache.logical_axes(), mesh))
  logits, cache = _prefill(sharded, ids, mask, cache)
  np.testing.assert_allclose(np.asarray(logits), ref[:, -1], atol=1e-5, rtol=1e-5)


def test_shard_model_in_place(ckpt):
  model = load_hf(ckpt)
  mesh = make_mesh(data=4, model=2)
  before = np.asarray(model.layers.mlp.up_proj[...])
  shard_model(model, mesh)
  up = model.layers.mlp.up_proj[...]
  assert up.sharding.spec == P(None, "data", "model")
  np.testing.assert_array_equal(np.asarray(up), before)
  specs = state_shardings(nnx.state(model), mesh)
  assert specs["embed_tokens"].get_value().spec == P("model", "data")


def test_rules_divisibility_and_axis_reuse():
  mesh = make_mesh(data=4, model=2)
  assert logical_to_spec(("vocab", "embed"), (128, 32), mesh) == P("model", "data")
  # vocab not divisible by model=4: falls to the next rule (data=2), and embed then replicates.
  narrow = make_mesh(data=2, model=4)
  assert logical_to_spec(("vocab", "embed"), (6, 32), narrow) == P("data", None)
  assert logical_to_spec(("vocab", "embed"), (7, 6), mesh) == P(None, None)
  assert logical_to_spec(("embed", "mlp"), (32, 64), mesh, FSDP_RULES) == P("data", None)
  assert logical_to_spec(("embed", "mlp"), (32, 64), mesh, TP_RULES) == P(None, "model")
  assert logical_to_spec(("layers", "norm"), (2, 32), mesh) == P(None, None)
  two_axes = (("mlp", ("data", "model")),)
  assert logical_to_spec(("embed", "mlp"), (32, 64), mesh, two_axes) == P(None, ("data", "model"))
  with pytest.raises(ValueError, match=r"mesh axes \['tensor'\] not in the mesh"):
    logical_to_spec(("mlp",), (64,), mesh, (("mlp", "tensor"),))
  with pytest.raises(ValueError, match="do not match shape"):
    logical_to_spec(("mlp",), (64, 2), mesh)
  assert DEFAULT_RULES[: len(TP_RULES)] == tuple(TP_RULES)


def test_make_mesh():
  mesh = make_mesh(model=2)
  assert dict(mesh.shape) == {"data": 4, "model": 2}
  assert dict(make_mesh(data=2).shape) == {"data": 2, "model": 1}
  assert dict(make_mesh(data=1, model=2, devices=jax.devices()[:2]).shape) == {"data": 1,
                                                                              "model": 2}
  with pytest.raises(ValueError, match="data=4 x model=4 = 16 devices, but 8 are available"):
    make_mesh(data=4, model=4)
  with pytest.raises(ValueError, match="model=3 does not divide the 8 devices"):
    make_mesh(model=3)
  with pytest.raises(ValueError, match="3 were given"):
    make_mesh(data=2, model=1, devices=jax.devices()[:3])
