"""Guess the number: the smallest multi-turn environment whose reward needs the replies.

The environment holds a secret integer in [1, 64]; each turn the model guesses, and the reply
(a user message) says "Higher." or "Lower.". A correct guess ends the episode with reward 1; so
does the last allowed turn, with reward 0. Binary search always wins within 7 guesses
(``ceil(log2(65))``: 6 guesses tell at most 2^6 - 1 = 63 numbers apart), so the default of 8
turns leaves a model that uses the replies room to win every time, and one that ignores them
about 8 / 64 of the time. It is a test bed for the multi-turn machinery (masks, replies, turn
rewards) that needs no dataset and no tools.

The environment is deterministic given its row (``extras``), as the workers' replay after a
timeout requires (``workers.py``): the secret is the row's ``secret``, or drawn from its
``seed``.

skyrl-gym's API (``init`` / ``step`` / ``close``), constructed as skyrl-gym constructs its
environments: ``GuessNumber(env_config=..., extras=row)``.
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional

from rft_jax.environments.base import Message
from rft_jax.environments.base import StepOutput

LOW, HIGH = 1, 64
DEFAULT_MAX_TURNS = 8
_INTEGER = re.compile(r"-?\d+")
INSTRUCTIONS = (f"I am thinking of an integer from {LOW} to {HIGH}. Guess it: after each guess I "
                "will say whether it is higher or lower. End each answer with your guess.")


class GuessNumber:
  """Guess the secret integer in [1, 64], told "Higher." or "Lower." after each guess.

  Args:
    env_config: the environment's config (``EnvironmentSpec.config``): ``guess_reward`` (default
      0.0), the reward of a turn whose guess is in range but wrong -- a small shaping reward for
      answering in form, off by default (skyrl-gym's GSM8K gives 0.2 / max_turns the same way).
    extras: the dataset row: ``secret`` (an int in [1, 64]), or else ``seed`` (the secret is
      drawn from it); ``max_turns`` (default 8).

  Raises:
    ValueError: a row with neither ``secret`` nor ``seed``, a secret out of range, max_turns < 1
      or a config key it does not know.
  """

  def __init__(self, env_config: Optional[dict[str, Any]] = None,
               extras: Optional[dict[str, Any]] = None):
    config = dict(env_config or {})
    extras = dict(extras or {})
    unknown = sorted(set(config) - {"guess_reward"})
    if unknown:
      raise ValueError(f"guess_number: unknown config keys {unknown}; it takes guess_reward")
    self.guess_reward = float(config.get("guess_reward", 0.0))
    if "secret" in extras:
      self.secret = int(extras["secret"])
    elif "seed" in extras:
      self.secret = random.Random(int(extras["seed"])).randint(LOW, HIGH)
    else:
      raise ValueError("guess_number needs the row's secret (extras['secret']) or a seed (extras['seed'])")
    if not LOW <= self.secret <= HIGH:
      raise ValueError(f"guess_number: secret {self.secret} is not in [{LOW}, {HIGH}]")
    self.max_turns = int(extras.get("max_turns", DEFAULT_MAX_TURNS))
    if self.max_turns < 1:
      raise ValueError(f"guess_number: max_turns must be >= 1, got {self.max_turns}")
    self.turns = 0

  def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
    """The row's prompt, or the game's instructions as a user message where it has none."""
    messages = list(prompt) if prompt else [{"role": "user", "content": INSTRUCTIONS}]
    return messages, {"max_turns": self.max_turns}

  def step(self, action: str) -> StepOutput:
    """Reads the guess (the last integer in ``action``) and replies.

    Returns:
      ``Higher.`` / ``Lower.`` as a user message (``guess_reward``); a request for a number
      when ``action`` holds none or one out of range (reward 0); no reply, reward 1 and done on
      a correct guess; done with reward 0 (or ``guess_reward``) at ``max_turns``.
    """
    self.turns += 1
    numbers = _INTEGER.findall(action)
    guess = int(numbers[-1]) if numbers else None
    last_turn = self.turns >= self.max_turns
    metadata = {"turn": self.turns, "guess": guess}
    if guess == self.secret:
      return StepOutput(observations=[], reward=1.0, done=True, metadata=metadata)
    if guess is None or not LOW <= guess <= HIGH:
      reply, reward = f"Please end your answer with a whole number from {LOW} to {HIGH}.", 0.0
    else:
      reply, reward = ("Higher." if guess < self.secret else "Lower."), self.guess_reward
    observations = [] if last_turn else [{"role": "user", "content": reply}]
    return StepOutput(observations=observations, reward=reward, done=last_turn, metadata=metadata)

  def close(self) -> None:
    """Nothing to free."""
