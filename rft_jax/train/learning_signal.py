"""A run's learning signal: one warning when the rewards stop giving the updates a direction."""

from __future__ import annotations

import os

from rft_jax.parallel import is_main_process
from rft_jax.train.config import TrainConfig
from rft_jax.train.status import logger

NO_SIGNAL_STEPS = 5


class NoSignalWarning:
  """One warning when ``NO_SIGNAL_STEPS`` steps in a row (every step of a shorter run) had no
  learning signal: every group's ``sampling.n`` completions got the same reward, so every group
  advantage is 0 and the updates do not move the policy (a reward function that never matches
  the model's answers, a prompt the model does not answer in the expected format). Said once per
  such stretch, not at every step; a step with signal ends the stretch."""

  def __init__(self, cfg: TrainConfig, start: int):
    self.cfg = cfg
    self.threshold = max(1, min(NO_SIGNAL_STEPS, cfg.steps - start))
    self.first: int | None = None  # the stretch's first step
    self.warned = False
    self.rewards: list[float] = []

  def update(self, step: int, metrics: dict[str, float]) -> None:
    if metrics.get("zero_variance_group_frac", 0.0) < 1.0:
      self.first, self.warned, self.rewards = None, False, []
      return
    if self.first is None:
      self.first = step
    self.rewards.append(metrics.get("reward_mean", float("nan")))
    if self.warned or step - self.first + 1 < self.threshold or not is_main_process():
      return
    self.warned = True
    cfg = self.cfg
    low, high = min(self.rewards), max(self.rewards)
    rewards = f"{low:g}" if low == high else f"{low:g} to {high:g}"
    what = (f"rewards.functions={list(cfg.rewards.functions)}" if cfg.rewards.functions
            else f"the math check (rewards.extractor={cfg.rewards.extractor}: the answer it reads)")
    seen = (f"; compare the completions in {os.path.join(cfg.run_dir, 'rollouts.jsonl')} with their answers"
            if cfg.log_rollouts_every else "")
    logger.warning(
        "no learning signal in steps %d-%d: in every group the %d completions got the same reward "
        "(mean reward %s), so the rewards give the updates no direction (GRPO's advantages are all 0); check "
        "the reward, %s, against the model's answers, and the prompt and answer format "
        "(data.instruction, the answers in data.train_path)%s. Said once until a step has signal.",
        self.first, step, cfg.sampling.n, rewards, what, seen)
