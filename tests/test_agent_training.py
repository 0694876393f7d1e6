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
from rft_jax import cli
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


def test_the_number_guessing_game_trains_two_steps(setup, tmp_path, monkeypatch):
  import rft_jax.train.evaluate

  def single_turn(*args, **kwargs):
    raise AssertionError("a multi-turn run was evaluated on single completions")
  monkeypatch.setattr(rft_jax.train.evaluate, "generate", single_turn)
  run_dir = tmp_path / "run"
  out = train(load_config(None, agent_overrides(setup, run_dir, "eval.every=2",
                                                   "eval.save_completions=true")))
  assert out["steps_done"] == 2
  metrics = read_metrics(str(run_dir))
  assert [m["step"] for m in metrics] == [1, 2]
  assert 0 <= metrics[1]["eval/val/avg@2"] <= 1  # the validation problems' trajectories
  assert len(read_jsonl(run_dir / "eval_completions.jsonl")) == 2 * 2
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
  # the attribution page of the run: its trajectories, the environment's tokens greyed
  page = tmp_path / "attribution.html"
  root, _, data = setup
  assert cli.main(["attribute", "--model", str(run_dir), "--data", str(data), "--problems", "2",
                   "--k", "2", "--out", str(page)]) == 0
  text = page.read_text()
  env_spans = text.count('<span class="env"')
  model_spans = text.count('title="p=')  # the model's tokens: S_* and the forecast on hover
  assert env_spans >= 2 and model_spans > env_spans
  # rft-jax eval of the run: trajectories too (the environment's verdicts)
  assert cli.main(["eval", "--model", str(run_dir), "--data", str(data), "--k", "2"]) == 0


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


def test_unusable_settings_are_refused_before_the_first_step(setup, tmp_path):
  """An environment that cannot be found, a chat template that is not prefix-preserving (Qwen3's
  drops past reasoning: this one drops past assistant turns' text), plain-text prompts, the
  python tool's sandbox limit over the step timeout: one line naming the key, before any step."""
  from transformers import AutoTokenizer

  from rft_jax.train.agent_round import agent_parts
  root, model_dir, _ = setup
  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  forgetful = tmp_path / "forgetful.jinja"
  forgetful.write_text(
      "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
      "{% if m['role'] == 'assistant' and not loop.last %}{% else %}{{ m['content'] }}{% endif %}"
      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  cases = [(("rollout.environment=no_such_env",), "rollout.environment"),
           ((f"rollout.chat_template={forgetful}",), "rollout.chat_template"),
           (("rollout.environment=tools", "rollout.tools=[python]",
             "rollout.env_step_timeout_s=2"), "rollout.env_step_timeout_s")]
  for extra, key in cases:
    cfg = load_config(None, agent_overrides(setup, tmp_path / "run", *extra))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
      agent_parts(cfg, AutoTokenizer.from_pretrained(model_dir), (2,))
    assert "\n" not in str(info.value), info.value
  with pytest.raises(ConfigError, match="data.chat_template=none"):
    load_config(None, agent_overrides(setup, tmp_path / "run", "data.chat_template=none"))
  assert tokenizer.chat_template  # the template of the files, untouched by the checks


def test_failed_starts_are_counted_once_and_the_round_still_forms():
  """A trajectory whose environment failed to start has no prompt and no tokens: one failed
  call; its group still forms its rows (the others' prompt)."""
  from rft_jax.rollout.trajectory import Trajectory, trajectory_rollouts
  from rft_jax.train.agent_round import environment_counts, trajectory_rewards

  ok = Trajectory(0, 0, prompt_ids=[5, 6])
  ok.add("assistant", [7, 2], "x", [-1.0, -2.0])
  ok.rewards, ok.ending = [1.0], "done"
  at_step = Trajectory(0, 1, prompt_ids=[5, 6], ending="error", error="ValueError: x",
                       error_kind="error")
  at_start = Trajectory(0, 2, ending="error", error="TimeoutError", error_kind="timeout")
  counts = environment_counts([ok, at_step, at_start])
  assert (counts.ok, counts.error, counts.timeout) == (3, 1, 1)  # starts 2 ok, ok's step
  rollouts = trajectory_rollouts([ok, at_step, at_start], 3, 4)
  assert rollouts.prompt_lengths.tolist() == [2] and rollouts.completion_lengths.tolist() == [2, 0, 0]
  scored = trajectory_rewards([ok, at_step, at_start], "sum")
  assert scored.correct.tolist() == [True, False, False] and scored.failures() == 2
