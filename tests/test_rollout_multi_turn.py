"""Multi-turn rollouts (rft_jax.rollout.multi_turn) with a real environment in worker processes:
the number-guessing game on a tiny random model.

* Masks: every token an environment fed is 0, every token the model drew is 1, and the ids are
  those the sampler fed: a forward pass over prompt and trajectory gives back the sampler's
  log-probabilities of the model's tokens.
* A kept cache and the whole history fed again give the same trajectories.
* The learner's batch of the trajectories trains on the model's tokens only.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from transformers import AutoTokenizer

from agent_fixtures import make_agent_tokenizer
from hf_fixtures import make_tiny_qwen
from rft_jax.environments import EnvironmentWorkers
from rft_jax.models.hf import load_hf
from rft_jax.rl.learner import learner_batch
from rft_jax.rollout.config import RolloutConfig
from rft_jax.rollout.conversation import reply_ids
from rft_jax.rollout.multi_turn import Problem, run_trajectories
from rft_jax.rollout.trajectory import trajectory_rollouts
from rft_jax.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
  root = tmp_path_factory.mktemp("agent")
  tokenizer = AutoTokenizer.from_pretrained(make_agent_tokenizer(root))
  model = load_hf(make_tiny_qwen(root, "qwen3"))
  with EnvironmentWorkers(2, step_timeout_s=30) as workers:
    yield model, tokenizer, workers


PROBLEMS = [Problem([], {"secret": 17, "max_turns": 3}), Problem([], {"secret": 40, "max_turns": 3})]
PARAMS = SamplingParams(n=3, temperature=1.0, max_new_tokens=120, stop_token_ids=(2,))


def trajectories(parts, params=PARAMS, **overrides):
  model, tokenizer, workers = parts
  cfg = RolloutConfig(environment="guess_number", max_turns=3, decode_chunk=6,
                      **overrides)
  return run_trajectories(model, tokenizer, PROBLEMS, params, cfg, workers, seed=3)


def test_masks_and_the_ids_the_sampler_fed(parts):
  model, tokenizer, _ = parts
  out = trajectories(parts)
  assert len(out) == 6 and all(t.ending in ("done", "truncated") for t in out)
  assert sum(t.model_turns > 1 for t in out) >= 2, "too few trajectories went on after a turn"
  for t in out:
    assert len(t.ids) == len(t.mask) == len(t.logprobs) <= PARAMS.max_new_tokens
    for turn in t.turns:
      ids, mask = t.ids[turn.start:turn.end], t.mask[turn.start:turn.end]
      if turn.role == "assistant":
        assert set(mask) == {1}
        assert ids[-1] == 2 or turn is t.turns[-1]  # a turn ends at <|im_end|>, or the budget
      else:  # the environment's reply, tokenized on its own
        assert set(mask) == {0}
        assert ids == reply_ids(tokenizer, turn.messages, 2)
    logits = model(np.asarray([t.prompt_ids + t.ids]))[0]
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    p = len(t.prompt_ids)
    for k in np.flatnonzero(t.mask):
      assert abs(logp[p + k - 1, t.ids[k]] - t.logprobs[k]) < 1e-5


def test_a_kept_cache_gives_the_trajectories_a_refed_history_gives(parts):
  """Kept dense cache, history fed again every turn, kept pages (with evictions: 40 pages of 8
  tokens for 6 trajectories of up to ~200): the same trajectories."""
  import dataclasses
  kept, again = trajectories(parts), trajectories(parts, keep_cache=False)
  paged = trajectories(parts, dataclasses.replace(PARAMS, kv_pages=40, page_size=8))
  for other in (again, paged):
    assert [t.ids for t in kept] == [t.ids for t in other]
    assert [t.rewards for t in kept] == [t.rewards for t in other]


def test_the_learner_trains_on_the_model_tokens_only(parts):
  out = trajectories(parts)
  rollouts = trajectory_rollouts(out, PARAMS.n, PARAMS.max_new_tokens)
  batch = learner_batch(rollouts)
  p = rollouts.prompt_ids.shape[1]
  for i, t in enumerate(out):
    k = len(t.ids)
    np.testing.assert_array_equal(batch.response_mask[i, p:p + k], t.mask)
    assert batch.attention_mask[i, p:p + k].all()  # the environment's tokens are read
    assert not batch.response_mask[i, p + k:].any()


def test_a_skyrl_gym_environment_runs_unchanged(parts):
  """skyrl-gym 0.4.0's multi-turn GSM8K environment, made by skyrl_gym.make in the workers: its
  per-turn rewards and its own end of episode (max_turns from the row)."""
  model, tokenizer, workers = parts
  cfg = RolloutConfig(environment="skyrl_gym:gsm8k_multi_turn", max_turns=4, decode_chunk=8)
  extras = {"reward_spec": {"ground_truth": "72"}, "extra_info": {}, "max_turns": 2}
  problems = [Problem([{"role": "user", "content": "Guess number"}], extras)]
  params = SamplingParams(n=4, temperature=1.0, max_new_tokens=160, stop_token_ids=(2,))
  out = run_trajectories(model, tokenizer, problems, params, cfg, workers, seed=5)
  ended = [t for t in out if t.ending == "done"]
  assert ended, [t.ending for t in out]
  for t in ended:  # skyrl-gym ends the episode at its own max_turns=2: two steps, two rewards
    assert t.model_turns == 2 and len(t.rewards) == 2
    assert all(r == 0.0 for r in t.rewards)  # random words: never "#### 72"
    env_turns = [turn for turn in t.turns if turn.role == "environment"]
    assert len(env_turns) == 1 and "#### ANSWER" in env_turns[0].text


def test_the_rollout_engine_gives_back_the_sampler_log_probabilities(parts):
  """RolloutEngine.logprobs (the interface's log-probs of given tokens under its weights): the
  sampler's on the model's tokens of a multi-turn batch, 0 on the environment's."""
  from rft_jax.train.rollout_engine import SingleTurnEngine

  model, _, _ = parts
  out = trajectories(parts)
  rollouts = trajectory_rollouts(out, PARAMS.n, PARAMS.max_new_tokens)
  engine = SingleTurnEngine(None, None)
  engine.update_weights(model)
  logp = engine.logprobs(rollouts)
  np.testing.assert_allclose(logp, rollouts.logprobs, atol=1e-5)
  assert (logp[rollouts.completion_mask == 0] == 0).all()
