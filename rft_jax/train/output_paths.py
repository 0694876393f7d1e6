"""Where a command writes, checked before anything runs: a run directory (``rft-jax train``,
``demo``), an exported model's directory (``export``), a page or a plot (``plot --out``).

A path whose place is taken by a file (the path itself, or a directory above it) once ended in a
``FileExistsError`` traceback after the work was done; here it is one :class:`ConfigError` line
naming the setting, the path and the file in the way, before anything is loaded or written.
"""

from __future__ import annotations

import os

from rft_jax.train.config_sources import ConfigError


def file_in_the_way(path: str) -> str | None:
  """The file that stops ``path`` from being (or being made) a directory: ``path`` itself or the
  nearest of its parents that exists, when that is not a directory; None if there is none."""
  current = os.path.abspath(os.path.expanduser(path))
  while not os.path.exists(current):
    parent = os.path.dirname(current)
    if parent == current:
      return None
    current = parent
  return None if os.path.isdir(current) else current


def check_directory(path: str, setting: str) -> None:
  """``path`` is a directory or can be made one (:func:`file_in_the_way`)."""
  blocker = file_in_the_way(path)
  if blocker is not None:
    where = "" if os.path.abspath(blocker) == os.path.abspath(path) else " (a directory above it)"
    raise ConfigError(f"{setting} {path}: {blocker}{where} is a file, not a directory")


def check_file(path: str, setting: str) -> None:
  """``path`` can be written as a file: not a directory, and its directory can be made."""
  if os.path.isdir(path):
    raise ConfigError(f"{setting} {path}: a directory, not a file")
  blocker = file_in_the_way(os.path.dirname(os.path.abspath(path)))
  if blocker is not None:
    raise ConfigError(f"{setting} {path}: {blocker} (a directory above it) is a file, not a directory")


def check_new_directory(path: str, setting: str, *, overwrite: bool) -> None:
  """``path`` can be written as a new directory: :func:`check_directory`, and empty or absent
  unless ``overwrite`` (what is there would be mixed with what is written)."""
  check_directory(path, setting)
  held = sorted(os.listdir(path)) if os.path.isdir(path) else []
  if held and not overwrite:
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    raise ConfigError(f"{setting} {path}: not empty (holds {shown}); pass --overwrite to replace what "
                      f"is there, or name a new directory")
