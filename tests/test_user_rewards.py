"""Reward functions of the user's own, named "module:function", run in the time-limited workers."""

import textwrap
import time

import numpy as np
import pytest

from rft_jax.rewards import RewardConfig, TimeLimitedPool, score_batch
from rft_jax.rewards.user_functions import load_function
from rft_jax.train.config import ConfigError, load_config

MODULE = textwrap.dedent("""
    import time

    def length_bonus(completions, answers, rows):
      return [len(c) / 10 for c in completions]

    def answer_in_text(completion, answer, row):
      return float(answer in completion) + (0.5 if row.get("id") == "bonus" else 0.0)

    def hangs_on_loop(completion, answer, row):
      if "loop" in completion:
        time.sleep(120)
      return 1.0

    def wrong_length(completions, answers, rows):
      return [1.0]
""")


@pytest.fixture()
def pool(tmp_path, monkeypatch):
  (tmp_path / "my_rewards.py").write_text(MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))  # workers start with the parent's sys.path
  with TimeLimitedPool(2) as p:
    yield p


def score(pool, texts, answers, rows=None, **config):
  n = len(texts)
  return score_batch(texts, answers, ["stop"] * n, [4] * n, RewardConfig(**config), pool=pool, rows=rows)


def test_batched_and_per_sample_functions_with_weights(pool):
  texts, answers = ["it is 42", "maybe 7"], ["42", "42"]
  rows = [{"answer": "42", "id": "a"}, {"answer": "42", "id": "bonus"}]
  result = score(pool, texts, answers, rows, functions=["my_rewards:length_bonus"])
  assert result.reward.tolist() == pytest.approx([0.8, 0.7]) and result.correct.tolist() == [True, True]
  result = score(pool, texts, answers, rows, functions=["my_rewards:answer_in_text"], function_per_sample=True)
  assert result.reward.tolist() == [1.0, 0.5]
  both = score(pool, texts, answers, rows, functions=["my_rewards:length_bonus", "my_rewards:answer_in_text"],
               function_weights=[1.0, 2.0], function_per_sample=False)
  assert both.errors == 2  # a per-sample function called batched fails (wrong signature): scored 0
  both = score(pool, texts, answers, rows, functions=["my_rewards:answer_in_text"], function_weights=[2.0],
               function_per_sample=True)
  assert both.reward.tolist() == [2.0, 1.0]


def test_a_hanging_or_broken_function_is_killed_and_scores_zero(pool):
  started = time.monotonic()
  result = score(pool, ["fine 1", "loop forever", "fine 2"], ["1", "1", "1"],
                 functions=["my_rewards:hangs_on_loop"], function_per_sample=True, timeout_s=1.0)
  assert time.monotonic() - started < 30
  assert result.reward.tolist() == [1.0, 0.0, 1.0] and result.timed_out.tolist() == [False, True, False]
  assert result.timeouts == 1
  result = score(pool, ["a", "b"], ["1", "1"], functions=["my_rewards:wrong_length"])
  assert result.errors == 2 and np.all(result.reward == 0)


def test_function_names_are_checked(pool):
  assert load_function("my_rewards:length_bonus").__name__ == "length_bonus"
  with pytest.raises(ValueError, match="no function 'missing'"):
    load_function("my_rewards:missing")
  with pytest.raises(ValueError, match="cannot import 'not_a_module'"):
    load_function("not_a_module:f")
  with pytest.raises(ConfigError, match="'package.module:function'"):
    load_config(None, ["rewards.functions=[my_rewards.length_bonus]"], required=())
  with pytest.raises(ConfigError, match="2 weights for 1"):
    load_config(None, ["rewards.functions=[my_rewards:length_bonus]", "rewards.function_weights=[1,2]"],
                required=())
