"""``learner.optim.moment_dtype``: AdamW's moments in the parameters' dtype (``auto``, the default)
or in float32 beside bfloat16 parameters (``float32``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rft_jax.models import Qwen, QwenConfig
from rft_jax.rl.config import LearnerConfig
from rft_jax.rl.learner import Learner
from rft_jax.rl.optimizer import OptimizerConfig, make_optimizer
from rft_jax.train.config import ConfigError, load_config

TINY = QwenConfig("qwen3", 256, 64, 128, 2, 4, 2, head_dim=16, dtype=jnp.bfloat16,
                  param_dtype=jnp.bfloat16)


def _moments(opt_state) -> list:
  """Adam's parameter-shaped state leaves (mu and nu), whatever chain holds them."""
  adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)]
  assert len(adam) == 1
  return jax.tree.leaves((adam[0].mu, adam[0].nu))


@pytest.mark.parametrize("moment_dtype,expected", [("auto", jnp.bfloat16), ("float32", jnp.float32)])
def test_the_learners_moments_take_the_configured_dtype(moment_dtype, expected):
  """A learner of a bfloat16-parameter model: its optimizer's moments (abstract) are bfloat16
  under ``auto`` (today's behaviour) and float32 under ``float32`` (``rft-jax plan``'s bytes of
  them: tests/test_plan.py)."""
  model = nnx.eval_shape(lambda: Qwen(TINY, rngs=nnx.Rngs(0)))
  learner = Learner(model, LearnerConfig(optim=OptimizerConfig(moment_dtype=moment_dtype),
                                         micro_batch_size=4, forecast_every=0))
  params = nnx.state(model, nnx.Param)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  moments = _moments(jax.eval_shape(learner.optimizer.init, params))
  assert len(moments) == 2 * len(jax.tree.leaves(params))
  assert {x.dtype for x in moments} == {jnp.dtype(expected)}


def test_one_float32_moment_update_of_bfloat16_parameters_is_the_float32_one_rounded():
  """bfloat16 parameters and gradients, float32 moments: one AdamW update (decay on, no
  clipping) gives the float32 reference's moments exactly (the gradients enter them in float32)
  and its parameters rounded to bfloat16 (optax adds the float32 update to the parameters in
  float32, then rounds)."""
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"w": jax.random.normal(keys[0], (64, 32)).astype(jnp.bfloat16),
            "b": jax.random.normal(keys[1], (32,)).astype(jnp.bfloat16)}
  grads = {"w": jax.random.normal(keys[2], (64, 32)).astype(jnp.bfloat16),
           "b": 1e-3 * jax.random.normal(keys[3], (32,)).astype(jnp.bfloat16)}
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  common = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=None)
  optimizer, _ = make_optimizer(OptimizerConfig(moment_dtype="float32", **common))
  reference, _ = make_optimizer(OptimizerConfig(**common))  # float32 parameters: float32 moments

  state = optimizer.init(params)
  updates, state = optimizer.update(grads, state, params)
  new = optax.apply_updates(params, updates)
  ref_state = reference.init(f32(params))
  ref_updates, ref_state = reference.update(f32(grads), ref_state, f32(params))
  ref_new = optax.apply_updates(f32(params), ref_updates)

  assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(jnp.bfloat16)}
  for got, want in zip(_moments(state), _moments(ref_state)):
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)
  for name in params:
    np.testing.assert_array_equal(np.asarray(new[name], np.float32),
                                  np.asarray(ref_new[name].astype(jnp.bfloat16), np.float32))
    # ... within bfloat16's rounding of the float32 result (8 significant bits).
    np.testing.assert_allclose(np.asarray(new[name], np.float32), ref_new[name], rtol=2 ** -8)
  assert not np.array_equal(np.asarray(new["w"], np.float32), np.asarray(params["w"], np.float32))


def test_a_bad_moment_dtype_is_one_line_naming_the_key():
  with pytest.raises(ValueError, match=r"^learner\.optim\.moment_dtype='bfloat16' is not one of "
                                       r"\['auto', 'float32'\]$"):
    LearnerConfig(optim={"moment_dtype": "bfloat16"})
  required = ["model.path=/m", "data.train_path=/d"]
  with pytest.raises(ConfigError) as raised:
    load_config(None, required + ["critic.optim.moment_dtype=fp32"])
  assert "critic.optim.moment_dtype='fp32'" in str(raised.value) and "\n" not in str(raised.value)
  cfg = load_config(None, required + ["learner.optim.moment_dtype=float32"])
  assert (cfg.learner.optim.moment_dtype, cfg.critic.optim.moment_dtype) == ("float32", "auto")


def test_a_learner_step_keeps_float32_moments_beside_bfloat16_parameters():
  """One compiled learner step (state donated, the non-finite guard's selects) with bfloat16
  parameters and ``moment_dtype=float32``: the parameters move and stay bfloat16, the moments
  come back float32 and not zero."""
  from rft_jax.rl.learner import LearnerBatch

  model = Qwen(TINY, rngs=nnx.Rngs(0))
  learner = Learner(model, LearnerConfig(optim=OptimizerConfig(lr=1e-2, moment_dtype="float32"),
                                         micro_batch_size=4, forecast_every=0))
  state = learner.init(model)
  before = [np.asarray(x, np.float32) for x in jax.tree.leaves(state.params)]
  ids = jax.random.randint(jax.random.key(1), (4, 12), 1, TINY.vocab_size)
  response = jnp.concatenate([jnp.zeros((4, 4)), jnp.ones((4, 8))], axis=1)
  batch = LearnerBatch(input_ids=ids, attention_mask=jnp.ones_like(ids), response_mask=response,
                       advantages=jnp.array([1.0, -1.0, 0.5, -0.5]), sampler_logp=-response)
  state, metrics = learner.step(state, batch)
  assert metrics["nonfinite_skipped"] == 0.0 and int(state.step) == 1
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
  moments = _moments(state.opt_state)
  assert {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
  assert any(np.any(np.asarray(m) != 0) for m in moments)
  after = [np.asarray(x, np.float32) for x in jax.tree.leaves(state.params)]
  assert any(not np.array_equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("moment_dtype,expected", [("auto", jnp.bfloat16), ("float32", jnp.float32)])
def test_micro_batch_gradients_are_summed_in_the_optimizers_dtype(moment_dtype, expected):
  """bfloat16 parameters: the micro-batches' gradients are summed in bfloat16 under ``auto`` and
  in float32 under ``moment_dtype: float32`` (the optimizer's arithmetic), where 256 bfloat16
  gradients of 1/3 sum to 85.3 (a bfloat16 running sum stalls far below: its spacing passes 1/3
  at 64)."""
  model = nnx.eval_shape(lambda: Qwen(TINY, rngs=nnx.Rngs(0)))
  learner = Learner(model, LearnerConfig(optim=OptimizerConfig(moment_dtype=moment_dtype),
                                         micro_batch_size=1, forecast_every=0))
  params = nnx.state(model, nnx.Param)
  zeros = jax.eval_shape(learner.zero_grads, params)
  assert {x.dtype for x in jax.tree.leaves(zeros)} == {jnp.dtype(expected)}
  third = {"w": jnp.full((4,), 1 / 3, jnp.bfloat16)}
  total = jax.lax.fori_loop(0, 256, lambda _, acc: learner.add_grads(acc, third),
                            {"w": jnp.zeros((4,), expected)})
  assert total["w"].dtype == expected
  err = abs(float(total["w"][0]) - 256 * float(third["w"][0]))
  assert (err < 1e-3) == (expected == jnp.float32), err
