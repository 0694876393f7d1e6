"""The prompt stream of a training run: shuffled epochs of tokenised questions, batched.

Built on a ``grain.MapDataset`` of example indices (shuffled with a seed, reshuffled
every epoch, batched with ``drop_remainder``), so the iterator's whole state is one
small dict that is saved with every checkpoint and restored on resume.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import grain
import numpy as np

from rft_jax.data.datasets import DatasetError, MathExample


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A question ready for the sampler: its example and its prompt token ids."""

  example: MathExample
  token_ids: tuple[int, ...]


def tokenize_prompts(
    examples: Sequence[MathExample], tokenize: Callable[[str], Sequence[int]], max_prompt_len: int
) -> tuple[list[Prompt], int]:
  """Tokenises every question; drops (and counts) those longer than ``max_prompt_len``."""
  kept, too_long = [], 0
  for example in examples:
    ids = tuple(int(i) for i in tokenize(example.question))
    if len(ids) > max_prompt_len:
      too_long += 1
      continue
    kept.append(Prompt(example, ids))
  return kept, too_long


class PromptStream:
  """Batches of :class:`Prompt`, ``prompts_per_step`` at a time, forever or for ``epochs``."""

  def __init__(self, prompts: Sequence[Prompt], *, prompts_per_step: int, seed: int,
               epochs: int | None = None):
    if len(prompts) < prompts_per_step:
      raise DatasetError(f"{len(prompts)} prompts (after filtering) are fewer than one batch of "
                         f"data.prompts_per_step={prompts_per_step}")
    self.prompts = list(prompts)
    indices = grain.MapDataset.source(np.arange(len(self.prompts)))
    self._dataset = indices.shuffle(seed=seed).repeat(epochs).batch(prompts_per_step, drop_remainder=True)
    self._iterator = iter(self._dataset)
    self.steps_per_epoch = len(self.prompts) // prompts_per_step

  def __iter__(self):
    return self

  def __next__(self) -> list[Prompt]:
    return [self.prompts[int(i)] for i in next(self._iterator)]

  def get_state(self) -> dict:
    """The iterator position (a small JSON-able dict) to save with a checkpoint."""
    return dict(self._iterator.get_state())

  def set_state(self, state: dict) -> None:
    self._iterator.set_state(state)
