"""JAX's persistent compilation cache for a run: in ``compilation_cache_dir`` if configured, else
in the directory JAX is told of (``JAX_COMPILATION_CACHE_DIR``: one cache for many runs, a
shared disk on a cluster), else in ``RUN_DIR/.jax_cache``.

A run's first step compiles the sampler (one program per prompt-length and batch bucket) and
the learner step: seconds on a CPU, minutes for the paper's models on a TPU slice. JAX can keep
every compiled program that took longer than ``jax_persistent_cache_min_compile_time_secs``
(1 s by default) in a directory, keyed by the program, the compiler options, the devices and
the JAX version, and load it in a later process instead of compiling it again: a resumed run, or
a rerun with the same shapes, starts stepping at once: the sampler's first call takes a
fraction of its compile time (``docs/results/peers.md#history``).

JAX opens its cache once per process, in the directory set at that time;
:func:`persistent_compilation_cache` reopens it in the run's directory and restores the
previous setting afterwards, so that several runs in one process (the demo's variants, a
notebook, the tests) each use their own. A failed cache write (a full disk) costs the saved
compile only: JAX warns and the run goes on.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from rft_jax.train.errors import WriteError

CACHE_DIR_NAME = ".jax_cache"


def run_cache_dir(run_dir: str, configured: str | None) -> str | None:
  """The cache directory of a run: ``configured`` if set; if None, JAX's own
  ``jax_compilation_cache_dir`` (``JAX_COMPILATION_CACHE_DIR``) where the user set one, else
  ``RUN_DIR/.jax_cache``; no cache if ''."""
  if configured is None:
    return jax.config.jax_compilation_cache_dir or os.path.join(run_dir, CACHE_DIR_NAME)
  return configured or None


@contextlib.contextmanager
def persistent_compilation_cache(path: str | None, min_compile_seconds: float | None = None
                                 ) -> Iterator[CacheUse]:
  """JAX's persistent compilation cache in ``path`` (None: none) while inside; programs that
  compile in under ``min_compile_seconds`` are not kept (None: JAX's setting). Yields a
  :class:`CacheUse`, which counts the programs loaded from the cache from then on."""
  options = {"jax_compilation_cache_dir": path}
  if min_compile_seconds is not None:
    options["jax_persistent_cache_min_compile_time_secs"] = min_compile_seconds
  previous = {name: getattr(jax.config, name) for name in options}
  if path:
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      raise WriteError(f"compilation cache {path} cannot be created ({e.strerror or e}); set "
                       f"compilation_cache_dir= to run without it") from None
  changed = previous != options
  if changed:
    jax_cache.reset_cache()
    for name, value in options.items():
      jax.config.update(name, value)
  try:
    yield CacheUse()
  finally:
    if changed:
      for name, value in previous.items():
        jax.config.update(name, value)
      jax_cache.reset_cache()


class CacheUse:
  """The programs loaded from the persistent cache since this was made (``hits``), and the
  compile seconds that saved (``seconds_saved``), from JAX's monitoring events."""

  def __init__(self):
    self._start = dict(_TOTALS)

  @property
  def hits(self) -> int:
    return _TOTALS["hits"] - self._start["hits"]

  @property
  def seconds_saved(self) -> float:
    return _TOTALS["seconds_saved"] - self._start["seconds_saved"]


_TOTALS = {"hits": 0, "seconds_saved": 0.0}  # in this process


def _on_event(event: str, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    _TOTALS["hits"] += 1


def _on_duration(event: str, seconds: float, **_) -> None:
  if event == "/jax/compilation_cache/compile_time_saved_sec":
    _TOTALS["seconds_saved"] += max(seconds, 0.0)


jax.monitoring.register_event_listener(_on_event)
jax.monitoring.register_event_duration_secs_listener(_on_duration)
