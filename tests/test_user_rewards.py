"""Reward functions of the user's own, named "module:function", run in the time-limited workers."""

import concurrent.futures
import logging
import textwrap
import time

import numpy as np
import pytest

from rft_jax.rewards import RewardConfig, TimeLimitedPool, score_batch
from rft_jax.rewards.user_functions import load_function
from rft_jax.train.config import ConfigError, load_config
from rft_jax.train.errors import RewardError
from rft_jax.train.step_rollouts import check_reward_failures

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

    def rejects_b(completion, answer, row):
      if "b" in completion:
        raise KeyError("no b " + completion)  # one kind of failure, whatever the message says
      return 1.0

    def nan_for_odd(completions, answers, rows):
      return [float("nan") if len(c) % 2 else 1.0 for c in completions]

    def hangs_batched(completions, answers, rows):
      time.sleep(60)
      return [1.0] * len(completions)
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


@pytest.fixture()
def warnings_logged():
  """The warnings of the user-function module's logger (a list of messages)."""
  messages = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = lambda record: messages.append(record.getMessage())
  log = logging.getLogger("rft_jax.rewards.user_functions")
  log.addHandler(handler)
  yield messages
  log.removeHandler(handler)


def within(seconds, fn, *args, **kwargs):
  """``fn(*args, **kwargs)``, failing the test if it takes more than ``seconds`` (a hang)."""
  with concurrent.futures.ThreadPoolExecutor(1) as ex:
    return ex.submit(fn, *args, **kwargs).result(timeout=seconds)


def test_a_raising_function_is_counted_and_its_first_failure_logged_with_the_traceback(pool, warnings_logged):
  result = score(pool, ["a", "b1", "b2", "c"], ["1"] * 4, functions=["my_rewards:rejects_b"],
                 function_per_sample=True)
  assert result.reward.tolist() == [1.0, 0.0, 0.0, 1.0] and result.errors == 2
  assert result.failed.tolist() == [False, True, True, False] and result.failures() == 2
  (message,) = warnings_logged  # the two failures are one kind: logged once, counted twice
  assert message.startswith("reward function my_rewards:rejects_b failed on 2 completion(s): KeyError: 'no b b")
  assert "Traceback (most recent call last)" in message and 'raise KeyError("no b " + completion)' in message
  assert "in rejects_b" in message and "user_functions.py" not in message  # the user's frames only
  again = score(pool, ["b3"], ["1"], functions=["my_rewards:rejects_b"], function_per_sample=True)
  assert again.errors == 1 and len(warnings_logged) == 1  # not logged again


def test_nan_rewards_are_errors_and_too_many_failures_stop_the_step(pool, warnings_logged):
  result = score(pool, ["odd", "even", "x"], ["1"] * 3, functions=["my_rewards:nan_for_odd"])
  # one batched call: one NaN fails the whole call's completions
  assert result.errors == 3 and result.failed.all() and np.all(result.reward == 0)
  assert warnings_logged == ["reward function my_rewards:nan_for_odd failed on 3 completion(s): returned a "
                             "non-finite reward (nan) (its first failure of this kind; they score 0; later "
                             "ones are only counted, in train/reward_errors or train/reward_timeouts)"]
  with pytest.raises(RewardError, match=r"^step 4: the rewards of 3 of 3 completions \(100%\) could not be "
                     r"computed \(3 errors: raised, or returned NaN, inf or the wrong count; 0 timeouts\), "
                     r"above rewards.max_error_fraction=0.5"):
    check_reward_failures([result], 4, RewardConfig(functions=["my_rewards:nan_for_odd"]))
  check_reward_failures([result], 4, RewardConfig(max_error_fraction=1.0))  # 1: never stops
  fine = score(pool, ["ab", "cd"], ["1"] * 2, functions=["my_rewards:nan_for_odd"])
  check_reward_failures([result, fine], 4, RewardConfig(max_error_fraction=0.6))


def test_a_hanging_function_is_killed_at_the_budget_and_counts_as_a_failure(pool, warnings_logged):
  started = time.monotonic()
  result = within(40, score, pool, ["a", "b"], ["1", "1"], functions=["my_rewards:hangs_batched"],
                  step_time_limit_s=2.0)
  assert time.monotonic() - started < 20 and result.timed_out.all() and result.failed.all()
  assert (result.timeouts, result.errors) == (2, 0) and np.all(result.reward == 0)
  assert warnings_logged[0].startswith("reward function my_rewards:hangs_batched failed on 2 completion(s): "
                                       "did not return within the batch's 2.0 s; its worker was killed")
  with pytest.raises(RewardError, match=r"0 errors: .*; 2 timeouts\)"):
    check_reward_failures([result], 0, RewardConfig())
