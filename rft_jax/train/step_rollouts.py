"""A step's rollouts, typed, from the sampler to the learner's batch.

A step samples one or more rounds (:class:`SampledRound`: the first, then dynamic sampling's
refills), each a sampler call with its texts and rewards; groups of ``sampling.n`` completions are
selected from them (:func:`select_groups`); their rows are assembled into the learner's batch
where the rollouts are (:func:`chosen_batch`, with :func:`~rft_jax.rl.learner.learner_batch`); the
algorithm's advantages complete it. :class:`StepRollouts` carries all of it, and gives the
per-completion records and metrics the loop logs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rft_jax.parallel import host_array
from rft_jax.rewards import RewardConfig
from rft_jax.rewards.score import RewardResult
from rft_jax.rl.learner import LearnerBatch, learner_batch
from rft_jax.rollout.trajectory import agent_metrics
from rft_jax.sampling.rollouts import Rollouts
from rft_jax.train.errors import RewardError


@dataclasses.dataclass
class SampledRound:
  """One sampler call of a step: its prompts, rollouts (``N`` rows, ``n`` per prompt, in prompt
  order), decoded completions, rewards, and the seconds sampling and scoring took."""

  prompts: list  # data.Prompt, one per prompt
  rollouts: Rollouts
  texts: list[str]  # [N] decoded completions
  scored: RewardResult  # [N] rewards and verdicts
  sample_time: float = 0.0
  reward_time: float = 0.0
  trajectories: list | None = None  # [N] multi-turn rollouts' turns (rft_jax.rollout.Trajectory)

  def varied_groups(self, n: int) -> int:
    """How many of its groups of ``n`` completions have rewards that differ."""
    return int(np.ptp(np.asarray(self.scored.reward).reshape(-1, n), axis=1).astype(bool).sum())


class Group(NamedTuple):
  """``n`` completions of one prompt: rows ``rows`` of a round's rollouts."""

  round: SampledRound
  rows: slice


def select_groups(rounds: list[SampledRound], n: int, wanted: int, dynamic: bool) -> list[Group]:
  """``wanted`` groups of ``n`` completions, in the rounds' order; with ``dynamic`` (DAPO's dynamic
  sampling), groups whose rewards differ first (flat groups only fill what refills could not)."""
  groups = [Group(r, slice(g * n, (g + 1) * n)) for r in rounds for g in range(len(r.rollouts) // n)]
  if dynamic:
    varied = [np.ptp(np.asarray(g.round.scored.reward)[g.rows]) > 0 for g in groups]
    groups = [g for g, v in zip(groups, varied) if v] + [g for g, v in zip(groups, varied) if not v]
  return groups[:wanted]


def width_multiple(width: int, most_padding: float = 1 / 32, least: int = 16) -> int:
  """What a learner batch of ``width`` used columns rounds its width up to a multiple of: the
  largest power of two of at most ``most_padding`` of the width, and at least ``least``.

  Every width is a learner program of its own (its step and its entropy-change pass; minutes
  to compile at 7B), and a step's width follows its longest prompt: at the paper's 7,168
  completion tokens, prompts of 100-600 tokens made 32 widths at multiples of 16, where
  multiples of 128 make 5, for at most 1.7% more columns.
  """
  multiple = least
  while multiple * 2 <= width * most_padding:
    multiple *= 2
  return multiple


def chosen_batch(chosen: list[tuple[Rollouts, slice]], multiple: int | None = None) -> LearnerBatch:
  """The learner's batch (:func:`~rft_jax.rl.learner.learner_batch`, without advantages) of the
  ``chosen`` rows (``(rollouts, rows)`` per group), in their order, assembled where the rollouts
  are (on the devices in a run).

  The prompt block is as narrow as the longest chosen prompt allows while the full width stays
  a multiple of ``multiple`` (None: :func:`width_multiple` of the width; a few learner programs
  per run, not one per width): the sampler left-pads prompts to a length bucket, and the
  learner would otherwise run its forward and backward passes over columns that are padding in
  every row.
  """
  completion = chosen[0][0].completion_ids.shape[1]
  bucket = max(rollouts.prompt_ids.shape[1] for rollouts, _ in chosen)
  longest = max(int(rollouts.prompt_lengths[rollouts.prompt_index[rows]].max()) for rollouts, rows in chosen)
  if multiple is None:
    multiple = width_multiple(completion + longest)
  width = min(bucket, -(-(completion + longest) // multiple) * multiple - completion)
  calls = list({id(rollouts): rollouts for rollouts, _ in chosen}.values())  # in order of first use
  rows = {id(call): [i for r, s in chosen if r is call for i in range(s.start, s.stop)] for call in calls}
  pieces = [learner_batch(call, rows[id(call)], width) for call in calls]
  if len(pieces) == 1:
    return pieces[0]
  # Call by call, then back to the groups' order (refills' groups may come between a call's).
  place = {key: i for i, key in enumerate((id(call), row) for call in calls for row in rows[id(call)])}
  order = np.asarray([place[id(r), i] for r, s in chosen for i in range(s.start, s.stop)])
  xp = jnp if isinstance(pieces[0].input_ids, jax.Array) else np
  return jax.tree.map(lambda *columns: xp.concatenate(columns)[order], *pieces)


def check_reward_failures(scores: list[RewardResult], step: int, rewards: RewardConfig) -> None:
  """Raises :class:`RewardError` if the rewards of more than ``rewards.max_error_fraction`` of
  the step's completions (``scores``: its rounds') could not be computed."""
  failed = sum(s.failures() for s in scores)
  total = sum(len(s.reward) for s in scores)
  if total and failed / total > rewards.max_error_fraction:
    errors, timeouts = sum(s.errors for s in scores), sum(s.timeouts for s in scores)
    what = f"rewards.functions={list(rewards.functions)}" if rewards.functions else "the math checks"
    raise RewardError(
        f"step {step}: the rewards of {failed} of {total} completions ({failed / total:.0%}) could not be "
        f"computed ({errors} errors: raised, or returned NaN, inf or the wrong count; {timeouts} "
        f"timeouts), above rewards.max_error_fraction={rewards.max_error_fraction}; stopping rather than "
        f"training on zero rewards: see the first failure of each kind logged above, in {what}")


@dataclasses.dataclass
class StepRollouts:
  """A step's sampled, scored and selected groups, and the learner's batch made of them.

  Attributes:
    rounds: every sampler call of the step (refills included).
    chosen: the selected groups, in batch order.
    rewards: ``[B]`` the selected completions' rewards (before any shaping).
    correct: ``[B]`` bool, the verifier's verdicts.
    batch: the learner's batch (advantages included).
    critic_targets: PPO's ``([B, L-1] returns, [B, L-1] values at rollout)``; None without a critic.
  """

  rounds: list[SampledRound]
  chosen: list[Group]
  rewards: np.ndarray
  correct: np.ndarray
  batch: LearnerBatch
  critic_targets: tuple | None = None

  @property
  def refills(self) -> int:
    return len(self.rounds) - 1

  def gather(self, field: str) -> np.ndarray:
    """``[B]`` a per-completion host field of the selected groups, in batch order:
    ``completion_lengths`` or ``finish_reason`` of the rollouts, ``reward`` or ``correct`` of the
    scores."""
    return gather(self.chosen, field)

  def records(self, tokenizer: Any, step: int, row_stats: dict) -> list[dict]:
    """One record per completion of the batch (``rollouts.jsonl``), in batch order. ``row_stats``
    holds ``[B]`` host arrays: the learner's (``Learner.step(rows=True)``) and ``advantage``
    (:func:`row_advantages`)."""
    records, row = [], 0
    for group in self.chosen:
      r, rows = group.round, group.rows
      prompt = r.prompts[r.rollouts.prompt_index[rows.start]]
      text = tokenizer.decode(list(prompt.token_ids), skip_special_tokens=False)
      for i in range(rows.start, rows.stop):
        records.append({
            "step": step, "prompt": text, "completion": r.texts[i], "answer": prompt.example.answer,
            "reward": float(r.scored.reward[i]), "correct": bool(r.scored.correct[i]),
            "length": int(r.rollouts.completion_lengths[i]),
            "finish_reason": str(r.rollouts.finish_reason[i]),
            **({} if r.trajectories is None else r.trajectories[i].record()),
            **{k: (int(v[row]) if k == "masked_tokens" else float(v[row])) for k, v in row_stats.items()}})
        row += 1
    return records

  def metrics(self, n: int) -> dict[str, float]:
    """The step's rollout metrics: rewards, accuracy, lengths, the groups without reward variance
    (of every round), refills, reward failures, and the seconds and tokens of sampling."""
    lengths, finish = self.gather("completion_lengths"), self.gather("finish_reason")
    all_rewards = np.concatenate([np.asarray(r.scored.reward) for r in self.rounds]).reshape(-1, n)
    sample_time = sum(r.sample_time for r in self.rounds)
    tokens = int(sum(r.rollouts.completion_lengths.sum() for r in self.rounds))
    scores = [r.scored for r in self.rounds]
    trajectories = [t for r in self.rounds for t in (r.trajectories or [])]
    return {
        **(agent_metrics(trajectories) if trajectories else {}),
        **({"agent_evictions": float(sum(r.rollouts.evictions for r in self.rounds))}
           if trajectories else {}),
        "reward_mean": float(self.rewards.mean()), "reward_std": float(self.rewards.std()),
        "accuracy": float(self.correct.mean()),
        "response_length_mean": float(lengths.mean()), "response_length_max": float(lengths.max()),
        "truncated_frac": float(np.mean(finish == "length")),
        "zero_variance_group_frac": float(np.mean(np.ptp(all_rewards, axis=1) == 0)),
        "refills": float(self.refills),
        "reward_timeouts": float(sum(s.timeouts for s in scores)),
        "reward_errors": float(sum(s.errors for s in scores)),
        "reward_over_budget": float(sum(s.over_budget for s in scores)),
        "time_sample": sample_time, "time_reward": sum(r.reward_time for r in self.rounds),
        "sample_tokens_per_s": tokens / max(sample_time, 1e-9),
    }


def gather(chosen: list[Group], field: str) -> np.ndarray:
  """``[B]`` a per-completion host field of the ``chosen`` groups (:meth:`StepRollouts.gather`)."""
  source = "rollouts" if field in ("completion_lengths", "finish_reason") else "scored"
  return np.concatenate([np.asarray(getattr(getattr(g.round, source), field))[g.rows] for g in chosen])


def row_advantages(batch: LearnerBatch) -> np.ndarray:
  """``[B]`` each completion's advantage: GRPO's, or the mean of PPO's token advantages over its
  tokens (a collective on several processes: every process calls it)."""
  if np.ndim(batch.advantages) == 1:
    return np.asarray(host_array(batch.advantages))
  mask = jnp.asarray(batch.response_mask, jnp.float32)
  total = jnp.sum(jnp.asarray(batch.advantages) * mask, axis=1)
  return np.asarray(host_array(total / jnp.maximum(jnp.sum(mask, axis=1), 1.0)))
