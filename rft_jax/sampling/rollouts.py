"""Sampled completions, typed: :class:`Rollouts`.

The token ids always come to the host (the rewards read their text). With
``generate(..., keep_on_device=True)`` the log-probabilities stay on the sampler's devices, with a
copy of the token ids, and the learner's batch is assembled there
(:func:`rft_jax.rl.learner.learner_batch`, which reads these fields): only the prompts and the
lengths go up, nothing of the completions comes back down.
"""

from __future__ import annotations

import dataclasses

import jax
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
      (``softmax(z)`` when greedy); 0 on padding. None when they stay on the devices
      (:attr:`on_device`).
    finish_reason: ``[N]`` ``'stop'`` (ended by a stop token) or ``'length'``
      (``max_new_tokens`` reached).
    prompt_index: ``[N]`` int32 the prompt (row of ``prompt_ids``) of each completion:
      ``0, .., 0, 1, .., 1, ...`` (``n`` each).
    on_device: the completions' :class:`OnDevice` arrays, or None (everything on the host).
    evictions: samples a paged KV cache evicted for lack of pages and decoded again
      (``SamplingParams.kv_pages``; the samples are the same, the time is not); 0 otherwise.
    prompt_expert_ids: an MoE sampler's routing of the prompts, ``[B, P, n_layers, k]``: the
      experts each prompt token went to in each layer of the prefill (:func:`compact_expert_ids`
      dtype); None when not recorded (a dense model, or recording off).
    completion_expert_ids: ``[N, M, n_layers, k]`` the experts of each completion token in the
      decode step that fed it (0 where none did: a completion's last token, padding); None when
      not recorded. The learner replays them (``learner.routing_replay``) and measures its
      routing against them.
    completion_mask: ``[N, M]`` int32 1 on the tokens the model drew, 0 on those an environment
      fed between its turns (multi-turn trajectories, :mod:`rft_jax.rollout`), which the learner
      reads but does not train on; None: every completion token is the model's.
  """

  prompt_ids: np.ndarray
  prompt_lengths: np.ndarray
  completion_ids: np.ndarray
  completion_lengths: np.ndarray
  logprobs: np.ndarray | None
  finish_reason: np.ndarray
  prompt_index: np.ndarray
  on_device: OnDevice | None = None
  evictions: int = 0
  prompt_expert_ids: np.ndarray | jax.Array | None = None
  completion_expert_ids: np.ndarray | jax.Array | None = None
  completion_mask: np.ndarray | None = None

  def __post_init__(self):
    b, p = self.prompt_ids.shape
    n_total, m = self.completion_ids.shape
    expected = {"prompt_lengths": (b,), "completion_lengths": (n_total,),
                "logprobs": (n_total, m), "finish_reason": (n_total,),
                "prompt_index": (n_total,)}
    if self.completion_mask is not None:
      expected["completion_mask"] = (n_total, m)
    if (self.logprobs is None) == (self.on_device is None):
      raise ValueError("Rollouts: give logprobs (host) or on_device (device), exactly one")
    if self.on_device is not None:
      expected.pop("logprobs")
      for name in ("completion_ids", "logprobs"):
        if getattr(self.on_device, name).shape != (n_total, m):
          raise ValueError(f"Rollouts.on_device.{name} has shape {getattr(self.on_device, name).shape}, "
                           f"expected {(n_total, m)}")
    for name, shape in expected.items():
      if getattr(self, name).shape != shape:
        raise ValueError(f"Rollouts.{name} has shape {getattr(self, name).shape}, expected "
                         f"{shape} (prompt_ids {b}x{p}, completion_ids {n_total}x{m})")
    if (self.prompt_expert_ids is None) != (self.completion_expert_ids is None):
      raise ValueError("Rollouts: give both prompt_expert_ids and completion_expert_ids, or neither")
    if self.prompt_expert_ids is not None:
      routed = self.prompt_expert_ids.shape[2:]
      for name, lead in (("prompt_expert_ids", (b, p)), ("completion_expert_ids", (n_total, m))):
        shape = getattr(self, name).shape
        if shape[:2] != lead or shape[2:] != routed or len(shape) != 4:
          raise ValueError(f"Rollouts.{name} has shape {shape}, expected {lead + routed} "
                           "([rows, tokens, layers, k])")
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


@dataclasses.dataclass(frozen=True)
class OnDevice:
  """A call's outputs left on the sampler's devices (rows over the mesh's ``data`` axis).

  Attributes:
    completion_ids: ``[N, M]`` int32, equal to :attr:`Rollouts.completion_ids`.
    logprobs: ``[N, M]`` float32, as :attr:`Rollouts.logprobs` describes.
  """

  completion_ids: jax.Array
  logprobs: jax.Array


def compact_expert_ids(expert_ids, num_experts: int):
  """``expert_ids`` in the smallest dtype that holds ``num_experts`` ids: uint8 up to 256
  experts, else int16 (a rollout's recorded routing: ``n_layers * k`` bytes a token)."""
  return expert_ids.astype(np.uint8 if num_experts <= 256 else np.int16)
