"""Training on multi-turn trajectories: the number-guessing game trains two steps on a tiny
model, through the CLI's config (``rollout.environment``, ``data.extras_field``), and the run's
files say what happened turn by turn."""

from __future__ import annotations

import json
import shutil

import pytest

from agent_fixtures import make_agent_tokenizer
from hf_fixtures import make_tiny_qwen
from loop_fixtures import overrides
from rft_jax.train.config import load_config
from rft_jax.train.config_sources import ConfigError
from rft_jax.train.loop import train
from rft_jax.train.metrics_log import read_jsonl, read_metrics

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("agent_run")
  model_dir = make_tiny_qwen(root, "qwen3", vocab=128)
  for f in make_agent_tokenizer(root).iterdir():
    shutil.copy(f, model_dir / f.name)
  data = root / "guess.jsonl"
  data.write_text("".join(json.dumps({"question": "Guess number", "answer": str(s),
                                      "env": {"secret": s, "max_turns": 3}}) + "\n"
                          for s in (5, 17, 33, 48, 60, 12, 27, 9)))
  return root, model_dir, data


def agent_overrides(setup, run_dir, *extra):
  return overrides(setup, run_dir, 2, "rollout.environment=guess_number", "rollout.max_turns=3",
                   "rollout.decode_chunk=8", "rollout.env_workers=2", "data.extras_field=env",
                   "data.instruction=", "sampling.max_new_tokens=48", "eval.every=0",
                   "log_rollouts_every=1", *extra)


def test_the_number_guessing_game_trains_two_steps(setup, tmp_path):
  run_dir = tmp_path / "run"
  out = train(load_config(None, agent_overrides(setup, run_dir)))
  assert out["steps_done"] == 2
  metrics = read_metrics(str(run_dir))
  assert [m["step"] for m in metrics] == [1, 2]
  for m in metrics:
    assert 1 <= m["agent/turns_mean"] <= 3
    assert 0 < m["agent/env_token_frac"] < 1
    assert m["agent/env_errors"] == 0 and m["agent/env_timeouts"] == 0
    assert 0 < m["agent/entropy_turn_1"] < 5 and 0 < m["agent/entropy_role_answer"] < 5
  records = read_jsonl(run_dir / "rollouts.jsonl")
  assert len(records) == 2 * 2 * 4  # two steps of 2 prompts x 4 trajectories
  for r in records:
    roles = [t["role"] for t in r["turns"]]
    assert roles[0] == "assistant" and all(a != b for a, b in zip(roles, roles[1:]))
    assert r["ending"] in ("done", "truncated")
    assert sum(len(t["ids"]) for t in r["turns"]) == r["length"]
  assert any(len(r["turns"]) > 1 for r in records)


@pytest.mark.parametrize("override,key", [
    ("rollout.max_turns=0", "rollout.max_turns"),
    ("rollout.turn_rewards=mean", "rollout.turn_rewards"),
    ("learner.routing_replay=true", "learner.routing_replay"),
    ("rollout.max_trajectory_tokens=0", "rollout.max_trajectory_tokens"),
])
def test_bad_multi_turn_settings_are_refused_naming_the_key(setup, tmp_path, override, key):
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
    load_config(None, agent_overrides(setup, tmp_path / "bad", override))
  assert "\n" not in str(info.value)
