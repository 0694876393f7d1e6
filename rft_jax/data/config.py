"""The training data's settings (``data.*`` of the run's config tree): where the questions are,
how they are read, batched and held out, and how each becomes a prompt.

A part of :class:`rft_jax.train.config.TrainConfig` (its ``data`` field); a bad value raises
``ValueError``, which loading the config reports as a ``ConfigError`` naming where it came from.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rft_jax.models.tokenizer import CHAT_TEMPLATE_MODES


@dataclasses.dataclass
class DataConfig:
  """Training questions (see ``rft_jax.data``).

  Attributes:
    train_path: local file or ``save_to_disk`` directory (required).
    format: ``dapo_math_17k``, ``aime_2024``, ``aime_2025`` or ``jsonl`` (generic).
    question_field / answer_field: override the format's columns (dotted paths).
    on_bad_row: ``error`` or ``skip`` (skipped rows are counted and logged).
    val_size: questions held out of the training set for validation (the paper: 500).
    prompts_per_step: prompts per training batch.
    max_prompt_len: longer prompts (in tokens) are filtered out, and counted.
    system_prompt: optional system message of the chat template.
    instruction: appended to every question.
    epochs: passes over the data (None: forever).
    chat_template: ``auto`` (the tokenizer's chat template when it has one, else plain text),
      ``chat`` (required) or ``none`` (plain text: system prompt, blank line, question).
    extras_field: a column (dotted path) holding each row's environment arguments, a dict or a
      JSON object as text, passed to its environment as ``extras`` (multi-turn rollouts,
      ``rollout.environment``; e.g. skyrl-gym's ``reward_spec``); the row's ``answer`` is added
      when it has none. None: ``{"answer": ...}`` alone.
  """

  train_path: str = ""
  format: str = "jsonl"
  question_field: Optional[str] = None
  answer_field: Optional[str] = None
  on_bad_row: str = "error"
  val_size: int = 500
  prompts_per_step: int = 64
  max_prompt_len: int = 1024
  system_prompt: Optional[str] = None
  instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."
  epochs: Optional[int] = None
  chat_template: str = "auto"
  extras_field: Optional[str] = None

  def __post_init__(self):
    if self.chat_template not in CHAT_TEMPLATE_MODES:
      raise ValueError(f"data.chat_template={self.chat_template!r} is not one of {list(CHAT_TEMPLATE_MODES)}")
