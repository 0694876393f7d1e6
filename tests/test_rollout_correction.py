"""Rollout correction (``rft_jax.rl.rollout_correction``): against verl 0.9.1 on identical tensors,
in the learner's step, and its config.

The verl side is ``tests/verl_rollout_corr.py``, a line-for-line torch transcription of verl 0.9.1's
``verl/trainer/ppo/rollout_corr_helper.py`` (Apache-2.0).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import verl_rollout_corr as verl
from test_learner import config, synthetic_batch, tiny_model

from rft_jax.rl import rollout_correction as R
from rft_jax.rl.config import LearnerConfig, RolloutCorrectionConfig
from rft_jax.rl.learner import Learner
from rft_jax.train.config import ConfigError, load_config

SHAPES = [(2, 5), (8, 40), (16, 64)]


def _batch(seed, shape, *, empty_row=False):
  """Learner / sampler log-probs of mixed-length rows (each with a token unless ``empty_row``): a
  mismatch of about 0.3 nats with a few tokens 3 nats off either way."""
  rng = np.random.default_rng(seed)
  b, t = shape
  learner = -rng.exponential(1.5, shape)
  sampler = learner + rng.normal(0.0, 0.3, shape) + rng.choice([-3.0, 0.0, 3.0], shape, p=[0.03, 0.94, 0.03])
  lengths = rng.integers(1, t + 1, size=b)
  if empty_row:
    lengths[b // 2] = 0
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
  return learner.astype(np.float32), sampler.astype(np.float32), mask


def _close(ours: dict, theirs: dict, names: dict | None = None, rtol=2e-5, atol=1e-6):
  """Each metric of ``ours`` equals verl's (under ``names[k]``, default the same key)."""
  for key, value in ours.items():
    np.testing.assert_allclose(float(value), theirs[(names or {}).get(key, key)], rtol=rtol, atol=atol, err_msg=key)


WEIGHTS = jax.jit(R.importance_weights, static_argnames=("level", "cap", "floor", "batch_normalize"))
REJECTION = jax.jit(R.rejection_keep, static_argnames=("bounds",))
MISMATCH = jax.jit(R.mismatch_metrics)


# ----------------------------------------------------------------------------- against verl

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold,normalize", [(2.0, False), (1.5, True), ("0.5_5.0", False), ("0.1_10.0", True)])
def test_importance_weights_match_verl(shape, level, threshold, normalize):
  learner, sampler, mask = _batch(1, shape)
  weights_v, metrics_v = verl.compute_rollout_correction_weights(
      torch.from_numpy(learner - sampler), torch.from_numpy(mask), rollout_is=level,
      rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize)
  cap, floor = verl._parse_rollout_is_threshold(threshold)
  weights, metrics = WEIGHTS(jnp.asarray(learner) - jnp.asarray(sampler), jnp.asarray(mask) > 0,
                             level=level, cap=cap, floor=floor, batch_normalize=normalize)
  np.testing.assert_allclose(np.asarray(weights), weights_v.numpy(), rtol=1e-6, atol=1e-7)
  assert set(metrics) <= set(metrics_v) and "rollout_is_eff_sample_size" in metrics
  _close(metrics, metrics_v)


def test_truncated_weights_are_detached_true_ratios_capped_never_zeroed():
  learner, sampler, mask = _batch(2, (8, 40))
  log_ratio = jnp.asarray(learner - sampler)
  weights, _ = WEIGHTS(log_ratio, jnp.asarray(mask) > 0, level="token", cap=2.0, floor=None, batch_normalize=False)
  valid = mask > 0
  np.testing.assert_allclose(np.asarray(weights)[valid], np.minimum(np.exp(learner - sampler), 2.0)[valid], rtol=1e-6)
  assert np.all(np.asarray(weights)[valid] > 0) and np.all(np.asarray(weights)[~valid] == 0)
  grad = jax.grad(lambda x: jnp.sum(R.importance_weights(x, jnp.asarray(mask) > 0, "token", 2.0)[0]))(log_ratio)
  assert not np.any(np.asarray(grad))


REJECTIONS = [("token_k1", "0.5_2.0"), ("token_k1", 1.5), ("token_k2", 0.1), ("token_k3", "0.1"),
              ("seq_sum_k1", "0.3_3.0"), ("seq_sum_k2", 2.0), ("seq_sum_k3", 2.0),
              ("seq_mean_k1", "0.8_1.25"), ("seq_mean_k2", 0.08), ("seq_mean_k3", 0.08),
              ("seq_max_k2", 1.0), ("seq_max_k3", 1.0),
              ("token_k1,seq_max_k3", "0.4_2.5,2.0"), ("seq_mean_k1,token_k3,seq_mean_k1", 1.3)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("options,bounds", REJECTIONS)
def test_rejection_matches_verl(shape, options, bounds):
  learner, sampler, mask = _batch(3, shape)
  mask_v, metrics_v = verl.compute_rollout_rejection_mask(
      torch.from_numpy(learner - sampler), torch.from_numpy(mask), rollout_rs=options, rollout_rs_threshold=bounds)
  table = R.rejection_bounds(options, bounds)
  names = list(dict.fromkeys(options.split(",")))
  assert {b.option: {"lower": b.lower, "upper": b.upper} for b in table} == verl._parse_rollout_rs_thresholds(
      names, bounds)
  keep, metrics = REJECTION(jnp.asarray(learner) - jnp.asarray(sampler), jnp.asarray(mask) > 0, bounds=table)
  np.testing.assert_array_equal(mask * np.asarray(keep), mask_v.numpy())
  _close(metrics, metrics_v)


def test_k1_rejection_uses_both_ratio_bounds():
  """token_k1 keeps lower <= pi_rollout / pi_old <= upper: tokens beyond either bound go."""
  learner, sampler, mask = _batch(4, (16, 64))
  keep, _ = REJECTION(jnp.asarray(learner - sampler), jnp.asarray(mask) > 0, bounds=R.rejection_bounds("token_k1", "0.5_2.0"))
  ratio, valid, keep = np.exp(sampler - learner), mask > 0, np.asarray(keep) > 0
  assert np.any(valid & (ratio > 2.0)) and np.any(valid & (ratio < 0.5))
  np.testing.assert_array_equal(keep[valid], ((ratio >= 0.5) & (ratio <= 2.0))[valid])


@pytest.mark.parametrize("shape", SHAPES)
def test_mismatch_metrics_match_verl(shape):
  learner, sampler, mask = _batch(5, shape)
  metrics_v = verl.compute_offpolicy_metrics(torch.from_numpy(learner), torch.from_numpy(sampler), torch.from_numpy(mask))
  metrics = MISMATCH(jnp.asarray(learner), jnp.asarray(sampler), jnp.asarray(mask) > 0)
  _close(metrics, metrics_v, {"mismatch_kl": "kl", "mismatch_k3_kl": "k3_kl", "learner_ppl": "training_ppl",
                              "sampler_ppl": "rollout_ppl"})


def test_rows_without_tokens_are_left_out():
  """verl's per-sequence means count an empty row as a perfect match; here it is left out: the
  metrics of a batch with an empty row are those of the batch without it."""
  learner, sampler, mask = _batch(6, (8, 40), empty_row=True)
  rows = mask.sum(1) > 0
  cfg = RolloutCorrectionConfig(importance_sampling="sequence", rejection="seq_mean_k1,token_k1", rejection_bounds="0.5_2.0")
  with_empty = R.rollout_correction(jnp.asarray(learner), jnp.asarray(sampler), jnp.asarray(mask), cfg)
  without = R.rollout_correction(jnp.asarray(learner[rows]), jnp.asarray(sampler[rows]), jnp.asarray(mask[rows]), cfg)
  _close(with_empty.metrics, {k: float(v) for k, v in without.metrics.items()}, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(with_empty.weight)[~rows], 0.0)


# ----------------------------------------------------------------------------- in the learner step

GRADIENT = dict(adam_eps=1.0, max_grad_norm=1e6)  # a first AdamW step of g / (|g| + 1) ~ g: compares gradients


def _step(learner_config, batch, seed=0):
  model = tiny_model(seed)
  learner = Learner(model, learner_config)
  state, metrics = learner.step(learner.init(model), batch)
  return state.params, metrics


def _assert_params_close(a, b, rtol=2e-5, atol=1e-7):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _pre_update_logp(batch):
  """The learner's pre-update log-probs ``[B, L]`` aligned with ``input_ids`` (0 on column 0)."""
  model = tiny_model()
  learner = Learner(model, config(forecast_every=0))
  logp = learner.batch_stats(learner.init(model).params, batch).logp
  return jnp.pad(logp, ((0, 0), (1, 0)))


PACKED = dict(micro_batch_tokens=2 * 12)  # packed micro-batches of rows of 12 tokens
UPDATES = dict(mini_batches=2, ppo_epochs=2)


@pytest.mark.parametrize("micro,mask,more", [(16, "none", {}), (4, "none", {}), (4, "clip_b", {}), (16, "clip_b", {}),
                                             (4, "none", UPDATES), (4, "clip_b", PACKED)])
def test_rejected_tokens_leave_the_loss_and_its_denominator(micro, mask, more):
  """A step rejecting tokens (their sampler log-probs 3 nats off) equals a step without the
  correction on the batch whose response mask drops those tokens by hand, entropy mask included:
  one forward pass (16), a pre-update pass (4), several updates, packed micro-batches."""
  batch, _ = synthetic_batch(tiny_model())
  rng = np.random.default_rng(0)
  off = np.zeros(batch.input_ids.shape, bool)
  off[:, 5:] = rng.random((16, off.shape[1] - 5)) < 0.2
  shifted = batch.replace(sampler_logp=batch.sampler_logp + jnp.where(jnp.asarray(off), 3.0, 0.0))
  masked = batch.replace(response_mask=batch.response_mask * jnp.asarray(~off))
  kw = dict(micro_batch_size=micro, forecast_every=0, **GRADIENT, **more,
            entropy_mask={"kind": mask, "mu_low": 0.5} if mask != "none" else {"kind": "none"})
  corrected = config(**kw, rollout_correction={"rejection": "token_k1", "rejection_bounds": "0.5_2.0"})
  params, metrics = _step(corrected, shifted)
  params_ref, metrics_ref = _step(config(**kw), masked)
  _assert_params_close(params, params_ref)
  np.testing.assert_allclose(metrics["loss"], metrics_ref["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["rollout_rs_masked_fraction"], off[:, 4:].mean(), rtol=1e-6)
  assert metrics["mask_frac"] == pytest.approx(metrics_ref["mask_frac"] * (1 - off[:, 4:].mean()), rel=1e-5)


@pytest.mark.parametrize("micro,level,more", [(16, "token", {}), (4, "token", {}), (4, "sequence", {}),
                                              (16, "sequence", {}), (4, "token", UPDATES), (4, "token", PACKED),
                                              (4, "sequence", PACKED)])
def test_importance_weights_scale_each_tokens_policy_gradient(micro, level, more):
  """Weighting token t's clipped surrogate by w_t > 0 is advantages A * w_t (the max of the clipped
  and unclipped terms commutes with it): the corrected step equals a plain step with those
  per-token advantages, over several updates too. The weights are min(pi_old / pi_rollout, 2);
  micro-batches of 4 (packed or not) with token weights share their forward pass."""
  batch, _ = synthetic_batch(tiny_model())
  rng = np.random.default_rng(1)
  shape = batch.input_ids.shape
  if level == "token":
    log_w = rng.choice(np.log([0.5, 1.0, 1.5, 3.0]), shape)
  else:
    log_w = np.zeros(shape)
    log_w[:, -1] = rng.choice(np.log([0.5, 1.0, 1.5, 3.0]), shape[0])
  shifted = batch.replace(sampler_logp=_pre_update_logp(batch) - jnp.asarray(log_w, jnp.float32))
  weight = np.minimum(np.exp(log_w if level == "token" else log_w.sum(1, keepdims=True)), 2.0)
  scaled = batch.replace(advantages=batch.advantages[:, None] * jnp.asarray(weight * np.ones(shape), jnp.float32))
  kw = dict(micro_batch_size=micro, forecast_every=0, **GRADIENT, **more)
  params, metrics = _step(config(**kw, rollout_correction={"importance_sampling": level}), shifted)
  params_ref, metrics_ref = _step(config(**kw), scaled)
  _assert_params_close(params, params_ref, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics["loss"], metrics_ref["loss"], rtol=1e-4)
  # verl's max: of the applied (truncated) token weights, but of the untruncated sequence ratios
  assert metrics["rollout_is_max"] == pytest.approx(2.0 if level == "token" else 3.0, rel=1e-4)


@pytest.mark.parametrize("correction,shares", [({}, True), ({"diagnostics": True}, True),
                                                ({"importance_sampling": "token"}, True),
                                                ({"importance_sampling": "sequence"}, False),
                                                ({"importance_sampling": "token", "normalize_importance_weights": True}, False),
                                                ({"rejection": "token_k2", "rejection_bounds": "1"}, False)])
def test_only_token_local_corrections_share_the_forward_pass(correction, shares):
  """Micro-batches of one update share their forward pass only when each token's correction is
  its own: a rejection changes the token-mean denominator, a sequence weight needs the whole row."""
  learner = Learner(tiny_model(), config(micro_batch_size=4, rollout_correction=correction))
  assert learner.shares_forward_pass(16) == shares


@pytest.mark.parametrize("micro", [16, 4])
def test_off_or_metrics_only_is_todays_step(micro):
  """The default config's step has no rollout metrics; ``diagnostics`` adds them and changes
  nothing else; a config with the section off lowers to the same program as the default."""
  batch, _ = synthetic_batch(tiny_model())
  params, metrics = _step(config(micro_batch_size=micro, **GRADIENT), batch)
  params_diag, metrics_diag = _step(config(micro_batch_size=micro, **GRADIENT, rollout_correction={"diagnostics": True}),
                                    batch)
  assert not any(k.startswith(("rollout_", "mismatch_")) for k in metrics)
  assert metrics_diag["mismatch_kl"] == pytest.approx(0.0, abs=1e-4)  # the sampler's log-probs are the learner's
  assert set(metrics) <= set(metrics_diag)
  # XLA may fuse the two programs differently. The measured entropy change is a difference of two
  # float32 entropies of about 4: its rounding is a few units in the last place of the entropy
  # (4.77e-7 at 4.15; an Intel Xeon's run differed by one), not of the difference.
  measured = "entropy_change_measured"
  entropy_ulp = float(np.spacing(np.float32(metrics["entropy"])))
  _close({k: metrics_diag[k] for k in metrics if k != measured}, metrics, rtol=1e-5, atol=1e-7)
  _close({measured: metrics_diag[measured]}, metrics, rtol=0, atol=4 * entropy_ulp)
  _assert_params_close(params, params_diag, rtol=1e-5, atol=1e-8)
  texts = []
  for cfg in (config(micro_batch_size=micro), config(micro_batch_size=micro, rollout_correction=RolloutCorrectionConfig())):
    learner = Learner(tiny_model(), cfg)
    texts.append(learner.lower_step(learner.init(tiny_model()), batch).as_text())
  assert texts[0] == texts[1]


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("kw,message", [
    (dict(importance_sampling="tokens"), r"learner\.rollout_correction\.importance_sampling='tokens' is not one of"),
    (dict(importance_weight_cap=0.0), r"learner\.rollout_correction\.importance_weight_cap must be > 0, got 0\.0"),
    (dict(importance_weight_floor=3.0), r"learner\.rollout_correction\.importance_weight_floor=3\.0 must be in"),
    (dict(importance_weight_cap=float("inf")), r"importance_weight_cap must be a finite number, got inf"),
    (dict(rejection="seq_max_k1", rejection_bounds="2"), r"rejection='seq_max_k1' .*options must be among"),
    (dict(rejection="token_k1"), r"rejection='token_k1' with rejection_bounds=None: the rejection needs bounds"),
    (dict(rejection="token_k3", rejection_bounds="0.1_2"), r"token_k3 takes one upper bound, not '0.1_2'"),
    (dict(rejection="token_k1", rejection_bounds="2_0.5"), r"bounds of token_k1 must be positive with lower <= upper"),
    (dict(rejection="token_k1,token_k2", rejection_bounds="2,3,4"), r"needs one bound or 2, one per option"),
    (dict(rejection="token_k2", rejection_bounds="x"), r"bound 'x' of token_k2 is not a number"),
    (dict(rejection_bounds="2"), r"rejection_bounds='2' without learner\.rollout_correction\.rejection"),
])
def test_bad_values_raise_one_line_naming_the_key(kw, message):
  with pytest.raises(ValueError, match=message) as error:
    RolloutCorrectionConfig(**kw)
  assert "\n" not in str(error.value)


def test_rejection_with_gae_is_refused():
  """verl rejects before computing advantages, so its GAE recursion and whitening skip rejected
  tokens; the learner's GAE advantages come before its pre-update pass, so the pair is refused."""
  with pytest.raises(ValueError, match=r"rollout_correction\.rejection='token_k3' with learner\.advantage=gae"):
    LearnerConfig(advantage="gae", rollout_correction={"rejection": "token_k3", "rejection_bounds": "1"})
  assert LearnerConfig(advantage="gae", rollout_correction={"importance_sampling": "token"}).rollout_correction.enabled


def test_cli_overrides_reach_the_learner_config():
  cfg = load_config(None, ["model.path=/m", "data.train_path=/d.jsonl", "learner.rollout_correction.importance_sampling=sequence",
                           "learner.rollout_correction.importance_weight_cap=3", "learner.rollout_correction.rejection=seq_mean_k1,token_k3",
                           "learner.rollout_correction.rejection_bounds='0.9_1.1,0.5'"])
  c = cfg.learner.rollout_correction
  assert (c.importance_sampling, c.importance_weight_cap, c.enabled) == ("sequence", 3.0, True)
  assert c.rejection_table == (R.RejectionBound("seq_mean_k1", 0.9, 1.1), R.RejectionBound("token_k3", None, 0.5))
  assert not LearnerConfig().rollout_correction.enabled
  with pytest.raises(ConfigError, match=r"learner\.rollout_correction\.rejection='token_k9'"):
    load_config(None, ["model.path=/m", "data.train_path=/d.jsonl", "learner.rollout_correction.rejection=token_k9",
                       "learner.rollout_correction.rejection_bounds=2"])
