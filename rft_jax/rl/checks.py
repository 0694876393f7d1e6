"""Checks of config values, each raising a one-line ``ValueError`` that names the key."""

from __future__ import annotations

import dataclasses
import math


def choice(field: str, value, choices) -> None:
  """``value`` is one of ``choices``."""
  if value not in choices:
    raise ValueError(f"{field}={value!r} is not one of {sorted(choices, key=str)}")


def finite_numbers(prefix: str, config) -> None:
  """Rejects NaN and infinite values of every numeric field (YAML accepts ``.nan`` and ``1e39``)."""
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value):
      raise ValueError(f"{prefix}.{f.name} must be a finite number, got {value!r}")


def positive(field: str, value, allow_zero: bool = False) -> None:
  """``value`` is a number > 0 (``>= 0`` with ``allow_zero``)."""
  if value is None or value < 0 or (value == 0 and not allow_zero):
    raise ValueError(f"{field} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
