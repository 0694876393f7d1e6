"""Multi-turn rollouts in a run (``rollout.environment``): what they need besides the model
(:class:`AgentParts`, checked before the first step), trajectories made with the environments
(:mod:`rft_jax.rollout`), rewarded by them and checked for faults (:func:`sample_trajectories`:
the training round's, through :class:`~rft_jax.train.rollout_engine.MultiTurnEngine`, the
evaluation's and the attribution page's)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rft_jax.data.prompts import prompt_messages
from rft_jax.environments import (EnvironmentCounts, EnvironmentFaultError, EnvironmentWorkers,
                                  check_fault_fraction)
from rft_jax.rewards.score import RewardResult
from rft_jax.rollout import Problem, Trajectory, run_trajectories, trajectory_rollouts
from rft_jax.environments.registry import environment_factory
from rft_jax.rollout.conversation import TemplateError, check_template, check_tool_support
from rft_jax.rollout.token_roles import entropy_by_turn_and_role, tool_call_ids
from rft_jax.tools import SandboxLimits, ToolBox
from rft_jax.train.config_sources import ConfigError
from rft_jax.train.errors import RewardError
from rft_jax.train.status import logger


@dataclasses.dataclass
class AgentParts:
  """What multi-turn rollouts need besides the model: the environments' worker processes, the
  tools' schemas rendered into the prompts, and the ids of a tool call's markers."""

  workers: EnvironmentWorkers
  tool_schemas: list[dict]
  call_ids: tuple[int | None, int | None] = (None, None)

  def close(self) -> None:
    self.workers.shutdown()

  def sampler(self, cfg, model, tokenizer, mesh=None, data=None):
    """``(examples, params, seed) -> (rollouts, texts, scored)``: trajectories of ``model`` with
    this run's environment (:func:`sample_trajectories`), for an evaluation or a page."""
    def sample(examples, params, seed):
      return sample_trajectories(cfg, self, model, tokenizer, examples, params, seed, mesh, data)[:3]
    return sample

  def entropy_metrics(self, rollouts, token_entropy: np.ndarray, max_turns: int) -> dict[str, float]:
    """The step's policy entropy by turn and by token role
    (:func:`~rft_jax.rollout.token_roles.entropy_by_turn_and_role`), from the learner's
    ``token_entropy`` of the step's batch (rows: the chosen groups' trajectories, in order)."""
    trajectories = [t for g in rollouts.chosen for t in g.round.trajectories[g.rows]]
    width = rollouts.chosen[0].round.rollouts.completion_ids.shape[1]
    first = np.full(len(trajectories), token_entropy.shape[1] - width)
    return entropy_by_turn_and_role(trajectories, token_entropy, first, self.call_ids, max_turns)


def agent_parts(cfg, tokenizer: Any, stop_ids) -> AgentParts | None:
  """The run's :class:`AgentParts` (None for single-turn rollouts), after the checks that need
  the tokenizer and the environment's code, so that they fail before the first step.

  Raises:
    ConfigError: an environment that cannot be found, a chat template that cannot tokenize a
      conversation turn by turn or ignores the tools (``rollout.chat_template`` replaces it), a
      tool that cannot be built (the ``python`` tool without its sandbox) or whose sandbox's
      time limit is not under ``rollout.env_step_timeout_s``: one line naming the key.
  """
  r = cfg.rollout
  if not r.multi_turn:
    return None
  try:
    environment_factory(r.environment)
  except (ImportError, ValueError) as exc:
    raise ConfigError(f"rollout.environment={r.environment!r}: {exc}") from None
  if r.chat_template:
    try:
      with open(r.chat_template, encoding="utf-8") as f:
        tokenizer.chat_template = f.read()
    except OSError as exc:
      raise ConfigError(f"rollout.chat_template={r.chat_template!r}: {exc.strerror}") from None
  schemas = []
  if r.tools:
    try:
      schemas = ToolBox.from_names(r.tools, allow_unsandboxed=r.tools_allow_unsandboxed).schemas
    except ValueError as exc:
      raise ConfigError(f"rollout.tools={list(r.tools)}: {exc}") from None
    wall = SandboxLimits().wall_s
    if "python" in r.tools and not wall < r.env_step_timeout_s:
      raise ConfigError(f"rollout.env_step_timeout_s={r.env_step_timeout_s} must exceed the python "
                        f"tool's sandbox time limit ({wall} s), or every slow call ends its trajectory")
  for key, check in (("rollout.tools", lambda: check_tool_support(tokenizer, schemas)),
                     ("rollout.chat_template", lambda: check_template(tokenizer, stop_ids[0], schemas))):
    try:
      check()
    except TemplateError as exc:
      raise ConfigError(f"{key}: {exc}") from None
  return AgentParts(EnvironmentWorkers(r.env_workers, r.env_step_timeout_s), schemas,
                    tool_call_ids(tokenizer))


def sample_trajectories(cfg, agent: AgentParts, model, tokenizer, examples: list, params, seed: int,
                        mesh=None, data=None):
  """``params.n`` trajectories of each of ``examples`` (dataset rows: question, answer, extras)
  with ``model``: ``(rollouts, texts, scored, trajectories)``, the fault fraction checked.
  ``data``: the prompts' :class:`~rft_jax.data.config.DataConfig` (default ``cfg.data``).

  Raises:
    RewardError: more of the round's environment calls failed (raised, timed out, returned
      something malformed) than ``rollout.env_max_error_fraction``."""
  r = cfg.rollout
  problems = [Problem(prompt_messages(data or cfg.data, e.question), _extras(e)) for e in examples]
  trajectories = run_trajectories(model, tokenizer, problems, params, r, agent.workers, seed=seed,
                                  tools=agent.tool_schemas, mesh=mesh)
  budget = params.max_new_tokens if r.max_trajectory_tokens is None else r.max_trajectory_tokens
  _log_first_failures(trajectories, r.environment)
  try:
    check_fault_fraction(environment_counts(trajectories), r.env_max_error_fraction, r.environment)
  except EnvironmentFaultError as exc:
    raise RewardError(f"{exc} (rollout.env_max_error_fraction={r.env_max_error_fraction}); the "
                      "first failure of each kind is logged above") from None
  rollouts = trajectory_rollouts(trajectories, params.n, budget, trajectories.evictions)
  texts = [tokenizer.decode(t.ids, skip_special_tokens=False) for t in trajectories]
  return rollouts, texts, trajectory_rewards(trajectories, r.turn_rewards), trajectories


def _extras(example) -> dict:
  """A row's environment arguments: ``data.extras_field``'s, with the row's answer."""
  return {"answer": example.answer, **(example.extras or {})}


def _log_first_failures(trajectories: list[Trajectory], environment: str) -> None:
  """One warning for the first failed environment call of each kind in the round."""
  seen = set()
  for t in trajectories:
    if t.ending == "error" and t.error_kind not in seen:
      seen.add(t.error_kind)
      logger.warning("environment %s: %s of problem %d sample %d: %s", environment, t.error_kind,
                     t.problem, t.sample, t.error)


def environment_counts(trajectories: list[Trajectory]) -> EnvironmentCounts:
  """The round's environment calls by outcome: every trajectory's start and the steps it made,
  the failed one last of a trajectory that failed (a failed start: its only call)."""
  failed = [t.error_kind for t in trajectories if t.ending == "error"]
  calls = sum(1 + len(t.rewards) + (t.ending == "error" and bool(t.prompt_ids))
              for t in trajectories)
  return EnvironmentCounts(ok=calls - len(failed), error=failed.count("error"),
                           timeout=failed.count("timeout"), bad_output=failed.count("bad_output"))


def trajectory_rewards(trajectories: list[Trajectory], turn_rewards: str) -> RewardResult:
  """The trajectories' rewards as a :class:`RewardResult`: ``correct`` where the environment ended
  the trajectory and judged it so (:attr:`Trajectory.correct`), ``truncated`` where a limit cut it, ``failed`` (and
  0) where its environment failed."""
  reward = np.asarray([t.reward(turn_rewards) for t in trajectories], np.float32)
  failed = np.asarray([t.ending == "error" for t in trajectories])
  reward[failed] = 0.0
  done = np.asarray([t.ending == "done" for t in trajectories])
  correct = done & np.asarray([t.correct for t in trajectories])
  timed_out = np.asarray([t.error_kind == "timeout" for t in trajectories])
  return RewardResult(reward=reward, correct=correct, formatted=done, unformatted_correct=np.zeros_like(done),
                      truncated=np.asarray([t.ending == "truncated" for t in trajectories]),
                      timed_out=timed_out, timeouts=int(timed_out.sum()),
                      errors=int(failed.sum() - timed_out.sum()), failed=failed if failed.any() else None)
