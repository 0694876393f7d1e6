"""Multi-turn decoding (rft_jax.sampling.turns): a pool of rows that pause at the end of a turn and
resume with an environment's tokens appended to their own cache.

* One turn equals the single-turn sampler: a trajectory's first turn is the completion
  ``generate`` samples for the seed, whatever row, chunk or company it decodes in.
* Appending a reply to the kept cache samples what feeding the whole history again samples
  (the static path), token for token.
* The model's log-probabilities of the drawn tokens over the whole trajectory (prompt, turns,
  replies: one forward pass, as the learner takes it) equal the sampler's to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_fixtures import make_tiny_qwen
from rft_jax.models.hf import load_hf
from rft_jax.sampling import SamplingParams, generate
from rft_jax.sampling.keys import completion_keys, prompt_fingerprints
from rft_jax.sampling.turn_pool import TurnPool
from rft_jax.sampling.turns import feed_width

PROMPTS = [[3, 5, 7, 9], [4, 4, 2, 8, 1, 6, 6]]
STOP = 1  # the tiny model's "end of turn" in one-turn tests
STOPS = tuple(range(1, 11))  # ... and in multi-turn ones: turns of about 12 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  return load_hf(make_tiny_qwen(tmp_path_factory.mktemp("turns"), "qwen3"))


def keys_of(prompts, n, seed):
  return np.asarray(jax.random.key_data(completion_keys(
      jnp.uint32(seed), jnp.asarray(prompt_fingerprints(prompts)), n)))


def run(model, params, *, slots, chunk, replies, keep_cache=True, seed=7, budget=40):
  """Trajectories of PROMPTS (``params.n`` each): after each ended turn, the reply
  ``replies[turn]`` (until they run out), through one pool of ``slots`` rows."""
  n = params.n
  keys = keys_of(PROMPTS, n, seed)
  pool = TurnPool(model, params, slots=slots, width=16 + budget)
  history = {i: [] for i in range(len(PROMPTS) * n)}
  logps = {i: [] for i in range(len(PROMPTS) * n)}
  turns = {i: 0 for i in history}
  waiting, free, at = list(history), list(range(slots)), {}
  while waiting or at:
    while free and waiting:
      i = waiting.pop(0)
      at[row := free.pop(0)] = i
      pool.start(row, PROMPTS[i // n], keys[i], budget)
    for row, (tokens, logprobs, ended) in pool.decode(chunk).items():
      i = at[row]
      history[i] += tokens
      logps[i] += logprobs
      if not ended:
        continue
      turn = turns[i]
      turns[i] += 1
      left = budget - len(history[i]) - (len(replies[turn]) if turn < len(replies) else 0)
      if turn >= len(replies) or history[i][-1] not in params.stop_token_ids or left < 1:
        pool.free(row)
        free.append(row)
        del at[row]
        continue
      history[i] += replies[turn]
      logps[i] += [None] * len(replies[turn])
      pool.resume(row, replies[turn], left, again=not keep_cache)
  run.evictions = pool.evictions
  return history, logps


def test_feed_width_buckets():
  assert [feed_width(x) for x in (1, 16, 17, 100)] == [16, 16, 32, 128]


@pytest.mark.parametrize("slots,chunk", [(4, 64), (3, 5), (1, 1)])
def test_one_turn_is_the_single_turn_completion(model, slots, chunk):
  params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, stop_token_ids=(STOP,))
  expected = generate(model, PROMPTS, params, seed=7)
  history, logps = run(model, params, slots=slots, chunk=chunk, replies=[], budget=20)
  assert [history[i] for i in range(4)] == expected.completions()
  for i in range(4):
    np.testing.assert_allclose(logps[i], expected.logprobs[i, :len(logps[i])], atol=2e-6)


def test_a_kept_cache_samples_what_the_whole_history_fed_again_samples(model):
  params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, stop_token_ids=STOPS)
  replies = [[11, 12, 13], [20, 21, 22, 23, 24, 25], [30]]
  kept, kept_logps = run(model, params, slots=3, chunk=4, replies=replies)
  again, again_logps = run(model, params, slots=2, chunk=7, replies=replies, keep_cache=False)
  assert sum(h.count(20) for h in kept.values()) >= 2, "too few turns ended to test the replies"
  assert kept == again
  for i in kept:
    a = [x for x in kept_logps[i] if x is not None]
    b = [x for x in again_logps[i] if x is not None]
    np.testing.assert_allclose(a, b, atol=2e-6)


def test_the_learner_reads_the_sampler_log_probabilities(model):
  params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, stop_token_ids=STOPS)
  replies = [[11, 12, 13], [20, 21, 22, 23, 24, 25]]
  history, logps = run(model, params, slots=4, chunk=8, replies=replies)
  for i, tokens in history.items():
    prompt = PROMPTS[i // 2]
    ids = jnp.asarray([prompt + tokens])
    logits = model(ids)[0]  # one forward pass over the whole trajectory
    logp = jax.nn.log_softmax(logits, axis=-1)
    model_tokens = [t for t, lp in enumerate(logps[i]) if lp is not None]
    got = np.asarray([logp[len(prompt) + t - 1, tokens[t]] for t in model_tokens])
    np.testing.assert_allclose(got, [logps[i][t] for t in model_tokens], atol=1e-5)


@pytest.mark.parametrize("kv_pages,page_size", [(64, 8), (9, 8)])
def test_a_paged_pool_samples_what_the_dense_pool_samples(model, kv_pages, page_size):
  """Rows' pages kept across turns, given as they grow; with 9 pages of 8 tokens (72 tokens for
  3 rows of up to ~50) the youngest trajectories are evicted and fed again: the same samples."""
  import dataclasses
  params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, stop_token_ids=STOPS)
  replies = [[11, 12, 13], [20, 21, 22, 23, 24, 25], [30]]
  dense, dense_logps = run(model, params, slots=3, chunk=4, replies=replies)
  paged_params = dataclasses.replace(params, kv_pages=kv_pages, page_size=page_size)
  paged, paged_logps = run(model, paged_params, slots=3, chunk=4, replies=replies)
  assert (run.evictions > 0) == (kv_pages < 16), run.evictions
  assert paged == dense
  for i in dense:
    a = [x for x in dense_logps[i] if x is not None]
    b = [x for x in paged_logps[i] if x is not None]
    np.testing.assert_allclose(a, b, atol=2e-6)
