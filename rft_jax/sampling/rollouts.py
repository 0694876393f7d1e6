"""Sampled completions as host (numpy) arrays, and their layout for the learner."""

from __future__ import annotations

import dataclasses

import numpy as np

FINISH_REASONS = ("stop", "length")


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """Completions of ``B`` prompts, ``n`` each, in prompt order (``N = B * n``).

  Widths are the call's buckets, not its longest sequences: ``P`` is the prompt-length bucket
  and ``M`` is ``max_new_tokens``, so the learner also sees few distinct shapes.

  Attributes:
    prompt_ids: ``[B, P]`` int32 prompts, left-padded with 0.
    prompt_lengths: ``[B]`` int32 real prompt tokens.
    completion_ids: ``[N, M]`` int32 completions, right-padded with 0; a completion ends with
      its stop token when it has one.
    completion_lengths: ``[N]`` int32 tokens per completion (the stop token counts).
    logprobs: ``[N, M]`` float32 sampler log-probability of each completion token under
      ``softmax(z / T)`` of the full vocabulary, before top-k / top-p truncation
      (``softmax(z)`` when greedy); 0 on padding.
    finish_reason: ``[N]`` ``'stop'`` (ended by a stop token) or ``'length'``
      (``max_new_tokens`` reached).
    prompt_index: ``[N]`` int32 the prompt (row of ``prompt_ids``) of each completion:
      ``0, .., 0, 1, .., 1, ...`` (``n`` each).
  """

  prompt_ids: np.ndarray
  prompt_lengths: np.ndarray
  completion_ids: np.ndarray
  completion_lengths: np.ndarray
  logprobs: np.ndarray
  finish_reason: np.ndarray
  prompt_index: np.ndarray

  def __post_init__(self):
    b, p = self.prompt_ids.shape
    n_total, m = self.completion_ids.shape
    expected = {"prompt_lengths": (b,), "completion_lengths": (n_total,),
                "logprobs": (n_total, m), "finish_reason": (n_total,),
                "prompt_index": (n_total,)}
    for name, shape in expected.items():
      if getattr(self, name).shape != shape:
        raise ValueError(f"Rollouts.{name} has shape {getattr(self, name).shape}, expected "
                         f"{shape} (prompt_ids {b}x{p}, completion_ids {n_total}x{m})")
    bad = set(np.unique(self.finish_reason).tolist()) - set(FINISH_REASONS)
    if bad:
      raise ValueError(f"Rollouts.finish_reason holds {sorted(bad)}; allowed: {FINISH_REASONS}")

  def __len__(self) -> int:
    return self.completion_ids.shape[0]

  def completions(self) -> list[list[int]]:
    """Each completion's tokens as a list (stop token included), e.g. to detokenize."""
    return [row[:k].tolist() for row, k in zip(self.completion_ids, self.completion_lengths)]

  def prompts(self) -> list[list[int]]:
    """Each prompt's tokens as a list (padding removed)."""
    p = self.prompt_ids.shape[1]
    return [row[p - k:].tolist() for row, k in zip(self.prompt_ids, self.prompt_lengths)]

  def to_learner_arrays(self) -> dict[str, np.ndarray]:
    """:func:`learner_arrays` of these rollouts."""
    return learner_arrays(self)


def learner_arrays(rollouts: Rollouts) -> dict[str, np.ndarray]:
  """The token arrays of the learner's batch (every field but the advantages), ``[N, P + M]``.

  Column ``t`` of every array describes token ``input_ids[:, t]``:

  * ``input_ids``: the completion's prompt (left-padded) followed by the completion
    (right-padded); int32.
  * ``attention_mask``: 1 on real prompt and completion tokens; int32.
  * ``response_mask``: 1 on completion tokens, the stop token included; int32.
  * ``sampler_logp``: the sampler's log-probability of the token (see
    :attr:`Rollouts.logprobs`), 0 off the completion; float32.
  """
  r = rollouts
  p = r.prompt_ids.shape[1]
  m = r.completion_ids.shape[1]
  prompt_mask = (np.arange(p)[None] >= (p - r.prompt_lengths)[:, None]).astype(np.int32)
  completion_mask = (np.arange(m)[None] < r.completion_lengths[:, None]).astype(np.int32)
  prompt_mask = prompt_mask[r.prompt_index]
  return {
      "input_ids": np.concatenate([r.prompt_ids[r.prompt_index], r.completion_ids],
                                  axis=1).astype(np.int32),
      "attention_mask": np.concatenate([prompt_mask, completion_mask], axis=1),
      "response_mask": np.concatenate([np.zeros_like(prompt_mask), completion_mask], axis=1),
      "sampler_logp": np.concatenate(
          [np.zeros(prompt_mask.shape, np.float32), r.logprobs * completion_mask],
          axis=1).astype(np.float32),
  }
