"""DAPO-Math-17k as released: chat-list prompts asking for a final line "Answer: X", ground
truths in reward_model.ground_truth, graded by the Answer-line extractor a run picks itself."""

import pandas as pd
import pytest

from rft_jax.data import load_math_dataset
from rft_jax.rewards import RewardConfig, last_answer_line, score_batch
from rft_jax.rewards.extract import answer_line_or_boxed
from rft_jax.train.config import load_config
from rft_jax.train.resolve import reward_config

DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
               "{problem}\n\nRemember to put your answer on its own line after \"Answer:\".")


@pytest.mark.parametrize("text,answer", [
    ("so it is 42.\nAnswer: 42", "42"),
    ("Answer: 1\nno, wait\nAnswer: $\\frac{1}{2}$.", "\\frac{1}{2}"),
    ("**Answer:** 7", "7"),
    ("  answer: x+1", "x+1"),
    ("The Answer: is inline, not a line of its own", None),
    ("Answer:", None),
    ("no final line at all", None),
])
def test_last_answer_line(text, answer):
  assert last_answer_line(text) == answer


def test_answer_line_or_boxed_takes_whichever_comes_last():
  assert answer_line_or_boxed("\\boxed{3}\nAnswer: 4") == "4"
  assert answer_line_or_boxed("Answer: 4\nactually \\boxed{5}") == "5"
  assert answer_line_or_boxed("nothing") is None


def test_dapo_rows_load_and_their_answer_lines_are_rewarded(tmp_path):
  rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": DAPO_PROMPT.format(problem=p)}],
           "ability": "MATH", "reward_model": {"ground_truth": g, "style": "rule"},
           "extra_info": {"index": str(i)}}
          for i, (p, g) in enumerate([("What is 6 x 7?", "42"), ("What is 1/2 + 0?", "\\frac{1}{2}")])]
  path = tmp_path / "dapo.parquet"
  pd.DataFrame(rows).to_parquet(path)
  examples, _ = load_math_dataset(str(path), "dapo_math_17k")
  assert [e.answer for e in examples] == ["42", "\\frac{1}{2}"]
  assert examples[0].question.startswith("Solve the following") and "6 x 7" in examples[0].question

  cfg = load_config(None, [f"data.train_path={path}", "data.format=dapo_math_17k"], required=())
  rewards = reward_config(cfg, [e.question for e in examples])
  assert rewards.extractor == "answer_line_or_boxed"
  assert reward_config(cfg, ["What is 6 x 7?"]).extractor == "boxed"  # questions that do not ask
  completions = ["6 x 7 = 42\nAnswer: 42", "half\nAnswer: $\\frac{1}{2}$", "\\boxed{42}", "Answer: 41"]
  answers = ["42", "\\frac{1}{2}", "42", "42"]
  args = (completions, answers, ["stop"] * 4, [8] * 4)
  assert score_batch(*args, rewards).reward.tolist() == [1.0, 1.0, 1.0, 0.0]
  assert score_batch(*args, RewardConfig()).reward.tolist() == [0.0, 0.0, 1.0, 0.0]  # boxed only


def test_an_unknown_extractor_is_named():
  with pytest.raises(ValueError, match="rewards.extractor='last_line'"):
    RewardConfig(extractor="last_line")
