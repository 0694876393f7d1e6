"""What a run's config resolves to on a set of devices and its data: dtypes, the mesh's axis
sizes, the sampler's parameters and the reward's answer extractor. The training loop and
``rft-jax plan`` both take them from here, so a planned run is the run that trains."""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from rft_jax.models.config import DTYPES
from rft_jax.rewards import RewardConfig
from rft_jax.sampling import SamplingParams
from rft_jax.train.config import TrainConfig

__all__ = ["DTYPES", "mesh_axes", "reward_config", "sampling_params"]
# A question that itself asks for a final line "Answer: X" (DAPO-Math-17k's prompts do).
ASKS_FOR_ANSWER_LINE = re.compile(r"\bAnswer:")


def mesh_axes(cfg: TrainConfig, num_devices: int) -> tuple[int, int]:
  """``(data, model)`` device counts: ``mesh.data = -1`` takes every device not on ``model``."""
  model = cfg.mesh.model
  return (cfg.mesh.data if cfg.mesh.data > 0 else num_devices // model), model


def sampling_params(cfg: TrainConfig, stop_ids: Sequence[int]) -> SamplingParams:
  """The rollouts' sampler parameters: the ``sampling`` section, its stop tokens after the
  tokenizer's ``stop_ids`` (each once)."""
  stops = tuple(dict.fromkeys((*stop_ids, *cfg.sampling.stop_token_ids)))
  return dataclasses.replace(cfg.sampling, stop_token_ids=stops)


def reward_config(cfg: TrainConfig, questions: Sequence[str]) -> RewardConfig:
  """``rewards`` with ``extractor: auto`` resolved: ``answer_line_or_boxed`` when most
  training ``questions`` ask for an ``Answer:`` line themselves, else ``boxed``."""
  if cfg.rewards.extractor != "auto":
    return cfg.rewards
  asking = sum(bool(ASKS_FOR_ANSWER_LINE.search(q)) for q in questions)
  extractor = "answer_line_or_boxed" if asking * 2 > len(questions) else "boxed"
  return dataclasses.replace(cfg.rewards, extractor=extractor)
