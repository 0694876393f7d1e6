"""The GRPO train step on a tiny random Qwen: exactness, masks, sharding, learning."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rft_jax.models import Qwen, QwenConfig
from rft_jax.parallel import make_mesh, shard_model
from rft_jax.entropy import batch_entropy_change
from rft_jax.rl.batching import first_response_column
from rft_jax.rl.config import EntropyMaskConfig, LearnerConfig
from rft_jax.rl.learner import Learner, LearnerBatch
from rft_jax.rl.optimizer import OptimizerConfig

VOCAB, PROMPT, COMPLETION = 64, 4, 8


def tiny_model(seed=0):
  config = QwenConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, tie_word_embeddings=True)
  return Qwen(config, rngs=nnx.Rngs(seed))


@nnx.jit
def next_token_logits(model, ids):
  return model(ids)


def synthetic_batch(model, b=16, seed=0):
  """Completions sampled from the model itself (a full causal forward per token over
  the fixed-width sequence), rewarded by the fraction of even tokens; GRPO advantages
  over groups of 4."""
  key = jax.random.key(seed)
  prompts = jax.random.randint(key, (b // 4, PROMPT), 1, VOCAB).repeat(4, axis=0)
  ids = jnp.concatenate([prompts, jnp.zeros((b, COMPLETION), prompts.dtype)], axis=1)
  logps = []
  for t in range(PROMPT, PROMPT + COMPLETION):
    logits = next_token_logits(model, ids)[:, t - 1]
    key, sub = jax.random.split(key)
    tok = jax.random.categorical(sub, logits)
    logps.append(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], -1)[:, 0])
    ids = ids.at[:, t].set(tok)
  completion = ids[:, PROMPT:]
  reward = jnp.mean((completion % 2 == 0).astype(jnp.float32), axis=1)
  groups = reward.reshape(-1, 4)
  adv = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
  response = jnp.concatenate([jnp.zeros((b, PROMPT)), jnp.ones((b, COMPLETION))], axis=1)
  sampler_logp = jnp.concatenate([jnp.zeros((b, PROMPT)), jnp.stack(logps, 1)], axis=1)
  return LearnerBatch(input_ids=ids, attention_mask=jnp.ones_like(ids), response_mask=response,
                      advantages=adv, sampler_logp=sampler_logp), reward


def nested_optim(kw: dict, default: OptimizerConfig | None = None) -> dict:
  """``kw`` with its optimizer fields (``lr``, ``adam_eps``, ...) moved into ``optim``, over
  ``default`` (an :class:`OptimizerConfig`; its defaults by default)."""
  optim = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(OptimizerConfig)}}
  return {**kw, "optim": dataclasses.replace(default or OptimizerConfig(), **optim)} if optim else kw


def config(**kw):
  base = dict(lr=3e-3, micro_batch_size=4, max_grad_norm=1.0, forecast_every=1)
  base.update(kw)
  return LearnerConfig(**nested_optim(base))


def test_on_policy_first_step_ratio_is_exactly_one():
  model = tiny_model()
  batch, _ = synthetic_batch(model)
  learner = Learner(model, config(eps_low=1e-7, eps_high=1e-7))
  state = learner.init(model)
  _, metrics = learner.step(state, batch)
  assert metrics["ratio_dev_max"] == 0.0
  assert metrics["clip_frac_low"] == 0.0 and metrics["clip_frac_high"] == 0.0
  assert metrics["logp_mismatch"] < 1e-4  # the sampler's log-probs are the learner's
  assert metrics["logp_mismatch"] <= metrics["logp_mismatch_max"] < 1e-3
  assert metrics["mask_frac"] == 0.0
  assert metrics["nonfinite_skipped"] == 0.0


def test_later_mini_batches_use_pre_update_log_probs():
  model = tiny_model()
  batch, _ = synthetic_batch(model)
  learner = Learner(model, config(mini_batches=2, ppo_epochs=2))
  state = learner.init(model)
  state, metrics = learner.step(state, batch)
  assert metrics["ratio_dev_max"] > 0  # later updates see a moved policy
  assert int(state.step) == 1


def test_one_step_moves_likelihood_with_the_advantage():
  """The policy-gradient sign: after one step, completions with A > 0 became likelier relative
  to those with A < 0 (per-sequence log-likelihood change correlates with A)."""
  model = tiny_model()
  batch, _ = synthetic_batch(model, b=16, seed=2)
  learner = Learner(model, config(lr=1e-3, forecast_every=0))
  state = learner.init(tiny_model())
  response = np.asarray(batch.response_mask[:, 1:] * batch.attention_mask[:, 1:])

  def sequence_logp(state):
    return (np.asarray(learner.batch_stats(state.params, batch).logp) * response).sum(1)

  before = sequence_logp(state)
  state, _ = learner.step(state, batch)
  change, adv = sequence_logp(state) - before, np.asarray(batch.advantages)
  assert np.corrcoef(change, adv)[0, 1] > 0.8
  assert change[adv > 0].mean() > 0 > change[adv < 0].mean()


@pytest.mark.parametrize("mask", ["none", "clip_b"])
def test_gradient_accumulation_is_exact(mask):
  """One micro-batch of 16 (one forward pass: statistics, mask and gradient) or four of 4
  (a pre-update pass, then accumulated gradients): the same update and the same metrics."""
  model = tiny_model()
  batch, _ = synthetic_batch(model)
  results = []
  for micro in (16, 4):
    model = tiny_model()
    learner = Learner(model, config(micro_batch_size=micro, max_grad_norm=None,
                                    entropy_mask=EntropyMaskConfig(kind=mask, mu_low=0.5)))
    assert learner.is_single_pass(16) == (micro == 16)
    state, metrics = learner.step(learner.init(model), batch)
    results.append((state.params, metrics))
  (p1, m1), (p2, m2) = results
  assert (m1["mask_frac"] > 0) == (mask == "clip_b")
  for key in m1:
    assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    # Adam divides by |g|: where a gradient is ~eps, summation order shows at ~1e-5 (lr 3e-3).
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=3e-5)


def test_training_lowers_the_loss_and_clip_b_slows_entropy_collapse():
  """A few steps on a fixed batch: the surrogate loss against the sampling policy,
  -mean_t(A_t * pi/pi_sampler), falls; Clip_B on negative samples masks some tokens and
  the entropy falls less than without it (same seed, same data)."""
  model = tiny_model(seed=1)
  batch, _ = synthetic_batch(model, b=32, seed=1)
  drops = {}
  for kind in ("none", "clip_b"):
    model = tiny_model(seed=1)
    learner = Learner(model, config(micro_batch_size=8, lr=1e-2, mini_batches=1,
                                    entropy_mask=EntropyMaskConfig(kind=kind, mu_low=1.0)))
    state = learner.init(model)
    losses, masked = [], []
    start = learner.mean_entropy(state, batch)
    response = batch.response_mask[:, 1:]
    surrogate = jax.jit(lambda params: -jnp.sum(
        batch.advantages[:, None] * jnp.exp(learner.batch_stats(params, batch).logp - batch.sampler_logp[:, 1:])
        * response) / jnp.sum(response))
    for _ in range(6):
      losses.append(float(surrogate(state.params)))
      state, metrics = learner.step(state, batch)
      masked.append(metrics["mask_frac_negative"])
    losses.append(float(surrogate(state.params)))
    assert learner._train_step._cache_size() == 1  # six steps, one compiled program
    drops[kind] = start - learner.mean_entropy(state, batch)
    assert losses[-1] < losses[0]
    if kind == "clip_b":
      assert max(masked) > 0 and metrics["mask_frac_positive"] == 0.0
  assert drops["none"] > 0
  print("entropy drop over 6 steps:", drops)
  assert drops["clip_b"] < drops["none"], drops


def test_forecast_and_measured_entropy_change_are_reported():
  model = tiny_model()
  batch, _ = synthetic_batch(model)
  learner = Learner(model, config(lr=1e-4))
  _, metrics = learner.step(learner.init(model), batch)
  for key in ("entropy_change_forecast", "entropy_change_measured", "entropy", "s_star_mean",
              "s_centered_mean", "lr", "grad_norm", "mask_frac_positive", "mask_frac_negative"):
    assert np.isfinite(metrics[key]), key
  assert metrics["lr"] == pytest.approx(1e-4)


def test_the_first_order_forecast_is_the_jvp_of_the_entropy_along_the_update():
  """``entropy_change_first_order`` is the derivative of the mean entropy along the update the
  step applied: along a direction scaled by t it is linear in t, and the measured change differs
  from it by a term quadratic in t (ten times smaller a step, a hundred times smaller a gap)."""
  model = tiny_model()
  batch, _ = synthetic_batch(model)
  learner = Learner(model, config(lr=1e-2, max_grad_norm=None))
  params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(params))))
  direction = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), params)
  entropy = learner._mean_entropy_fn(params, batch)
  first, gap = {}, {}
  for t in (1e-2, 1e-3):
    moved, first[t] = learner._entropy_change(params, jax.tree.map(lambda p, d: p + t * d, params, direction), batch, 0)
    gap[t] = float(moved - entropy) - float(first[t])
  assert float(first[1e-2]) == pytest.approx(10 * float(first[1e-3]), rel=1e-4)
  assert abs(gap[1e-3]) < 0.3 * abs(float(first[1e-3]))
  assert gap[1e-3] == pytest.approx(gap[1e-2] / 100, rel=0.3), gap
  # In a step: the same quantity along the parameters' actual change.
  state = learner.init(model)
  before = jax.tree.map(jnp.copy, state.params)
  new_state, metrics = learner.step(state, batch)
  _, expected = learner._entropy_change(before, new_state.params, batch, 0)
  assert metrics["entropy_change_first_order"] == pytest.approx(float(expected), rel=1e-5)
  assert np.isfinite(metrics["entropy_change_measured"])


@pytest.mark.parametrize("micro", [4, 16])  # 16: the single-pass step
def test_sharded_step_equals_single_device(micro):
  model = tiny_model()
  batch, _ = synthetic_batch(model)
  single = Learner(model, config(micro_batch_size=micro))
  s1, m1 = single.step(single.init(model), batch)  # donates model's arrays
  mesh = make_mesh(data=4, model=2)
  sharded_model = shard_model(tiny_model(), mesh)
  learner = Learner(sharded_model, config(micro_batch_size=micro), mesh=mesh)
  state = learner.init(sharded_model)
  assert any(len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
             for x in jax.tree.leaves(state.params))
  layout = [x.sharding for x in jax.tree.leaves(state.params)]
  s2, m2 = learner.step(state, batch)
  assert [x.sharding for x in jax.tree.leaves(s2.params)] == layout  # explicit out_shardings
  for k in ("loss", "grad_norm", "entropy", "entropy_change_forecast"):
    assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-7), k
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_allclose(a, np.asarray(b), rtol=1e-4, atol=1e-6)


def test_bad_batch_and_config_are_named():
  model = tiny_model()
  batch, _ = synthetic_batch(model)
  with pytest.raises(ValueError, match="micro_batch_size=5"):
    learner = Learner(model, config(micro_batch_size=5))
    learner.step(learner.init(model), batch)
  with pytest.raises(ValueError, match="learner.loss_agg='token_mean'"):
    config(loss_agg="token_mean")
  with pytest.raises(ValueError, match="entropy_mask.kind='clipb'"):
    EntropyMaskConfig(kind="clipb")
  with pytest.raises(ValueError, match="entropy_mask.logp_source='rollout'"):
    EntropyMaskConfig(logp_source="rollout")


@pytest.mark.parametrize("key,value,message", [
    ("lr", 1e39, r"learner.optim.lr must be a finite number in \(0, 1\], got 1e\+39"),
    ("lr", float("nan"), r"learner.optim.lr must be a finite number in \(0, 1\], got nan"),
    ("lr", 0.0, r"learner.optim.lr must be a finite number in \(0, 1\], got 0.0"),
    ("lr", 2.0, r"learner.optim.lr must be a finite number in \(0, 1\], got 2.0"),
    ("kl_coef", float("inf"), r"learner.kl_coef must be a finite number, got inf"),
    ("adam_eps", float("nan"), r"learner.optim.adam_eps must be a finite number, got nan"),
    ("b1", 1.5, r"learner.optim.b1 must be in \[0, 1\), got 1.5"),  # was accepted: critic's check only
    ("ref_dtype", "float16", r"learner.ref_dtype='float16' is not one of"),
])
def test_config_rejects_non_finite_and_absurd_values(key, value, message):
  with pytest.raises(ValueError, match=message):
    config(**{key: value})


def test_entropy_mask_config_rejects_non_finite_values():
  with pytest.raises(ValueError, match=r"entropy_mask.mu_high must be a finite number, got inf"):
    EntropyMaskConfig(mu_high=float("inf"))
  with pytest.raises(ValueError, match=r"entropy_mask.max_frac must be in \[0, 1\], got 2.0"):
    EntropyMaskConfig(max_frac=2.0)


@pytest.fixture(scope="module")
def tiny():
  """``tiny_model()`` (built once: construction is the slow part) and completions it sampled."""
  model = tiny_model()
  graphdef, state = nnx.split(model)
  return graphdef, jax.tree.map(np.asarray, state), synthetic_batch(model)[0]


def fresh_model(tiny):
  """A new model with the fixture's weights (a learner takes over, and donates, its arrays)."""
  return nnx.merge(tiny[0], jax.tree.map(jnp.asarray, tiny[1]))


def assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # NaN where NaN was


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # lr = 1e39 as a float32 constant
@pytest.mark.parametrize("fault,micro", [("lr", 4), ("nan_weight", 16)])  # 16: the single-pass step
def test_non_finite_step_is_skipped(tiny, fault, micro):
  """lr = 1e39 (bypassing the config's check) sends every parameter to inf in one update; a NaN
  in a weight makes the loss NaN. Either way the step returns its input state, parameters,
  optimizer state and step counter, and says so; the next step sees the same state."""
  model, batch = fresh_model(tiny), tiny[2]
  cfg = config(micro_batch_size=micro, forecast_every=0)
  if fault == "lr":
    object.__setattr__(cfg.optim, "lr", 1e39)
  else:
    weight = model.layers.mlp.up_proj  # [layers, hidden, intermediate]
    weight[...] = weight[...].at[0, 3, 5].set(jnp.nan)
  learner = Learner(model, cfg)
  state = learner.init(model)
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))
  for _ in range(2):
    state, metrics = learner.step(state, batch)
    assert metrics["nonfinite_skipped"] == 1.0
    assert int(state.step) == 0
    assert_trees_equal(before, (state.params, state.opt_state))


def test_clip_b_from_sampler_log_probs_in_the_step(tiny):
  """entropy_mask.logp_source=sampler in the (single-pass) step: the tokens masked are those of
  the authors' Clip_B (transcribed in test_fidelity_trinity) on the sampler's log-probs and the
  learner's entropy; the sampler's log-probs here differ from the learner's by noise."""
  import torch
  from test_fidelity_trinity import trinity_clip_b_keep

  model, batch = fresh_model(tiny), tiny[2]
  noise = 0.5 * jax.random.normal(jax.random.key(1), batch.sampler_logp.shape)
  batch = batch.replace(sampler_logp=jnp.minimum(batch.sampler_logp + noise * batch.response_mask, 0.0))
  learner = Learner(model, config(micro_batch_size=16, forecast_every=0, entropy_mask=EntropyMaskConfig(
      kind="clip_b", mu_low=0.3, logp_source="sampler")))
  state = learner.init(model)
  stats = jax.jit(learner.batch_stats)(state.params, batch)
  _, metrics = learner.step(state, batch)
  mask = np.asarray(batch.response_mask[:, 1:] * batch.attention_mask[:, 1:], np.float32)
  adv = np.asarray(batch.advantages)[:, None] * mask
  t = lambda x: torch.from_numpy(np.array(x, np.float32))
  kept = trinity_clip_b_keep(t(batch.sampler_logp[:, 1:]), t(stats.entropy), t(mask), t(adv), mu=0.3).numpy()
  assert 0 < metrics["mask_frac"] == pytest.approx(1.0 - kept.sum() / mask.sum(), abs=1e-7)


def test_entropy_bonus_raises_entropy():
  """With zero advantages only the bonus -coef * H drives the update: entropy rises."""
  model = tiny_model(seed=2)
  batch, _ = synthetic_batch(model, seed=2)
  batch = batch.replace(advantages=jnp.zeros_like(batch.advantages))
  learner = Learner(model, config(entropy_coef=1.0, lr=1e-2, forecast_every=0))
  state = learner.init(model)
  start = learner.mean_entropy(state, batch)
  for _ in range(3):
    state, _ = learner.step(state, batch)
  assert learner.mean_entropy(state, batch) > start + 1e-3


def test_kl_to_reference_and_warmup_cosine_schedule():
  import optax
  from rft_jax.entropy import masked_mean
  from rft_jax.rl.losses import kl_penalty

  model = tiny_model(seed=3)
  batch, _ = synthetic_batch(model, seed=3)
  learner = Learner(model, config(kl_coef=0.5, kl_estimator="k3", schedule="warmup_cosine",
                                  warmup_steps=2, total_steps=6, lr=1e-3, forecast_every=0),
                    reference=tiny_model(seed=4))  # another policy: a KL well away from 0
  state = learner.init(model)
  valid = batch.response_mask[:, 1:] * batch.attention_mask[:, 1:]
  want_kl = float(masked_mean(kl_penalty(learner.batch_stats(state.params, batch).logp,
                                         learner.batch_stats(learner.reference, batch).logp, "k3"), valid))
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 6)
  for step in range(3):
    state, metrics = learner.step(state, batch)
    assert metrics["lr"] == pytest.approx(float(schedule(step)), abs=1e-12)
    if step == 0:
      assert metrics["kl"] == pytest.approx(want_kl, rel=1e-4) and want_kl > 0.01
  learner2 = Learner(tiny_model(seed=3), config(kl_coef=0.5))
  state2 = learner2.init(tiny_model(seed=3))  # copies the reference parameters
  learner2.reference = None  # no reference parameters
  with pytest.raises(ValueError, match="kl_coef > 0 needs reference log-probs"):
    learner2.step(state2, batch)


def test_first_response_column_is_the_first_completion_column_rounded_down():
  response = np.zeros((3, 80))
  response[0, 40:70] = response[1, 37:50] = 1
  assert first_response_column(response) == 32
  assert first_response_column(response, multiple=1) == 37
  assert first_response_column(np.zeros((3, 80))) == 0


@pytest.mark.parametrize("micro,loss_agg", [(16, "token-mean"),  # the single-pass step
                                            (4, "seq-mean-token-sum-norm")])  # micro-batches
def test_completion_only_statistics_equal_full_width(tiny, micro, loss_agg):
  """Statistics, log p, loss and update from the first completion column (4) on, as Learner.step
  computes them, equal those of every position on completion tokens (to float32 rounding);
  Dr.GRPO's constant length stays the full width."""
  batch = tiny[2]
  cfg = config(micro_batch_size=micro, max_grad_norm=None, forecast_every=0, loss_agg=loss_agg,
               entropy_mask=EntropyMaskConfig(kind="clip_b", mu_low=0.5))
  learner = Learner(fresh_model(tiny), cfg)
  params = learner.init(fresh_model(tiny)).params
  full = jax.jit(learner.batch_stats)(params, batch)
  completion = jax.jit(learner.batch_stats, static_argnums=2)(params, batch, PROMPT)
  for name, a, b in zip(full._fields, completion, full):
    assert a.shape == (16, COMPLETION), name
    np.testing.assert_allclose(a, b[:, PROMPT - 1:], rtol=1e-5, atol=1e-6, err_msg=name)
  step = jax.jit(learner._train_step_fn, static_argnums=3)
  results = [step(learner.init(fresh_model(tiny)), batch, None, column) for column in (0, PROMPT)]
  (s1, m1, r1), (s2, m2, r2) = results
  assert float(m1["mask_frac"]) > 0
  for key in m1:
    assert float(m1[key]) == pytest.approx(float(m2[key]), rel=1e-5, abs=1e-7), key
  for key in r1:  # per-completion statistics (rollouts.jsonl); token_entropy: the positions both have
    a, b = r1[key], r2[key]
    a = a[:, a.shape[1] - b.shape[1]:] if a.ndim == 2 else a
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=key)
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=3e-5)


def test_off_policy_forecast_is_corollary_3_of_each_update_at_its_own_parameters():
  """With two mini-batches, ``entropy_change_forecast_off_policy`` sums each update's Corollary 3
  forecast, weighted by its share of the batch's loss tokens: the first at the starting
  parameters (ratio 1: Corollary 4 on its half), the second at the parameters the first left,
  its tokens' steps ``r A`` with ``r`` against the batch's pre-update log-probs. Recomputed here
  from a learner that takes the first update alone."""
  lr = 1e-2
  model = tiny_model()
  batch, _ = synthetic_batch(model)
  learner = Learner(model, config(lr=lr, max_grad_norm=None, mini_batches=2))
  state = learner.init(model)
  start = jax.tree.map(jnp.copy, state.params)
  _, metrics = learner.step(state, batch)
  halves = [jax.tree.map(lambda x, i=i: x[i::2], batch) for i in range(2)]  # split_rows' mini-batches
  alone = Learner(tiny_model(), config(lr=lr, max_grad_norm=None))
  after_first, first = alone.step(alone.init(tiny_model()), halves[0])
  valid = np.asarray(halves[1].response_mask[:, 1:] * halves[1].attention_mask[:, 1:]) > 0
  tokens = [float(np.sum(np.asarray(h.response_mask[:, 1:]))) for h in halves]
  share = [n / sum(tokens) for n in tokens]
  old = alone.batch_stats(start, halves[1])
  moved = alone.batch_stats(after_first.params, halves[1])
  ratio = np.exp(np.asarray(moved.logp) - np.asarray(old.logp))
  advantages = np.asarray(halves[1].advantages)[:, None] * np.ones_like(ratio)
  clipped = ((advantages > 0) & (ratio > 1.2)) | ((advantages < 0) & (ratio < 0.8))  # no gradient
  assert np.max(np.abs(ratio[valid] - 1)) > 0.05 and 0 < np.sum(clipped & valid) < 0.1 * np.sum(valid)
  steps = np.where(clipped, 0.0, advantages * ratio)
  second = float(batch_entropy_change(jnp.asarray(steps), moved.centered, jnp.asarray(valid), lr * share[1]))
  expected = share[0] * first["entropy_change_forecast"] + second
  assert metrics["entropy_change_forecast_off_policy"] == pytest.approx(expected, rel=2e-3)
  # At the starting parameters, with ratio 1, the second update's forecast would differ.
  on_start = float(batch_entropy_change(halves[1].advantages[:, None] * jnp.ones_like(old.logp), old.centered,
                                        jnp.asarray(valid), lr * share[1]))
  assert abs(on_start - second) > 0.01 * abs(second)


def test_bfloat16_model_learner_log_probs_are_the_samplers():
  """The learner forms a bfloat16 model's logits as the sampler does (``Qwen.logits``: bfloat16
  operands, float32 sums), so at the first update its log-probabilities are the sampler's to
  float32 rounding; with the float32 unembedding (the promoted product) they were up to 8e-4 apart
  here (tiny logits; ~1e-2 at a real model's)."""
  model = tiny_model()
  model.config = dataclasses.replace(model.config, dtype=jnp.bfloat16)
  model = Qwen(model.config, rngs=nnx.Rngs(0))
  batch, _ = synthetic_batch(model)
  learner = Learner(model, config())
  state = learner.init(model)
  logp = learner.batch_stats(state.params, batch).logp
  response = np.asarray(batch.response_mask[:, 1:]) > 0
  gap = np.abs(np.asarray(logp) - np.asarray(batch.sampler_logp[:, 1:]))[response]
  assert gap.max() < 1e-5, gap.max()
  from rft_jax.entropy import token_stats  # the promoted product, for contrast
  hidden = nnx.jit(lambda m, ids: m(ids, return_hidden=True))(model, batch.input_ids)
  promoted = token_stats(hidden[:, :-1], batch.input_ids[:, 1:], unembedding=model.unembedding())
  assert np.abs(np.asarray(promoted.logp) - np.asarray(batch.sampler_logp[:, 1:]))[response].max() > 1e-4
