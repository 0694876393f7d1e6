"""The ``eval`` section of a run's config: when the run evaluates its policy, on which sets, with
how many samples per problem (:mod:`rft_jax.train.evaluate` runs it)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from rft_jax.train.config_sources import ConfigError


@dataclasses.dataclass
class EvalSetConfig:
  """One evaluation set: a name, a local file, its format and K samples per problem."""

  name: str = "val"
  path: str = ""
  format: str = "jsonl"
  k: int = 8

  def __post_init__(self):
    if self.k < 1:
      raise ConfigError(f"eval set {self.name!r}: k={self.k} must be >= 1")


@dataclasses.dataclass
class EvalConfig:
  """Evaluation every ``every`` steps (0: never) at ``temperature`` (the paper: 0.7).

  ``sets`` lists extra sets (e.g. AIME with k=32); the held-out validation split is
  evaluated with ``val_k`` samples when ``data.val_size > 0``. ``save_completions`` writes every
  sampled answer, with its score, to ``RUN_DIR/eval_completions.jsonl``. ``at_start`` also evaluates
  the starting policy of a fresh run, logged as step 0 (the evaluation after step ``s`` is
  logged at step ``s``, so step 0 is "after no update"; :mod:`rft_jax.train.step_numbers`).
  """

  every: int = 0
  at_start: bool = False
  save_completions: bool = True
  temperature: float = 0.7
  max_new_tokens: Optional[int] = None
  val_k: int = 8
  max_val_problems: Optional[int] = None
  sets: list[EvalSetConfig] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    if self.val_k < 1:
      raise ConfigError(f"eval.val_k={self.val_k} must be >= 1")
    names = [s.name for s in self.sets]
    for name in names:
      if names.count(name) > 1 or name == "val":
        raise ConfigError(f"eval.sets: the name {name!r} is " + ("used twice" if name != "val" else
                          "the held-out validation split's") + "; each set's metrics are named after it")
