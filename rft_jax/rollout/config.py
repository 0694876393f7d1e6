"""The ``rollout:`` keys: multi-turn trajectories with an environment (and its tools)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

TURN_REWARDS = ("sum", "last")


@dataclasses.dataclass
class RolloutConfig:
  """How a step's rollouts are made. With no ``environment`` a rollout is one completion of the
  prompt, scored by ``rewards``; with one, it is a trajectory of turns: the model's, then the
  environment's reply, until the environment says done or a limit ends it.

  Attributes:
    environment: empty (single turn), a built-in environment (``guess_number``, ``tools``), a
      skyrl-gym one (``skyrl_gym:gsm8k_multi_turn``; ``pip install 'rft_jax[agents]'``), or
      ``package.module:ClassName`` of your own (constructed as skyrl-gym's are:
      ``Class(env_config=..., extras=...)``).
    environment_config: passed to the environment as ``env_config``; each row's ``extras``
      come from ``data.extras_field``.
    tools: tool functions the model may call (``calculator``, ``python``, or
      ``package.module:function``): their schemas go into the prompt through the chat
      template's ``tools=``, and the ``tools`` environment runs the calls.
    tools_allow_unsandboxed: run the ``python`` tool without its bubblewrap sandbox when
      bubblewrap is missing (otherwise refused).
    max_turns: model turns per trajectory at most; a trajectory still going after them is cut
      (truncated).
    max_trajectory_tokens: the model's and the environment's tokens after the prompt, at most
      (None: ``sampling.max_new_tokens``); the learner's completion width.
    turn_rewards: a trajectory's reward from its turns' rewards: their ``sum`` or the ``last``.
    env_workers: worker processes that host the environments.
    env_step_timeout_s: an environment step's wall-clock limit; a step past it ends its
      trajectory (counted as a timeout).
    env_max_error_fraction: a step stops the run when more of its environment steps than this
      fraction raised, timed out or returned something malformed.
    decode_chunk: decode steps between the host's visits (ended turns handed to their
      environments, replies fed).
    keep_cache: a trajectory's KV cache is kept across its turns and each reply appended;
      False feeds the whole history again every turn (the same samples, slower).
    chat_template: a Jinja chat template file that replaces the tokenizer's for the run: one
      that renders earlier turns the same once a reply is appended (prefix-preserving; Qwen3's
      own is not, it drops past reasoning: TRL ships training variants,
      ``trl/chat_templates/qwen3_training.jinja``); empty: the tokenizer's.
  """

  environment: str = ""
  environment_config: dict[str, Any] = dataclasses.field(default_factory=dict)
  tools: list[str] = dataclasses.field(default_factory=list)
  tools_allow_unsandboxed: bool = False
  max_turns: int = 4
  max_trajectory_tokens: Optional[int] = None
  turn_rewards: str = "sum"
  env_workers: int = 4
  env_step_timeout_s: float = 30.0
  env_max_error_fraction: float = 0.25
  decode_chunk: int = 32
  keep_cache: bool = True
  chat_template: str = ""

  def __post_init__(self):
    if self.max_turns < 1:
      raise ValueError(f"rollout.max_turns={self.max_turns} must be at least 1")
    if self.max_trajectory_tokens is not None and self.max_trajectory_tokens < 1:
      raise ValueError(f"rollout.max_trajectory_tokens={self.max_trajectory_tokens} must be at "
                       "least 1")
    if self.turn_rewards not in TURN_REWARDS:
      raise ValueError(f"rollout.turn_rewards={self.turn_rewards!r} must be one of {TURN_REWARDS}")
    if self.env_workers < 1:
      raise ValueError(f"rollout.env_workers={self.env_workers} must be at least 1")
    if not self.env_step_timeout_s > 0:
      raise ValueError(f"rollout.env_step_timeout_s={self.env_step_timeout_s} must be positive")
    if not 0 <= self.env_max_error_fraction <= 1:
      raise ValueError(f"rollout.env_max_error_fraction={self.env_max_error_fraction} must be in "
                       "[0, 1]")
    if self.decode_chunk < 1:
      raise ValueError(f"rollout.decode_chunk={self.decode_chunk} must be at least 1")
    if self.tools and self.environment != "tools":
      raise ValueError(f"rollout.tools={list(self.tools)} are run by the tools environment, not "
                       f"{self.environment!r}: set rollout.environment=tools")

  @property
  def multi_turn(self) -> bool:
    return bool(self.environment)

  def environment_spec_config(self) -> dict[str, Any]:
    """The environment's ``env_config``: ``environment_config``, and for the ``tools``
    environment the tools and the sandbox setting of these keys."""
    config = dict(self.environment_config)
    if self.environment == "tools" and self.tools:
      config.update(tools=list(self.tools), allow_unsandboxed=self.tools_allow_unsandboxed)
    return config
