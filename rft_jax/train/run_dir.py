"""The run directory: one trainer at a time, never two runs mixed, an honest resume.

* :class:`RunDirLock`: ``RUN_DIR/trainer.lock`` held (``flock``) while a trainer runs; a
  second trainer is refused with the holder's PID. The kernel releases the lock when its
  process ends, however it ends, so a killed trainer's directory is free again at once.
* :func:`prepare_run_dir`: a fresh start (``--no-resume``) refuses a directory that holds
  an earlier run's checkpoints or metrics unless ``overwrite`` (which deletes them); a resume
  compares the new config with the run's ``config.yaml`` and refuses changes that would make
  the run differ from an uninterrupted one (:data:`CHANGEABLE_ON_RESUME` lists what may
  change), unless ``allow_config_change``; the old config is kept as ``config.<n>.yaml``. A
  resume of a run that already holds its ``steps`` changes nothing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from typing import Any

from omegaconf import OmegaConf

from rft_jax.train.config import PATH_KEYS, TrainConfig, absolute_path, to_yaml
from rft_jax.train.errors import RunDirError
from rft_jax.train.metrics_log import renumber_run_files
from rft_jax.train.renamed_keys import rename_keys
from rft_jax.train.status import logger

LOCK_FILE = "trainer.lock"
# What a resumed run may change without --allow-config-change: how long it runs, where and how
# it logs, checkpoints and evaluates, and memory layout (the same maths; a different mesh or
# micro-batch may change float rounding).
CHANGEABLE_ON_RESUME = ("run_dir", "steps", "progress", "checkpoint_every", "keep_checkpoints",
                        "compilation_cache_dir", "max_nonfinite_steps", "eval.", "mesh.",
                        "model.remat", "model.attention", "sampling.max_rollouts_per_call",
                        "sampling.scheduler", "sampling.decode_slots",
                        "sampling.kv_pages", "sampling.page_size",
                        "learner.micro_batch_size", "learner.micro_batch_tokens",
                        "learner.stats_chunk_size",
                        "learner.forecast_every", "log_rollouts_every", "logging.",
                        "rewards.max_error_fraction")
# What belongs to a run (deleted by overwrite).
RUN_FILES = ("checkpoints", "checkpoints.corrupt", "metrics.jsonl", "tensorboard", "rollouts.jsonl",
             "eval_completions.jsonl", "wandb_run_id", "debug.log")  # not wandb/: offline W&B runs may be unsynced


class RunDirLock:
  """An exclusive lock on a run directory for the life of a trainer (a context manager)."""

  def __init__(self, run_dir: str):
    self.path = os.path.join(run_dir, LOCK_FILE)
    self._fd: int | None = None

  def __enter__(self) -> "RunDirLock":
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
      os.close(fd)
      raise RunDirError(f"{os.path.dirname(self.path)} is in use by another trainer (process "
                        f"{holder}); wait for it to end or stop it") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode())
    self._fd = fd
    return self

  def __exit__(self, *exc) -> None:
    if self._fd is not None:
      os.ftruncate(self._fd, 0)
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None


def checkpoint_steps(run_dir: str) -> list[int]:
  """The steps of the checkpoints in ``RUN_DIR/checkpoints`` (orbax's step directories)."""
  directory = os.path.join(run_dir, "checkpoints")
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def finished_steps(cfg: TrainConfig, *, resume: bool) -> int | None:
  """The step of a resumed run's latest checkpoint when it reaches ``cfg.steps``: a run that has
  nothing left to do if that checkpoint restores (a corrupt one falls back to an earlier step).
  None otherwise, and without ``resume``."""
  steps = checkpoint_steps(cfg.run_dir) if resume else []
  return steps[-1] if steps and steps[-1] >= cfg.steps else None


def prepare_run_dir(cfg: TrainConfig, *, resume: bool, overwrite: bool = False,
                    allow_config_change: bool = False, check_only: bool = False) -> None:
  """Makes ``cfg.run_dir`` ready for this run and writes its ``config.yaml`` (see the module
  docstring); a resumed run written before the step numbers of :mod:`rft_jax.train.step_numbers`
  has its files renumbered. Raises :class:`RunDirError` (changing nothing) when it cannot be used
  as asked. ``check_only`` (a resume of a run that may be finished, :func:`finished_steps`):
  refuses what it would refuse and changes nothing."""
  run_dir = cfg.run_dir
  steps = checkpoint_steps(run_dir)
  metrics = os.path.join(run_dir, "metrics.jsonl")
  config_path = os.path.join(run_dir, "config.yaml")
  changes = []
  if overwrite:
    for name in RUN_FILES + tuple(n for n in _listdir(run_dir) if n.startswith(("config.", "debug."))):
      path = os.path.join(run_dir, name)
      if os.path.isdir(path):
        shutil.rmtree(path)
      elif os.path.exists(path):
        os.remove(path)
  elif not resume and (steps or os.path.exists(metrics)):
    held = f"checkpoints of steps {steps}" if steps else "metrics.jsonl"
    raise RunDirError(f"{run_dir} holds {held} of an earlier run; starting over there would mix "
                      f"two runs: pass --overwrite to delete them, or set run_dir to a new "
                      f"directory")
  elif resume and steps and os.path.exists(config_path):
    old = rename_keys(OmegaConf.load(config_path), config_path)  # a run directory of an older version
    changes = config_changes(OmegaConf.to_container(old), cfg)
    refused = [c for c in changes if not c[0].startswith(CHANGEABLE_ON_RESUME)]
    if refused and not allow_config_change:
      listed = ", ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in refused)
      raise RunDirError(f"resuming {run_dir} (checkpoint of step {steps[-1]}) with a config that "
                        f"differs from its config.yaml in {listed}; the run would not repeat an "
                        f"uninterrupted one: pass --allow-config-change to resume anyway, or use a "
                        f"new run_dir")
  if check_only:
    return
  if changes:
    os.replace(config_path, _next_free(run_dir))
  if resume and steps and renumber_run_files(run_dir):
    logger.info("renumbered the steps of %s's metrics and completions from 1 (step 0: the start), as "
                "this version writes them", run_dir)
  os.makedirs(run_dir, exist_ok=True)
  with open(config_path, "w") as f:
    f.write(to_yaml(cfg))


def config_changes(old: dict, cfg: TrainConfig) -> list[tuple[str, Any, Any]]:
  """``(dotted key, old value, new value)`` for every setting of ``old`` (a loaded
  ``config.yaml``) that ``cfg`` sets differently (paths compared made absolute, as
  :func:`rft_jax.train.config.load_config` makes them)."""
  new = _flatten(OmegaConf.to_container(OmegaConf.structured(cfg)))
  old = _flatten(old)
  for key in PATH_KEYS:
    if isinstance(old.get(key), str):
      old[key] = absolute_path(old[key])
  for eval_set in old.get("eval.sets") or []:
    if isinstance(eval_set, dict) and isinstance(eval_set.get("path"), str):
      eval_set["path"] = absolute_path(eval_set["path"])
  return [(key, value, new[key]) for key, value in old.items() if key in new and new[key] != value]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):  # a tuple setting (model.lora.targets) reads back as a list
    return {prefix[:-1]: list(tree) if isinstance(tree, tuple) else tree}
  flat = {}
  for key, value in tree.items():
    flat.update(_flatten(value, f"{prefix}{key}."))
  return flat


def _next_free(run_dir: str) -> str:
  n = 1
  while os.path.exists(os.path.join(run_dir, f"config.{n}.yaml")):
    n += 1
  return os.path.join(run_dir, f"config.{n}.yaml")


def _listdir(path: str) -> list[str]:
  return os.listdir(path) if os.path.isdir(path) else []
