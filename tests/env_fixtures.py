"""Environments for tests/test_environments.py, importable by the environment workers (``tests/``
is on sys.path before any worker starts, and workers take the trainer's sys.path)."""

import os
import random
import sys
import time


class ScriptedEnv:
  """Does what the action says: ``sleep:<seconds>``, ``raise``, ``hang``, ``exit``, ``nan`` (a NaN
  reward), ``not_a_list`` (observations as a string); any other action is recorded. Each reply
  says the turn and every action so far, and its metadata the worker's pid and what the worker
  sees of accelerators and jax. Deterministic given its row, so the workers can replay it."""

  def __init__(self, env_config=None, extras=None):
    self.name = (extras or {}).get("name", "?")
    if (env_config or {}).get("fail_to_construct"):
      raise RuntimeError("cannot construct this one")
    self.history = []

  def init(self, prompt):
    return list(prompt), {"name": self.name}

  def step(self, action):
    if action.startswith("sleep:"):
      time.sleep(float(action.split(":")[1]))
    elif action == "raise":
      raise ValueError(f"bad action {action!r}\nsecond line")
    elif action == "hang":
      time.sleep(3600)
    elif action == "exit":
      os._exit(3)
    self.history.append(action)
    observations = [{"role": "user", "content": f"{self.name} turn {len(self.history)}: {self.history}"}]
    if action == "not_a_list":
      observations = "just text"
    metadata = {"pid": os.getpid(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "jax_platforms": os.environ.get("JAX_PLATFORMS"), "jax_imported": "jax" in sys.modules}
    return {"observations": observations, "reward": float("nan") if action == "nan" else float(len(self.history)),
            "done": False, "metadata": metadata}

  def close(self):
    pass


class UnseededEnv(ScriptedEnv):
  """Rewards drawn from an unseeded generator: a replay cannot reproduce them."""

  def step(self, action):
    out = super().step(action)
    out["reward"] = random.random()
    return out
