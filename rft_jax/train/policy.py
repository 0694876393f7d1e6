"""A policy ready to sample and score: the model with its tokenizer, prompt settings, stop ids and
reward settings, loaded one way for every command that samples from one.

:func:`load_policy` loads the starting model of a run's config (a training run,
:func:`rft_jax.train.run_setup.build_run`), a run directory's checkpoint with the run's settings, or a
Hugging Face directory with the training defaults (``rft-jax eval``, ``filter``, ``attribute``;
the figures' attribution page).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

from rft_jax.data.config import DataConfig
from rft_jax.data.prompts import prompt_ids, stop_token_ids
from rft_jax.models import load_hf, load_tokenizer
from rft_jax.rewards import RewardConfig
from rft_jax.train.checkpoint import restore_policy
from rft_jax.train.config import TrainConfig
from rft_jax.train.resolve import reward_config


@dataclasses.dataclass
class Policy:
  """A model and what sampling from it and scoring its answers needs.

  Attributes:
    model: the policy.
    tokenizer: its tokenizer (the run's ``model.path``'s, or the Hugging Face directory's).
    data: the prompt settings (instruction, system prompt, chat template) of :meth:`prompt_ids`.
    stop_ids: the tokens that end an answer (:func:`rft_jax.data.prompts.stop_token_ids`).
    config: the run's config; None for a Hugging Face directory loaded alone.
    step: the checkpoint's step of a run directory; None otherwise.
  """

  model: Any
  tokenizer: Any
  data: DataConfig
  stop_ids: tuple[int, ...]
  config: TrainConfig | None = None
  step: int | None = None

  def prompt_ids(self, question: str) -> list[int]:
    """The prompt of ``question`` (:func:`rft_jax.data.prompts.prompt_ids`)."""
    return prompt_ids(self.tokenizer, self.data, question)

  def rewards(self, questions: Sequence[str]) -> RewardConfig:
    """The reward settings for answers to ``questions``: the config's, ``extractor: auto``
    resolved on them (:func:`rft_jax.train.resolve.reward_config`); the defaults without a
    config."""
    return reward_config(self.config, questions) if self.config is not None else RewardConfig()


def load_policy(source: str | TrainConfig, *, step: int | None = None, tokenizer: Any = None,
                load: Callable[[str], Any] = load_hf, instruction: str | None = None,
                system_prompt: str | None = None, mesh: Any = None) -> Policy:
  """Loads a policy.

  Args:
    source: a run's config (its starting model, ``model.path``, loaded with ``load``, with the
      config's settings); or a directory: a run directory (one holding ``checkpoints``: the
      checkpoint of ``step``, default the latest, with the run's config), else a Hugging Face
      model directory (with the training defaults: no config).
    tokenizer: the tokenizer to use (one already loaded); None: load the run's ``model.path``'s,
      or the Hugging Face directory's.
    load: reads a Hugging Face directory into a model (a run's config passes its dtypes and mesh);
      a checkpoint is restored onto the run's mesh in its dtypes (:func:`rft_jax.train.checkpoint.restore_policy`).
    instruction / system_prompt: override the prompt settings' (None: keep them).
    mesh: the mesh a run directory's checkpoint is restored onto (None: the run's).
  """
  if isinstance(source, TrainConfig):
    model, config, step = load(source.model.path), source, None
  elif os.path.exists(os.path.join(source, "checkpoints")):
    model, config, step = restore_policy(source, step, mesh)
  else:
    model, config, step = load(source), None, None
  if tokenizer is None:
    tokenizer = load_tokenizer(config.model.path if config is not None else source)
  data = config.data if config is not None else DataConfig()
  overrides = {"instruction": instruction, "system_prompt": system_prompt}
  if any(v is not None for v in overrides.values()):
    data = dataclasses.replace(data, **{k: v for k, v in overrides.items() if v is not None})
  return Policy(model, tokenizer, data, stop_token_ids(tokenizer, model.config.eos_token_id), config, step)
