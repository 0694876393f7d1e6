"""PPO's critic on a tiny random Qwen: the copied decoder, value alignment, the clipped value loss
step (exactness, accumulation, clipping, learning, sharding, the non-finite guard)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rft_jax.models import Qwen
from rft_jax.parallel import make_mesh, shard_model
from rft_jax.rl.advantages.critic import Critic, CriticConfig, ValueModel
from rft_jax.rl.advantages.gae import clipped_value_loss, gae_advantages, outcome_token_rewards
from rft_jax.rl.losses import aggregate_loss, loss_normaliser
from test_learner import nested_optim, tiny_model

B, PROMPT, COMPLETION = 16, 4, 8
HUGE, TINY = 1e6, 1e-4  # value clip ranges: never / almost always active


@pytest.fixture(scope="module")
def rollouts():
  """Random tokens: prompts of 2-4 tokens left-padded to 4, completions of 3-8 right-padded to 8;
  ``(input_ids, attention_mask, response_mask [B, L-1] shifted, rewards [B])``."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(3), 4)
  ids = jax.random.randint(k1, (B, PROMPT + COMPLETION), 1, 64)
  columns = jnp.arange(PROMPT + COMPLETION)[None, :]
  prompt_start = PROMPT - jax.random.randint(k2, (B, 1), 2, PROMPT + 1)
  completion_end = PROMPT + jax.random.randint(k3, (B, 1), 3, COMPLETION + 1)
  attn = ((columns >= prompt_start) & (columns < completion_end)).astype(jnp.int32)
  response = ((columns >= PROMPT) & (columns < completion_end)).astype(jnp.float32)
  return jnp.where(attn > 0, ids, 0), attn, response[:, 1:], jax.random.normal(k4, (B,))


_critics = {}


@functools.cache
def _policy():
  return tiny_model()  # never donated: from_policy copies it


def make_critic(mesh=None, head_stddev=0.3, **kw):
  """A critic (one per config and mesh: compiled once for the module) and a fresh state."""
  config = {"lr": 3e-3, "micro_batch_size": 4, "cliprange_value": HUGE, **kw}
  value_model = ValueModel.from_policy(_policy(), nnx.Rngs(1), head_stddev=head_stddev)
  if mesh is not None:
    value_model = shard_model(value_model, mesh)
  key = (None if mesh is None else tuple(mesh.shape.items()), tuple(sorted(config.items())))
  if key not in _critics:
    _critics[key] = Critic(value_model, CriticConfig(**nested_optim(dict(config), CriticConfig().optim)), mesh=mesh)
  return _critics[key], _critics[key].init(value_model)


@jax.jit
def gae_returns(values, response, rewards):
  _, returns = gae_advantages(outcome_token_rewards(rewards, response), values, response, whiten=False)
  return returns


@nnx.jit
def hidden_states(model, ids, attn):
  return model(ids, attn, return_hidden=True)


def test_from_policy_copies_the_decoder_and_shares_nothing(rollouts):
  ids, attn, _, _ = rollouts
  policy = tiny_model()
  value_model = ValueModel.from_policy(policy, nnx.Rngs(0))
  hidden = hidden_states(policy, ids, attn)
  np.testing.assert_array_equal(hidden_states(value_model.backbone, ids, attn), hidden)
  head = value_model.value_head
  assert not np.any(np.asarray(head["kernel"][...])) and not np.any(np.asarray(head["bias"][...]))
  for a, b in zip(jax.tree.leaves(nnx.state(policy)), jax.tree.leaves(nnx.state(value_model.backbone))):
    assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
  value_model.backbone.embed_tokens[...] = jnp.zeros_like(value_model.backbone.embed_tokens[...])
  np.testing.assert_array_equal(hidden_states(policy, ids, attn), hidden)
  assert np.any(np.asarray(hidden_states(value_model.backbone, ids, attn)) != np.asarray(hidden))
  untied = Qwen(tiny_model().config.replace(tie_word_embeddings=False), rngs=nnx.Rngs(0))
  assert not hasattr(ValueModel.from_policy(untied, nnx.Rngs(0)).backbone, "lm_head")
  assert hasattr(untied, "lm_head")  # the policy keeps its own


def test_values_pair_position_t_with_token_t_plus_1_and_ignore_padding(rollouts):
  ids, attn, _, _ = rollouts
  critic, state = make_critic()
  values = np.asarray(critic.values(state, ids, attn))
  model = critic.model(state)
  hidden = model.backbone(ids, attn, return_hidden=True)
  head = model.value_head
  manual = hidden @ head["kernel"][...] + head["bias"][...]
  assert values.shape == (B, ids.shape[1] - 1)
  np.testing.assert_allclose(values, manual[:, :-1, 0], rtol=1e-5, atol=1e-6)
  assert np.std(values) > 0.1
  # Left-pad every other row by 3 more tokens (junk ids under a 0 mask): the real positions' values hold.
  pad = 3
  junk = jax.random.randint(jax.random.key(0), (B, pad), 1, 64)
  padded = jnp.where(jnp.arange(B)[:, None] % 2 == 0, junk, 0)
  ids2 = jnp.concatenate([padded, ids], axis=1)
  attn2 = jnp.concatenate([jnp.zeros((B, pad), attn.dtype), attn], axis=1)
  shifted = np.asarray(critic.values(state, ids2, attn2))[:, pad:]
  real = np.asarray(attn[:, :-1]) > 0  # V(s_t) is defined where token t is real
  np.testing.assert_allclose(shifted[real], values[real], rtol=1e-4, atol=1e-5)
  assert real.sum() < real.size  # the batch has padding of its own


def test_first_step_loss_and_clip_fraction_are_the_clipped_value_loss(rollouts):
  ids, attn, response, rewards = rollouts
  critic, state = make_critic(cliprange_value=TINY)
  values = critic.values(state, ids, attn)
  returns = gae_returns(values, response, rewards)
  old = values + 0.1 * jax.random.normal(jax.random.key(2), values.shape)  # stale: some clipped
  terms = clipped_value_loss(values, old, returns, response, clip_range=TINY)
  expected = aggregate_loss(terms.loss, response, "token-mean", loss_normaliser(response))
  _, metrics = critic.step(state, ids, attn, response, returns, old)
  assert metrics["value_loss"] == pytest.approx(float(expected), rel=1e-5)
  clipfrac = float(jnp.sum(terms.clipped) / jnp.sum(response))
  assert 0 < clipfrac < 1 and metrics["value_clipfrac"] == pytest.approx(clipfrac)
  valid = np.asarray(response) > 0
  assert metrics["value_mean"] == pytest.approx(float(np.asarray(values)[valid].mean()), rel=1e-5)
  r, o = np.asarray(returns)[valid], np.asarray(old)[valid]
  assert metrics["explained_variance"] == pytest.approx(1 - np.var(r - o, ddof=1) / (np.var(r, ddof=1) + 1e-5), rel=1e-4)
  assert metrics["critic_nonfinite_skipped"] == 0.0


def test_training_lowers_the_value_loss(rollouts):
  """PPO's loop on a fixed batch: old values re-read before each step, returns fixed."""
  ids, attn, response, rewards = rollouts
  critic, state = make_critic()
  returns = gae_returns(critic.values(state, ids, attn), response, rewards)
  losses, explained = [], []
  for _ in range(8):
    old = critic.values(state, ids, attn)
    state, metrics = critic.step(state, ids, attn, response, returns, old)
    losses.append(metrics["value_loss"])
    explained.append(metrics["explained_variance"])
  assert int(state.step) == 8
  assert losses[-1] < 0.3 * losses[0], losses
  assert explained[-1] > explained[0] + 0.3, explained


def test_micro_batch_accumulation_is_exact(rollouts):
  """One micro-batch of 16 or four of 4: the same update and metrics (to float32 rounding)."""
  ids, attn, response, rewards = rollouts
  results, values = [], None
  for micro in (4, B):
    # Adam's first step moves a parameter by lr x g / (|g| + eps): a gradient that cancels to
    # about eps (rounding noise, whatever the micro-batching) would move by a rounding-dependent
    # fraction of lr; adam_eps=1e-6 keeps those moves near zero in both runs.
    critic, state = make_critic(micro_batch_size=micro, adam_eps=1e-6)
    start = jax.tree.map(np.asarray, state.params)
    values = critic.values(state, ids, attn) if values is None else values  # same parameters
    results.append(critic.step(state, ids, attn, response, gae_returns(values, response, rewards), values))
  (s1, m1), (s2, m2) = results
  for key in m1:
    assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
  for a, b, c in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params), jax.tree.leaves(start)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(np.asarray(a) - c)) > 1e-4  # every parameter moved


@pytest.mark.parametrize("clip,clipped", [(HUGE, False), (TINY, True)])
def test_clip_fraction_after_a_step_with_stale_old_values(rollouts, clip, clipped):
  ids, attn, response, rewards = rollouts
  critic, state = make_critic(cliprange_value=clip)
  old = critic.values(state, ids, attn)
  returns = gae_returns(old, response, rewards)
  state, first = critic.step(state, ids, attn, response, returns, old)
  assert first["value_clipfrac"] == 0.0  # the values are still the old ones
  _, second = critic.step(state, ids, attn, response, returns, old)
  assert (second["value_clipfrac"] > 0) == clipped


def test_non_finite_step_is_skipped_and_padding_is_not_read(rollouts):
  """A NaN return on a response token skips the step (state unchanged); NaNs on padding do not."""
  ids, attn, response, rewards = rollouts
  critic, state = make_critic()
  before = jax.tree.map(np.asarray, state.params)
  old = critic.values(state, ids, attn)
  returns = gae_returns(old, response, rewards)
  first_response = (0, int(np.argmax(np.asarray(response[0]))))
  state, metrics = critic.step(state, ids, attn, response, returns.at[first_response].set(jnp.nan), old)
  assert metrics["critic_nonfinite_skipped"] == 1.0 and int(state.step) == 0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params), strict=True):
    np.testing.assert_array_equal(a, b)
  nan_padding = jnp.where(response > 0, returns, jnp.nan)
  state, metrics = critic.step(state, ids, attn, response, nan_padding, jnp.where(response > 0, old, jnp.inf))
  assert metrics["critic_nonfinite_skipped"] == 0.0 and int(state.step) == 1
  assert np.isfinite(metrics["value_loss"]) and np.isfinite(metrics["explained_variance"])


def test_sharded_step_equals_single_device(rollouts):
  ids, attn, response, rewards = rollouts
  critic, state = make_critic(cliprange_value=TINY)
  values = critic.values(state, ids, attn)
  returns = gae_returns(values, response, rewards)
  old = values + 0.1 * jax.random.normal(jax.random.key(2), values.shape)
  s1, m1 = critic.step(state, ids, attn, response, returns, old)
  mesh = make_mesh(data=4, model=2)
  sharded, state = make_critic(mesh=mesh, cliprange_value=TINY)
  assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.params))
  assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.opt_state))
  layout = [x.sharding for x in jax.tree.leaves(state.params)]
  np.testing.assert_allclose(np.asarray(sharded.values(state, ids, attn)), values, rtol=1e-4, atol=1e-5)
  s2, m2 = sharded.step(state, ids, attn, response, returns, old)
  assert [x.sharding for x in jax.tree.leaves(s2.params)] == layout
  for key in m1:
    assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_allclose(a, np.asarray(b), rtol=1e-4, atol=2e-5)  # Adam: |g| ~ eps
  policy = shard_model(tiny_model(), mesh)  # a sharded policy's copy keeps its layout
  copy = ValueModel.from_policy(policy, nnx.Rngs(0)).backbone
  assert ([x.sharding for x in jax.tree.leaves(nnx.state(copy))]
          == [x.sharding for x in jax.tree.leaves(nnx.state(policy))])
  abstract = sharded.abstract_state(s2.params)
  assert ([(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(abstract)]
          == [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(s2)])


@pytest.mark.parametrize("key,value,message", [
    ("loss_agg", "token_mean", r"critic.loss_agg='token_mean' is not one of"),
    ("lr", float("nan"), r"critic.optim.lr must be a finite number"),
    ("cliprange_value", 0.0, r"critic.cliprange_value must be > 0"),
    ("b2", 1.0, r"critic.optim.b2 must be in \[0, 1\), got 1.0"),
])
def test_config_rejects_bad_values(key, value, message):
  with pytest.raises(ValueError, match=message):
    CriticConfig(**nested_optim({key: value}))


def test_batch_that_does_not_split_into_micro_batches_is_named(rollouts):
  ids, attn, _, _ = rollouts
  critic, state = make_critic(micro_batch_size=5)
  with pytest.raises(ValueError, match="critic.micro_batch_size=5"):
    critic.values(state, ids, attn)
