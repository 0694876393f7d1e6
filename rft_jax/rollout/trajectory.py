"""A multi-turn trajectory as the sampler made it, and a batch of them as the learner's rollouts.

One trajectory is one row for the learner: its prompt, then every token after it, the model's
(mask 1, with the sampler's log-probabilities) and the environment's (mask 0), in the order they
were fed, the ids the sampler drew and fed, never a re-tokenized transcript.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rft_jax.sampling.rollouts import Rollouts

# How a trajectory ended: the environment said done; a limit cut it (turns or tokens); its
# environment failed (raised, timed out or returned something malformed).
ENDINGS = ("done", "truncated", "error")


@dataclasses.dataclass
class Turn:
  """One turn: ``ids[start:end]`` of its trajectory, the model's (``role='assistant'``) or the
  environment's reply (``role='environment'``), with its text (the model's decoded, or the reply's
  messages as the environment gave them)."""

  role: str
  start: int
  end: int
  text: str
  messages: list[dict] | None = None


@dataclasses.dataclass
class Trajectory:
  """A trajectory of sample ``sample`` of problem ``problem``.

  Attributes:
    prompt_ids: the first prompt's ids.
    ids: every token after the prompt.
    mask: ``[len(ids)]`` 1 on the model's tokens, 0 on the environment's.
    logprobs: ``[len(ids)]`` the sampler's log-probabilities of the model's tokens, 0 elsewhere.
    turns: the turns, in order.
    rewards: the reward of each environment step.
    ending: one of :data:`ENDINGS` (None while it runs).
    error: the environment's failure, one line (``ending == 'error'``).
    metadata: each environment step's metadata.
  """

  problem: int
  sample: int
  prompt_ids: list[int] = dataclasses.field(default_factory=list)
  ids: list[int] = dataclasses.field(default_factory=list)
  mask: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  turns: list[Turn] = dataclasses.field(default_factory=list)
  rewards: list[float] = dataclasses.field(default_factory=list)
  ending: str | None = None
  error: str = ""
  error_kind: str = ""
  metadata: list[dict] = dataclasses.field(default_factory=list)

  def add(self, role: str, ids: list[int], text: str, logprobs: list[float] | None = None,
          messages: list[dict] | None = None) -> None:
    """Appends a turn (the model's with its log-probabilities; the environment's without)."""
    start = len(self.ids)
    self.ids += ids
    self.mask += [1 if role == "assistant" else 0] * len(ids)
    self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
    self.turns.append(Turn(role, start, len(self.ids), text, messages))

  @property
  def correct(self) -> bool:
    """The environment's verdict on an ended trajectory: its last step's ``metadata['correct']``
    where it gives one, else a last reward of at least 1 (a shaping reward below 1 for a wrong
    answer in form, as skyrl-gym's GSM8K gives, is not a correct answer)."""
    if not self.rewards:
      return False
    verdict = (self.metadata[-1] if self.metadata else {}).get("correct")
    return bool(verdict) if verdict is not None else self.rewards[-1] >= 1.0

  @property
  def model_turns(self) -> int:
    return sum(t.role == "assistant" for t in self.turns)

  def reward(self, turn_rewards: str) -> float:
    """The trajectory's reward: the ``sum`` of its steps' rewards or the ``last``; 0 without
    any."""
    if not self.rewards:
      return 0.0
    return float(sum(self.rewards) if turn_rewards == "sum" else self.rewards[-1])

  def record(self) -> dict[str, Any]:
    """The conversation, turn by turn with its roles and ids (``rollouts.jsonl``)."""
    return {"turns": [{"role": t.role, "text": t.text, "ids": self.ids[t.start:t.end]}
                      for t in self.turns],
            "ending": self.ending, "rewards": list(self.rewards),
            **({"error": self.error} if self.error else {})}


class Trajectories(list):
  """A round's trajectories (a list), and ``evictions``: the times a paged pool took a row's
  pages back and fed its history again."""

  evictions: int = 0


def trajectory_rollouts(trajectories: list[Trajectory], n: int, width: int, evictions: int = 0
                        ) -> Rollouts:
  """The learner's :class:`~rft_jax.sampling.Rollouts` of ``trajectories`` (``n`` per problem, in
  problem order), completions ``width`` columns wide, with their ``completion_mask``.

  A trajectory cut by a limit, or failed, finishes with ``'length'``, one the environment ended
  with ``'stop'``."""
  problems = len(trajectories) // n
  prompts = [next((t.prompt_ids for t in trajectories[b * n:(b + 1) * n] if t.prompt_ids), [0])
             for b in range(problems)]  # a failed start has no prompt (and no tokens after it)
  for t in trajectories:
    if t.prompt_ids and t.prompt_ids != prompts[t.problem]:
      raise ValueError(f"trajectory_rollouts: sample {t.sample} of problem {t.problem} starts "
                       "from another prompt than sample 0 (an environment whose init is random?)")
  p = max(len(x) for x in prompts)
  prompt_ids = np.zeros((problems, p), np.int32)
  for b, x in enumerate(prompts):
    prompt_ids[b, p - len(x):] = x
  ids, mask = np.zeros((len(trajectories), width), np.int32), np.zeros((len(trajectories), width), np.int32)
  logprobs = np.zeros((len(trajectories), width), np.float32)
  for i, t in enumerate(trajectories):
    if len(t.ids) > width:
      raise ValueError(f"trajectory_rollouts: trajectory {i} holds {len(t.ids)} tokens, more than "
                       f"width={width}")
    ids[i, :len(t.ids)], mask[i, :len(t.ids)], logprobs[i, :len(t.ids)] = t.ids, t.mask, t.logprobs
  return Rollouts(
      prompt_ids=prompt_ids,
      prompt_lengths=np.asarray([len(x) for x in prompts], np.int32),
      completion_ids=ids, completion_lengths=np.asarray([len(t.ids) for t in trajectories], np.int32),
      logprobs=logprobs,
      finish_reason=np.asarray(["stop" if t.ending == "done" else "length" for t in trajectories]),
      prompt_index=np.asarray([t.problem for t in trajectories], np.int32),
      completion_mask=mask, evictions=evictions)


def agent_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
  """Per step: model turns per trajectory, tool calls, tool errors and timeouts (the
  environments' step metadata), trajectories cut by a limit, environment failures, and the
  share of the trajectories' tokens the environments fed."""
  def total(key):
    return float(sum(m.get(key, 0) for t in trajectories for m in t.metadata))
  tokens = sum(len(t.ids) for t in trajectories)
  statuses = sorted({k for t in trajectories for m in t.metadata for k in m
                     if k.startswith("tool_status/")})
  return {
      **{f"agent_{k}": total(k) for k in statuses},
      "agent_turns_mean": float(np.mean([t.model_turns for t in trajectories])),
      "agent_tool_calls": total("tool_calls"), "agent_tool_errors": total("tool_errors"),
      "agent_tool_timeouts": total("tool_timeouts"),
      "agent_truncated_frac": float(np.mean([t.ending == "truncated" for t in trajectories])),
      "agent_env_errors": float(sum(t.ending == "error" and t.error_kind != "timeout" for t in trajectories)),
      "agent_env_timeouts": float(sum(t.error_kind == "timeout" for t in trajectories)),
      "agent_env_token_frac": float(sum(len(t.mask) - sum(t.mask) for t in trajectories) / max(tokens, 1)),
  }
