"""The sampler's pieces without a model: settings checks, buckets, key material, truncation
filters, and the rollout layout handed to the learner."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax.sampling import (
    Rollouts,
    SamplingParams,
    Strategy,
    batch_bucket,
    completion_keys,
    prompt_fingerprints,
    prompt_length_bucket,
    truncate,
)
from rft_jax.rl.learner import LearnerBatch, learner_batch
from rft_jax.sampling.keys import step_uniforms


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 2.0), ("temperature", -0.1), ("temperature", float("nan")),
    ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
    ("max_new_tokens", 0), ("stop_token_ids", (2, -1)), ("stop_token_ids", 2),
    ("stop_token_ids", (2.5,)),
])
def test_sampling_params_errors_name_the_field(field, value):
  with pytest.raises(ValueError, match=rf"sampling\.{field}"):
    SamplingParams(**{field: value})


def test_sampling_params_normalise_and_hash():
  a = SamplingParams(n=np.int64(4), temperature=1, stop_token_ids=[2, np.int32(3)])
  assert a.stop_token_ids == (2, 3) and type(a.n) is int and type(a.temperature) is float
  assert hash(a) == hash(SamplingParams(n=4, temperature=1.0, stop_token_ids=(2, 3)))
  assert SamplingParams(temperature=0).greedy and not a.greedy
  # Traced settings do not change the program; static ones do.
  assert Strategy.of(SamplingParams(temperature=0.7, top_p=0.9)) == Strategy.of(
      SamplingParams(temperature=1.3, top_k=5)) == Strategy(truncate=True)
  assert Strategy.of(SamplingParams(temperature=0.0, top_k=5, top_p=0.5)) == Strategy(greedy=True)
  assert Strategy.of(SamplingParams(temperature=0.5)) == Strategy()


def test_buckets():
  assert [prompt_length_bucket(x) for x in (1, 16, 17, 24, 25, 48, 49, 100, 700, 769, 1024, 1025, 3000)] == [
      16, 16, 24, 24, 32, 48, 64, 128, 768, 1024, 1024, 2048, 3072]
  assert [batch_bucket(x) for x in (1, 3, 4, 5, 33)] == [1, 4, 4, 8, 64]
  assert [batch_bucket(x, 4) for x in (1, 3, 5)] == [4, 4, 8]
  assert batch_bucket(5, 6) == 12  # a multiple of the data axis
  with pytest.raises(ValueError, match="num_prompts=0"):
    batch_bucket(0)
  with pytest.raises(ValueError, match="prompt length 0"):
    prompt_length_bucket(0)


def test_keys_follow_the_prompt_not_its_place():
  prompts = [[1, 2, 3], [4], [1, 2, 3], [3, 2, 1]]
  fp = prompt_fingerprints(prompts)
  assert fp.dtype == np.uint32 and fp.shape == (4, 3)
  np.testing.assert_array_equal(fp[0, :2], fp[2, :2])  # same tokens, same hash
  assert fp[0, 2] == 0 and fp[2, 2] == 1  # ... but a different occurrence number
  assert not np.array_equal(fp[0], fp[3])
  np.testing.assert_array_equal(prompt_fingerprints([[3, 2, 1], [1, 2, 3]]), fp[[3, 0]])
  keys = jax.random.key_data(completion_keys(jnp.uint32(5), jnp.asarray(fp), 2))
  assert keys.shape[0] == 8 and len({tuple(k) for k in np.asarray(keys).tolist()}) == 8
  moved = jax.random.key_data(completion_keys(jnp.uint32(5), jnp.asarray(fp[[3, 0]]), 2))
  np.testing.assert_array_equal(moved, keys[jnp.asarray([6, 7, 0, 1])])


def test_completion_keys_and_step_uniforms_follow_the_fold_chain():
  """Row ``b * n + j`` at step ``t`` draws ``U(fold(fold(fold^3(key(s), f_b), j), t))`` (the
  keys module's formula), however the program batches the folds."""
  fp = prompt_fingerprints([[1, 2, 3], [4], [9, 9]])
  keys = completion_keys(jnp.uint32(5), jnp.asarray(fp), 2)
  uniforms = np.asarray(jax.jit(step_uniforms, static_argnums=1)(keys, 4))
  assert uniforms.shape == (6, 4) and ((0 <= uniforms) & (uniforms < 1)).all()
  for b, words in enumerate(fp):
    key = jax.random.key(5)
    for word in words:
      key = jax.random.fold_in(key, word)
    for j in range(2):
      row = jax.random.fold_in(key, j)
      np.testing.assert_array_equal(jax.random.key_data(keys[b * 2 + j]), jax.random.key_data(row))
      for t in range(4):
        expected = jax.random.uniform(jax.random.fold_in(row, t), (), jnp.float32)
        assert uniforms[b * 2 + j, t] == expected, (b, j, t)


def test_truncation():
  logits = jnp.log(jnp.asarray([[0.5, 0.05, 0.3, 0.15], [0.25, 0.25, 0.25, 0.25]]))
  kept = lambda k, p: np.isfinite(np.asarray(truncate(logits, jnp.int32(k), jnp.float32(p))))
  np.testing.assert_array_equal(kept(2, 1.0)[0], [1, 0, 1, 0])
  assert kept(2, 1.0)[1].all()  # ties with the k-th are kept
  assert kept(0, 1.0).all() and kept(9, 1.0).all()
  # Sorted masses 0.5, 0.3, 0.15, 0.05: p = 0.5 keeps one token, 0.51 two, 0.96 four.
  for p, expected in [(0.5, [1, 0, 0, 0]), (0.51, [1, 0, 1, 0]), (0.8, [1, 0, 1, 0]),
                      (0.81, [1, 0, 1, 1]), (0.96, [1, 1, 1, 1]), (0.01, [1, 0, 0, 0])]:
    np.testing.assert_array_equal(kept(0, p)[0], expected, err_msg=str(p))
  # Top-p applies to the top-k distribution renormalised: 0.5 / 0.8 = 0.625 of {0, 2}.
  np.testing.assert_array_equal(kept(2, 0.6)[0], [1, 0, 0, 0])
  np.testing.assert_array_equal(kept(2, 0.63)[0], [1, 0, 1, 0])
  np.testing.assert_array_equal(kept(3, 0.99)[0], [1, 0, 1, 1])
  np.testing.assert_array_equal(kept(1, 0.3)[1], [1, 1, 1, 1])  # all tied


@pytest.mark.parametrize("vocab", [7, 300])
def test_categorical_draws_softmax_and_never_masked_entries(vocab):
  """Two-level inversion sampling: blocks of 4 (V = 7) or 32 (V = 300), the last one padded."""
  from rft_jax.sampling.strategies import categorical

  rng = np.random.default_rng(vocab)
  z = rng.normal(size=vocab) * 1.5
  z[rng.choice(vocab, vocab // 3, replace=False)] = -np.inf
  z[-1] = -np.inf  # the padded block ends in masked entries
  n = 40_000
  uniforms = jax.random.uniform(jax.random.key(vocab), (n,))
  tokens = np.asarray(jax.jit(categorical)(uniforms, jnp.broadcast_to(jnp.asarray(z, jnp.float32),
                                                                  (n, vocab))))
  assert np.isfinite(z[tokens]).all()
  p = np.exp(z - np.logaddexp.reduce(z))
  counts = np.bincount(tokens, minlength=vocab)
  live = p * n >= 5
  chi2 = np.sum((counts[live] - n * p[live]) ** 2 / (n * p[live]))
  dof = live.sum() - 1
  assert (chi2 - dof) / np.sqrt(2 * dof) < 5, chi2


def test_strategy_logprob_is_before_truncation():
  logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0, 0.0]] * 64)
  uniforms = jax.random.uniform(jax.random.key(0), (64,))
  tokens, logp = Strategy(truncate=True)(logits, uniforms, jnp.float32(0.5), jnp.int32(2),
                                         jnp.float32(0.99))
  assert set(np.asarray(tokens).tolist()) == {0, 1}
  full = jax.nn.log_softmax(logits / 0.5)
  np.testing.assert_allclose(logp, full[np.arange(64), tokens], rtol=1e-6)
  tokens, logp = Strategy(greedy=True)(logits, uniforms, jnp.float32(1.0), jnp.int32(0),
                                       jnp.float32(1.0))
  assert (tokens == 0).all()
  np.testing.assert_allclose(logp, jax.nn.log_softmax(logits)[:, 0], rtol=1e-6)


def test_cache_slots_round_up_to_whole_vectors():
  from rft_jax.sampling.loop import SLOT_MULTIPLE, cache_slots

  assert SLOT_MULTIPLE == 16
  assert [cache_slots(64, m) for m in (1, 2, 16, 17, 128)] == [64, 80, 80, 80, 192]
  assert cache_slots(1024, 4096) == 1024 + 4096


@pytest.mark.parametrize("strategy", [Strategy(), Strategy(truncate=True), Strategy(greedy=True)])
def test_strategy_on_vocab_major_logits_equals_rows(strategy):
  """``vocab_axis=0`` (``[V, B]`` logits, the CPU decode loop's layout) draws the same tokens
  with the same log-probabilities as ``[B, V]``."""
  logits = jax.random.normal(jax.random.key(1), (16, 300)) * 3
  uniforms = jax.random.uniform(jax.random.key(2), (16,))
  args = (uniforms, jnp.float32(0.7), jnp.int32(20), jnp.float32(0.9))
  tokens, logp = jax.jit(strategy)(logits, *args)
  tokens_t, logp_t = jax.jit(lambda z, *a: strategy(z, *a, vocab_axis=0))(logits.T, *args)
  np.testing.assert_array_equal(tokens_t, tokens)
  np.testing.assert_allclose(logp_t, logp, rtol=1e-6, atol=1e-6)


def test_greedy_takes_the_first_of_tied_maxima_on_either_layout():
  logits = jnp.asarray([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, 0.5, 0.5], [-1.0, -3.0, -2.0, -1.0]])
  for z, axis in ((logits, 1), (logits.T, 0)):
    tokens, logp = Strategy(greedy=True)(z, jnp.zeros(3), jnp.float32(1.0), jnp.int32(0),
                                         jnp.float32(1.0), vocab_axis=axis)
    np.testing.assert_array_equal(tokens, [1, 0, 0])
    np.testing.assert_allclose(logp, jax.nn.log_softmax(logits)[np.arange(3), [1, 0, 0]],
                               rtol=1e-6)


def _rollouts() -> Rollouts:
  return Rollouts(
      prompt_ids=np.array([[0, 7, 8], [5, 6, 9]], np.int32),
      prompt_lengths=np.array([2, 3], np.int32),
      completion_ids=np.array([[1, 2, 0, 0], [3, 4, 5, 6], [2, 0, 0, 0], [7, 7, 2, 0]],
                              np.int32),
      completion_lengths=np.array([2, 4, 1, 3], np.int32),
      logprobs=np.array([[-1, -2, 0, 0], [-1, -1, -1, -1], [-3, 0, 0, 0], [-1, -2, -3, 0]],
                        np.float32),
      finish_reason=np.array(["stop", "length", "stop", "stop"]),
      prompt_index=np.array([0, 0, 1, 1], np.int32),
  )


def test_learner_batch_layout():
  r = _rollouts()
  a = learner_batch(r)
  assert isinstance(a, LearnerBatch) and a.advantages is None  # the algorithm sets them
  np.testing.assert_array_equal(a.input_ids[1], [0, 7, 8, 3, 4, 5, 6])
  np.testing.assert_array_equal(a.attention_mask[0], [0, 1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(a.response_mask[3], [0, 0, 0, 1, 1, 1, 0])
  np.testing.assert_array_equal(a.sampler_logp[3], [0, 0, 0, -1, -2, -3, 0])
  np.testing.assert_array_equal(a.input_ids[2], [5, 6, 9, 2, 0, 0, 0])
  assert a.input_ids.dtype == np.int32 and a.sampler_logp.dtype == np.float32
  assert r.completions() == [[1, 2], [3, 4, 5, 6], [2], [7, 7, 2]]
  assert r.prompts() == [[7, 8], [5, 6, 9]] and len(r) == 4
  advantages = np.arange(4, dtype=np.float32)
  np.testing.assert_array_equal(learner_batch(r, advantages=advantages).advantages, advantages)
  wide = learner_batch(r, rows=[3, 0], prompt_width=4)  # these rows in this order, one padding column more
  np.testing.assert_array_equal(wide.input_ids, np.pad(a.input_ids[[3, 0]], ((0, 0), (1, 0))))
  np.testing.assert_array_equal(wide.sampler_logp[:, 1:], a.sampler_logp[[3, 0]])
  with pytest.raises(ValueError, match="prompt_width=2 is narrower than a taken prompt"):
    learner_batch(r, prompt_width=2)


def test_rollouts_check_shapes_and_reasons():
  r = _rollouts()
  with pytest.raises(ValueError, match="Rollouts.logprobs has shape"):
    Rollouts(**{**r.__dict__, "logprobs": r.logprobs[:, :3]})
  with pytest.raises(ValueError, match="finish_reason holds \\['eos'\\]"):
    Rollouts(**{**r.__dict__, "finish_reason": np.array(["stop", "eos", "stop", "stop"])})
