"""Config keys that moved, and the one-line notice that keeps old configs and run directories
loading: ``learner.lr`` and the other optimizer fields of ``learner`` and ``critic`` now live
under ``learner.optim`` and ``critic.optim`` (``rft_jax.rl.optimizer.OptimizerConfig``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from rft_jax.rl.optimizer import OptimizerConfig

_log = logging.getLogger(__name__)

RENAMED = {f"{section}.{f.name}": f"{section}.optim.{f.name}"
           for section in ("learner", "critic") for f in dataclasses.fields(OptimizerConfig)}


def _notice(where: str, old: Sequence[str]) -> None:
  new = ", ".join(RENAMED[k] for k in old)
  _log.warning("%s: %s %s deprecated: use %s", where, ", ".join(old), "is" if len(old) == 1 else "are", new)


def renamed_overrides(overrides: Sequence[str], where: str = "the command line") -> list[str]:
  """``overrides`` (``key=value``) with every moved key given its new name, and one notice."""
  out, old = [], []
  for override in overrides:
    key, sep, value = override.partition("=")
    if sep and key.strip() in RENAMED:
      old.append(key.strip())
      override = f"{RENAMED[key.strip()]}={value}"
    out.append(override)
  if old:
    _notice(where, old)
  return out


def rename_keys(config: DictConfig, where: str) -> DictConfig:
  """Moves the moved keys of a loaded YAML mapping to their new place (in place), with one notice;
  a key set under both names keeps the new one's value. An old ``total_steps`` beside a constant
  schedule (every old ``config.yaml`` wrote the default 1000) had no effect and is dropped."""
  old = []
  for section in ("learner", "critic"):
    node = config.get(section) if OmegaConf.is_dict(config) else None
    if not OmegaConf.is_dict(node):
      continue
    moved = [key for key in RENAMED if key.startswith(f"{section}.") and key.split(".")[1] in node]
    if not moved:
      continue
    if not OmegaConf.is_dict(node.get("optim")):
      node["optim"] = {}
    constant = node.get("schedule", node["optim"].get("schedule", "constant")) == "constant"
    for key in moved:
      field = key.split(".")[1]
      value = node.pop(field)
      if field not in node["optim"] and not (field == "total_steps" and constant):
        node["optim"][field] = value
    old += moved
  if old:
    _notice(where, old)
  return config
