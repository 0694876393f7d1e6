"""Clip_B / Clip_V / Figure-1 masks against a plain numpy reference."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax import entropy as E


def reference_mask(score, adv, valid, mu_low, mu_high, samples, centre, max_frac=None):
  """numpy: keep unless eligible and outside [-mu_low s, mu_high s] around the centre."""
  score, adv, valid = (np.asarray(x, np.float64) for x in (score, adv, valid))
  valid = valid.astype(bool)
  x = score[valid]
  mean, sigma = x.mean(), x.std()  # population std
  dev = score - (mean if centre else 0.0)
  eligible = {"negative": adv < 0, "positive": adv > 0, "all": np.ones_like(adv, bool)}[samples]
  out_low = dev < -mu_low * sigma if mu_low is not None else np.zeros_like(valid)
  out_high = dev > mu_high * sigma if mu_high is not None else np.zeros_like(valid)
  masked = valid & eligible & (out_low | out_high) & (sigma > 0)
  if max_frac is not None:
    budget = max(int(np.floor(max_frac * valid.sum())), 1)  # the authors' budget
    excess = np.full(score.shape, -np.inf)
    if mu_low is not None:
      excess = np.maximum(excess, -dev / sigma - mu_low)
    if mu_high is not None:
      excess = np.maximum(excess, dev / sigma - mu_high)
    order = np.argsort(-np.where(masked, excess, -np.inf).ravel(), kind="stable")
    allowed = np.zeros(score.size, bool)
    allowed[order[:budget]] = True
    masked &= allowed.reshape(score.shape)
  return ~masked


def random_batch(seed, shape=(16, 40)):
  rng = np.random.default_rng(seed)
  score = rng.standard_t(df=3, size=shape) * 0.1  # heavy tails: some outliers
  adv = np.repeat(rng.normal(size=(shape[0], 1)), shape[1], axis=1)
  lengths = rng.integers(1, shape[1] + 1, size=shape[0])
  valid = np.arange(shape[1])[None, :] < lengths[:, None]
  score = np.where(valid, score, 1e3)  # padding holds garbage that must not count
  return score.astype(np.float32), adv.astype(np.float32), valid


clip_b = jax.jit(E.clip_b_mask, static_argnames=("mu_low", "mu_high", "samples"))
clip_v = jax.jit(E.clip_v_mask, static_argnames=("mu_low", "mu_high", "samples", "max_frac"))


@pytest.mark.parametrize("samples,mu_high,seed", list(itertools.product(["negative", "positive", "all"], [None, 1.5], [0, 1])))
def test_clip_b_matches_numpy(samples, mu_high, seed):
  score, adv, valid = random_batch(seed)
  got = clip_b(score, adv, valid, mu_low=1.5, mu_high=mu_high, samples=samples)
  want = reference_mask(score, adv, valid, 1.5, mu_high, samples, centre=True)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert (~want & valid).sum() > 0  # the case masks something
  assert np.all(np.asarray(got)[~valid])  # padding is never masked


@pytest.mark.parametrize("samples,mu_high,max_frac", list(itertools.product(["negative", "positive", "all"], [None, 2.0], [None, 0.01])))
def test_clip_v_matches_numpy(samples, mu_high, max_frac):
  score, adv, valid = random_batch(7)
  got = clip_v(score, adv, valid, mu_low=1.0, mu_high=mu_high, samples=samples, max_frac=max_frac)
  want = reference_mask(score, adv, valid, 1.0, mu_high, samples, centre=False, max_frac=max_frac)
  np.testing.assert_array_equal(np.asarray(got), want)
  n_masked = int((~np.asarray(got) & valid).sum())
  assert n_masked > 0
  if max_frac is not None:
    assert n_masked <= max(int(np.floor(max_frac * valid.sum())), 1)


def test_max_frac_keeps_the_most_extreme_tokens_masked():
  score = jnp.array([-10.0, -5.0, -3.0, 0.0, 0.1, 0.2] + [0.0] * 194)
  adv = -jnp.ones_like(score)
  valid = jnp.ones_like(score, bool)
  keep = E.clip_v_mask(score, adv, valid, mu_low=1.0, max_frac=0.01)  # budget: 2 tokens
  assert np.flatnonzero(~np.asarray(keep)).tolist() == [0, 1]


def test_clip_v_cap_masks_the_most_extreme_token_of_a_small_batch():
  """At the released max_frac = 1e-4 a batch of 5,000 valid tokens has floor(0.5) = 0 tokens of
  budget; the authors' code (Trinity-RFT 0.6.0, clipv_advantage.py) allows max(int(0.5), 1) = 1,
  so the one extreme negative-sample token is masked, and only it."""
  rng = np.random.default_rng(0)
  score = rng.normal(0.0, 1e-3, (50, 100)).astype(np.float32)
  adv = np.repeat(rng.choice([-1.0, 1.0], (50, 1)), 100, axis=1).astype(np.float32)
  row = int(np.flatnonzero(adv[:, 0] < 0)[0])
  score[row, 7] = -1.0  # ~70 sigma_c below 0
  score[row, 8] = -0.15  # ~10 sigma_c: beyond the cut too, but less extreme
  args = (jnp.asarray(score), jnp.asarray(adv), jnp.ones(score.shape, bool))
  uncapped = np.asarray(E.clip_v_mask(*args, max_frac=None))
  assert np.argwhere(~uncapped).tolist() == [[row, 7], [row, 8]]
  keep = np.asarray(E.clip_v_mask(*args))
  assert np.argwhere(~keep).tolist() == [[row, 7]]


def test_zero_sigma_masks_nothing_and_defaults_follow_released_configs():
  s = jnp.full((4, 8), 0.3)
  adv = -jnp.ones((4, 8))
  valid = jnp.ones((4, 8), bool)
  assert bool(jnp.all(E.clip_b_mask(s, adv, valid, mu_low=0.0)))
  assert bool(jnp.all(E.clip_v_mask(s, adv, valid, mu_low=0.0, max_frac=None)))
  import inspect
  b, v = inspect.signature(E.clip_b_mask).parameters, inspect.signature(E.clip_v_mask).parameters
  assert (b["mu_low"].default, b["mu_high"].default, b["samples"].default) == (2.5, None, "negative")
  assert (v["mu_low"].default, v["max_frac"].default, v["samples"].default) == (8.5, 1e-4, "negative")


def test_statistics_are_over_the_whole_batch_not_per_shard():
  """Masks computed on a batch sharded over 8 devices equal the single-device mask."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  score, adv, valid = random_batch(3, shape=(32, 40))
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  sharded = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (score, adv, valid)]
  got = clip_b(*sharded, mu_low=1.5, mu_high=None, samples="negative")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(clip_b(score, adv, valid, mu_low=1.5, mu_high=None, samples="negative")))
  per_shard = np.concatenate([np.asarray(E.clip_b_mask(score[i:i + 4], adv[i:i + 4], valid[i:i + 4], mu_low=1.5)) for i in range(0, 32, 4)])
  assert not np.array_equal(per_shard, np.asarray(got))  # the per-shard statistic really differs


def test_bad_arguments_are_named():
  s, a, m = jnp.zeros(4), jnp.zeros(4), jnp.ones(4, bool)
  with pytest.raises(ValueError, match="samples must be one of"):
    E.clip_b_mask(s, a, m, samples="negatives")
  with pytest.raises(ValueError, match="mu_low must be >= 0"):
    E.clip_b_mask(s, a, m, mu_low=-1.0)
  with pytest.raises(ValueError, match="max_frac"):
    E.clip_v_mask(s, a, m, max_frac=2.0)
  with pytest.raises(ValueError, match="sign must be"):
    E.discriminator_sign_mask(s, a, sign="pos", action="keep", samples="all")
  with pytest.raises(ValueError, match="action must be"):
    E.discriminator_sign_mask(s, a, sign="positive", action="isolate", samples="all")


@pytest.mark.parametrize("sign,action,samples", list(itertools.product(["positive", "negative"], ["keep", "drop", "only"], ["positive", "negative"])))
def test_figure1_sign_masks(sign, action, samples):
  s = jnp.array([0.2, -0.1, 0.0, 0.3, -0.4, 0.5])
  adv = jnp.array([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
  keep = np.asarray(E.discriminator_sign_mask(s, adv, sign=sign, action=action, samples=samples))
  chosen = np.asarray(adv > 0) if samples == "positive" else np.asarray(adv < 0)
  has_sign = np.asarray(s > 0) if sign == "positive" else np.asarray(s < 0)
  np.testing.assert_array_equal(keep[~chosen], action != "only")  # "only": nothing of other samples
  np.testing.assert_array_equal(keep[chosen], ~has_sign[chosen] if action == "drop" else has_sign[chosen])
