"""The KL term's reference policy: frozen starting parameters inside the learner's step.

The loss term is checked against TRL 1.16.0 (``GRPOTrainer._compute_loss``, transcribed below):
``per_token_kl = exp(ref - logp) - (ref - logp) - 1``, added as ``beta * per_token_kl`` and
aggregated like the policy term.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from rft_jax.parallel import make_mesh, shard_model
from rft_jax.rl.learner import Learner
from rft_jax.rl.losses import aggregate_loss, kl_penalty, loss_normaliser
from test_learner import config, synthetic_batch, tiny_model


def trl_kl_loss(per_token_logps, ref_per_token_logps, mask, beta, loss_type):
  """The KL part of TRL 1.16.0's GRPO loss (policy term left out), in torch."""
  per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
  per_token_loss = beta * per_token_kl
  if loss_type == "grpo":
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
  if loss_type == "bnpo":
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
  raise ValueError(loss_type)


@pytest.fixture(scope="module")
def tiny():
  """A tiny random Qwen (built once: construction is the slow part) and completions it sampled."""
  model = tiny_model(seed=4)
  batch, _ = synthetic_batch(model, seed=4)
  graphdef, state = nnx.split(model)
  return graphdef, jax.tree.map(np.asarray, state), batch


def fresh_model(tiny):
  """A new model with the fixture's weights (the learner takes over, and donates, its arrays)."""
  graphdef, state, _ = tiny
  return nnx.merge(graphdef, jax.tree.map(jnp.asarray, state))


def torch_tensor(x):
  return torch.from_numpy(np.array(x, np.float32))


@pytest.mark.parametrize("loss_agg,trl_loss_type", [("token-mean", "bnpo"), ("seq-mean-token-mean", "grpo")])
def test_kl_term_equals_trl_on_the_same_tensors(loss_agg, trl_loss_type):
  rng = np.random.default_rng(0)
  logp = rng.normal(-2.0, 1.0, (6, 9)).astype(np.float32)
  ref = (logp + rng.normal(0.0, 0.5, logp.shape)).astype(np.float32)
  mask = (np.arange(9)[None, :] < rng.integers(1, 10, (6, 1))).astype(np.float32)
  ours = 0.04 * aggregate_loss(kl_penalty(jnp.asarray(logp), jnp.asarray(ref), "k3"), jnp.asarray(mask),
                               loss_agg, loss_normaliser(jnp.asarray(mask)))
  want = trl_kl_loss(torch_tensor(logp), torch_tensor(ref), torch_tensor(mask), 0.04, trl_loss_type)
  assert float(ours) == pytest.approx(float(want), rel=1e-6)


def test_kl_starts_at_zero_grows_and_its_loss_term_matches_trl(tiny):
  """Reference = the starting parameters (given as a parameter tree, as a model loaded from
  ``model.ref_path`` would be): the first step's KL (pre-update parameters) is 0 and later steps
  move away from it. One micro-batch: each step's ratio is exactly 1, so its loss is
  -token-mean(A) + beta * token-mean(k3), and the KL part equals TRL's (``bnpo``) on the
  learner's and the reference's log-probs. The reference survives the donation of the policy."""
  beta, batch = 0.4, tiny[2]
  model = fresh_model(tiny)
  learner = Learner(model, config(kl_coef=beta, lr=3e-2, micro_batch_size=16, forecast_every=0),
                    reference=nnx.state(model, nnx.Param))
  state = learner.init(model)
  start = jax.tree.map(np.asarray, learner.reference)
  batch_logp = jax.jit(lambda params: learner.batch_stats(params, batch).logp)
  kls = []
  for _ in range(3):
    logp = batch_logp(state.params)  # the pre-update parameters of this step
    state, metrics = learner.step(state, batch)
    kls.append(metrics["kl"])
  assert kls[0] == pytest.approx(0.0, abs=1e-7)
  assert kls[2] > kls[1] > 1e-3, kls
  assert learner._train_step._cache_size() == 1  # the reference does not make steps recompile

  mask = np.asarray(batch.response_mask[:, 1:] * batch.attention_mask[:, 1:], np.float32)
  policy_term = -np.sum(np.asarray(batch.advantages)[:, None] * mask) / mask.sum()  # ratio 1
  ref_logp = batch_logp(learner.reference)
  want = float(trl_kl_loss(torch_tensor(logp), torch_tensor(ref_logp), torch_tensor(mask), beta, "bnpo"))
  assert metrics["loss"] - policy_term == pytest.approx(want, rel=1e-4)
  assert metrics["kl"] == pytest.approx(want / beta, rel=1e-4)
  for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(learner.reference), strict=True):
    np.testing.assert_array_equal(a, np.asarray(b))  # frozen, and never donated
  narrower = jax.tree.map(lambda x: x[..., :1], start)  # another architecture
  with pytest.raises(ValueError, match="reference parameter .* has shape"):
    learner.reference_params(narrower, like=state.params)


def test_reference_is_sharded_like_the_policy_and_an_argument_of_the_step(tiny):
  """On a 4 x 2 mesh with ref_dtype=bfloat16 the reference (the model given to init) has the
  policy parameters' shardings and half their bytes; abstract_reference describes it, and the
  step lowered for abstract inputs (what ``rft-jax plan`` compiles) takes it as a non-donated
  argument. Micro-batches of 4: the reference pass runs micro-batch by micro-batch."""
  mesh, batch = make_mesh(data=4, model=2), tiny[2]
  model = shard_model(fresh_model(tiny), mesh)
  learner = Learner(model, config(kl_coef=0.1, ref_dtype="bfloat16", micro_batch_size=4,
                                  forecast_every=0), mesh=mesh)
  state = learner.init(model)
  ref, params = jax.tree.leaves(learner.reference), jax.tree.leaves(state.params)
  assert all(r.dtype == jnp.bfloat16 and p.dtype == jnp.float32 and r.sharding == p.sharding
             for r, p in zip(ref, params, strict=True))
  assert any(not r.sharding.is_fully_replicated for r in ref)
  described = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), tree)
  assert described(learner.abstract_reference(state.params)) == described(learner.reference)
  state, metrics = learner.step(state, batch)
  assert 0.0 < metrics["kl"] < 1e-3  # bfloat16 rounding of the same weights
  state, _ = learner.step(state, batch)
  assert learner._train_step._cache_size() == 1

  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  abstract_state, abstract_batch = jax.tree.map(spec, (state, learner.place_batch(batch)))
  lowered = Learner(model, learner.config, mesh=mesh).lower_step(abstract_state, abstract_batch)
  ref_args = jax.tree.leaves(lowered.args_info[0][2])
  assert len(ref_args) == len(ref) and not any(a.donated for a in ref_args)
  assert all(a.dtype == jnp.bfloat16 for a in ref_args)
