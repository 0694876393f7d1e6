"""Checkpoints of a run with orbax: the train state and the prompt stream, together.

One checkpoint per saved step under ``RUN_DIR/checkpoints/<step>/`` holds

* ``state``: the :class:`rft_jax.rl.learner.TrainState` (parameters, optimizer state
  with its step count, the train-step counter), restored onto the shardings of a
  template state so that a resumed run keeps its layout on the mesh;
* ``meta``: JSON with the prompt-stream position and the run's seed (the sampler's
  randomness is derived from the seed and the step, so this is the RNG state).

Saving is asynchronous (the loop goes on while the arrays are written) and only the
``keep`` most recent checkpoints are kept. On several processes every process must make
the same calls (orbax coordinates them: each writes its own shards, process 0 the metadata).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class RunCheckpointer:
  """Saves and restores ``(state, meta)`` pairs of a run directory."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)))

  def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict, int]:
    """Restores the state onto ``template``'s shapes, dtypes and shardings."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return restored.state, dict(restored.meta), step

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
