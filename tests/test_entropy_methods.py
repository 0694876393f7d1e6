"""Clip-Cov, KL-Cov and forking tokens inside the learner's step: the tokens are chosen over the
whole batch, dropped tokens leave the numerator only (as verl and TRL), and micro-batching changes
nothing. (The functions themselves are checked against verl and TRL in test_cov_methods.py and
test_forking_tokens.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rft_jax.rl.config import EntropyMethodConfig, LearnerConfig
from rft_jax.rl.token_methods.cov_methods import kl_cov_penalty_mask
from rft_jax.rl.token_methods.forking import forking_token_mask
from rft_jax.rl.learner import Learner
from test_learner import config, synthetic_batch, tiny_model


@pytest.fixture(scope="module")
def tiny():
  """A tiny random Qwen's weights (built once) and completions it sampled."""
  model = tiny_model()
  batch, _ = synthetic_batch(model)
  graphdef, state = nnx.split(model)
  return graphdef, jax.tree.map(np.asarray, state), batch


def learner_for(tiny, method: EntropyMethodConfig, micro: int = 16, **kw):
  graphdef, weights, _ = tiny
  return Learner(nnx.merge(graphdef, jax.tree.map(jnp.asarray, weights)),
                 config(micro_batch_size=micro, max_grad_norm=None, entropy_method=method,
                        forecast_every=0, **kw))


def step(tiny, learner: Learner, stats: bool = False):
  """One step of ``learner`` from the fixture's weights (a fresh copy: the step donates them);
  with ``stats``, the batch's token statistics before the step too."""
  graphdef, weights, batch = tiny
  state = learner.init(nnx.merge(graphdef, jax.tree.map(jnp.asarray, weights)))
  before = jax.jit(learner.batch_stats)(state.params, batch) if stats else None  # before the donation
  new_state, metrics = learner.step(state, batch)
  return before, new_state, metrics


def valid_and_advantages(batch):
  valid = np.asarray(batch.response_mask[:, 1:]) > 0
  return valid, np.asarray(batch.advantages)[:, None] * np.ones(valid.shape)


def test_forking_tokens_weight_the_numerator_over_the_whole_batch_in_any_micro_batching(tiny):
  method = EntropyMethodConfig(kind="forking", forking_rho=0.5)
  batch = tiny[2]
  stats, s16, m16 = step(tiny, learner_for(tiny, method, micro=16), stats=True)
  _, s4, m4 = step(tiny, learner_for(tiny, method, micro=4))
  valid, adv = valid_and_advantages(batch)
  kept = np.asarray(forking_token_mask(stats.entropy, jnp.asarray(valid), rho=0.5))
  assert 0.4 < kept.sum() / valid.sum() <= 0.6
  assert m16["method_frac"] == pytest.approx(1 - kept.sum() / valid.sum())
  # At ratio 1 the surrogate is -A per token: dropped tokens count 0 over the unchanged denominator.
  assert m16["loss"] == pytest.approx(-np.sum(adv * kept) / valid.sum(), rel=1e-5, abs=1e-7)
  for key in m16:
    assert m16[key] == pytest.approx(m4[key], rel=1e-4, abs=1e-6), key
  for a, b in zip(jax.tree.leaves(s16.params), jax.tree.leaves(s4.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=3e-5)


def test_clip_cov_drops_its_count_of_tokens_the_same_way_at_the_same_step(tiny):
  """The same step (same state, batch and step number) run twice draws the same tokens."""
  method = EntropyMethodConfig(kind="clip_cov", clip_cov_ratio=0.25, clip_cov_lb=-100.0, clip_cov_ub=100.0)
  learner = learner_for(tiny, method)  # one compiled step serves both runs
  _, state_a, first = step(tiny, learner)
  _, state_b, again = step(tiny, learner)
  valid, adv = valid_and_advantages(tiny[2])
  n = int(valid.sum())
  assert first["method_frac"] == max(int(0.25 * n), 1) / n  # every valid token is a candidate
  for key in first:
    assert first[key] == again[key], key  # the same step draws the same tokens
  assert abs(first["loss"]) < np.sum(np.abs(adv) * valid) / n  # some -A terms are gone
  for a, b in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params)):
    np.testing.assert_array_equal(a, b)


def test_kl_cov_penalises_its_top_tokens_and_its_first_on_policy_update_is_grpos(tiny):
  method = EntropyMethodConfig(kind="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=1.0)
  stats, kl_state, kl = step(tiny, learner_for(tiny, method), stats=True)
  _, grpo_state, grpo = step(tiny, learner_for(tiny, EntropyMethodConfig()))
  valid, adv = valid_and_advantages(tiny[2])
  penalised = np.asarray(kl_cov_penalty_mask(stats.logp, jnp.asarray(adv), jnp.asarray(valid), ratio=0.1))
  assert kl["method_frac"] == penalised.sum() / valid.sum() == max(int(0.1 * valid.sum()), 1) / valid.sum()
  # log p = log p_old on the first update: no penalty, and no gradient from |log p - log p_old|.
  assert kl["loss"] == pytest.approx(grpo["loss"], rel=1e-6)
  # Two programs: the same update to float32 rounding (2e-7 where a penalty would move it by
  # lr x coef).
  for a, b in zip(jax.tree.leaves(kl_state.params), jax.tree.leaves(grpo_state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_methods_that_have_no_dual_clip_refuse_one():
  with pytest.raises(ValueError, match="has no dual clip"):
    LearnerConfig(dual_clip=3.0, entropy_method=EntropyMethodConfig(kind="clip_cov"))
  with pytest.raises(ValueError, match="clip_cov_lb"):
    EntropyMethodConfig(kind="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0)
  with pytest.raises(ValueError, match="forking_rho"):
    EntropyMethodConfig(kind="forking", forking_rho=0.0)
