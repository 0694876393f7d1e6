"""PPO with a GAE critic in the training loop (learner.advantage: gae): token-level advantages from
the critic's values, the critic trained beside the policy, saved in checkpoints and resumed exactly;
`rft-jax export` writes the policy only."""

import json

import numpy as np
import pytest

from loop_fixtures import make_loop_files, overrides
from rft_jax import cli
from rft_jax.train.config import load_config
from rft_jax.train.loop import train
from rft_jax.train.metrics_log import read_jsonl, read_metrics

TIMING = ("time", "timing/sample_s", "timing/reward_s", "timing/learner_s", "timing/critic_s",
          "timing/sample_tokens_per_s")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  return make_loop_files(tmp_path_factory.mktemp("ppo"))


def ppo(setup, run_dir, steps):
  return load_config(None, overrides(setup, run_dir, steps, "learner.advantage=gae", "eval.every=0",
                                     "rewards.functions=[reward_fixtures:odd_length]",
                                     "learner.forecast_every=0", "log_rollouts_every=1",
                                     "critic.micro_batch_size=4", "critic.optim.lr=1e-3", "mesh.data=2",
                                     "mesh.model=1", "learner.entropy_mask.kind=clip_b",
                                     "learner.entropy_mask.mu_low=0.5"))


def test_ppo_trains_the_critic_and_resumes_it_exactly(setup, tmp_path):
  straight = train(ppo(setup, tmp_path / "a", 2))
  train(ppo(setup, tmp_path / "b", 1))
  resumed = train(ppo(setup, tmp_path / "b", 2))  # the critic comes back from the checkpoint
  a, b = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
  assert [r["step"] for r in b] == [1, 2]
  for ra, rb in zip(a, b):
    for key in ra:
      if key not in TIMING:
        assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)
  assert straight["value_loss"] == pytest.approx(resumed["value_loss"], rel=1e-5)
  for r in a:
    assert np.isfinite(r["critic/value_loss"]) and np.isfinite(r["critic/explained_variance"])
    assert np.isfinite(r["actor/loss"]) and "mask/frac_neg" in r
  # the critic starts at zero values: the first step's advantages are whitened returns (the rewards)
  assert a[0]["critic/value_mean"] == 0.0 and a[1]["critic/value_mean"] != 0.0
  rollouts = read_jsonl(str(tmp_path / "a" / "rollouts.jsonl"))
  first = [r for r in rollouts if r["step"] == 1]
  rewards = np.array([r["reward"] for r in first])
  advantages = np.array([r["advantage"] for r in first])
  assert 0 < rewards.mean() < 1  # both kinds of completion
  # with gamma = lam = 1 and V = 0 each token's advantage is its completion's reward, whitened
  assert np.corrcoef(rewards, advantages)[0, 1] > 0.99
  out = tmp_path / "hf"
  assert cli.main(["export", str(tmp_path / "a"), str(out)]) == 0
  assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
