"""Checkpoints of a run with orbax: the train state and the prompt stream, together.

One checkpoint per saved step under ``RUN_DIR/checkpoints/<step>/`` holds

* ``state``: the :class:`rft_jax.rl.learner.TrainState` (parameters, optimizer state
  with its step count, the train-step counter), restored onto the shardings of a
  template state so that a resumed run keeps its layout on the mesh;
* ``meta``: JSON with the prompt-stream position and the run's seed (the sampler's
  randomness is derived from the seed and the step, so this is the RNG state), and a
  checksum of every array of ``state`` (:func:`state_checksums`).

Saving is asynchronous (the loop goes on while the arrays are written) and only the
``keep`` most recent checkpoints are kept. On several processes every process must make
the same calls (orbax coordinates them: each writes its own shards, process 0 the metadata).

Faults: a save that fails in the background is reported by :meth:`RunCheckpointer.check`
(the loop calls it after every step) as a :class:`WriteError`; a state with non-finite
parameters is never saved (:class:`NonFiniteError`); a latest checkpoint that cannot be
restored, or whose arrays fail their checksums, is moved to ``RUN_DIR/checkpoints.corrupt/``
with a warning and the previous one is restored instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from rft_jax.parallel import host_array, is_main_process, sync_processes
from rft_jax.rl import nonfinite
from rft_jax.train.errors import CorruptCheckpointError, NonFiniteError, WriteError


@jax.jit
def _checksums(tree):
  def checksum(x):
    x = jnp.asarray(x)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    # Odd weights 2i + 1 of the row-major index i: one flipped bit always changes the sum
    # (mod 2^32), and addition is exact whatever the layout of the shards.
    index = jnp.zeros(x.shape, jnp.uint32)
    for axis, size in enumerate(x.shape):
      index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
    return jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)

  return jax.tree.map(checksum, tree)


def state_checksums(state: Any) -> dict[str, int]:
  """A 32-bit, position-weighted sum of the bits of every array of ``state``, by tree path."""
  sums = _checksums(state)
  return {jax.tree_util.keystr(path): int(host_array(value))
          for path, value in jax.tree_util.tree_leaves_with_path(sums)}


_all_finite = jax.jit(nonfinite.all_finite)


def all_finite(tree: Any) -> bool:
  """Whether every floating-point array of ``tree`` is free of NaN and infinity."""
  return bool(host_array(_all_finite(tree)))


class RunCheckpointer:
  """Saves and restores ``(state, meta)`` pairs of a run directory."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           create=True)
    with _writing(f"cannot create {self.directory}"):
      self._manager = ocp.CheckpointManager(self.directory, options=options,
                                            item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Starts saving ``state`` as step ``step`` (refused if its parameters are not finite)."""
    if not all_finite(state.params):
      raise NonFiniteError(f"not saving step {step} to {self.directory}: its parameters hold NaN or "
                           f"infinity")
    self.check()
    meta = {**meta, "checksums": state_checksums(state)}
    with _writing(f"cannot save step {step} to {self.directory}"):
      saved = self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                               meta=ocp.args.JsonSave(meta)))
    if not saved:
      raise WriteError(f"orbax did not save step {step} to {self.directory} (a checkpoint of that "
                       f"step exists: is another run writing here?)")

  def check(self) -> None:
    """Raises :class:`WriteError` if a background save has failed (e.g. the disk is full)."""
    with _writing(f"saving a checkpoint to {self.directory} failed"):
      self._manager.check_for_errors()

  def restore(self, template: Any, step: int | None = None, *,
              move_corrupt: bool = True) -> tuple[Any, dict, int]:
    """Restores the state onto ``template``'s shapes, dtypes and shardings.

    Without ``step``, the latest checkpoint that restores and matches its checksums: a
    failing one is skipped with a warning naming its step and, with ``move_corrupt`` (a
    trainer about to save again), moved to ``checkpoints.corrupt/``.
    """
    if step is not None:
      return self._restore(template, step)
    failures = []
    for candidate in sorted(self.all_steps(), reverse=True):
      try:
        return self._restore(template, candidate)
      except CorruptCheckpointError as exc:
        failures.append(str(exc))
        if move_corrupt:
          self._move_aside(candidate)
        moved = f"moved it to {self.directory}.corrupt/, " if move_corrupt else ""
        warnings.warn(f"{exc}; {moved}trying the previous checkpoint", stacklevel=2)
    if failures:
      raise CorruptCheckpointError("no checkpoint restores: " + "; ".join(failures))
    raise FileNotFoundError(f"no checkpoint in {self.directory}")

  def _restore(self, template: Any, step: int) -> tuple[Any, dict, int]:
    path = os.path.join(self.directory, str(step))
    if step not in self.all_steps():
      raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    except Exception as exc:  # orbax / tensorstore raise many kinds on torn files
      raise CorruptCheckpointError(f"checkpoint {path} (step {step}) does not restore: "
                                   f"{_first_line(exc)}") from exc
    meta = dict(restored.meta)
    expected = meta.pop("checksums", None)
    if expected is not None:
      bad = [k for k, v in state_checksums(restored.state).items() if expected.get(k) != v]
      if bad:
        raise CorruptCheckpointError(f"checkpoint {path} (step {step}) fails its checksum in "
                                     f"{len(bad)} array(s), e.g. state{bad[0]}")
    return restored.state, meta, step

  def _move_aside(self, step: int) -> None:
    if is_main_process():
      target = os.path.join(f"{self.directory}.corrupt", str(step))
      shutil.rmtree(target, ignore_errors=True)
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.move(os.path.join(self.directory, str(step)), target)
    sync_processes("rft_jax.move_corrupt_checkpoint")
    self._manager.reload()

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk."""
    with _writing(f"saving a checkpoint to {self.directory} failed"):
      self._manager.wait_until_finished()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._manager.close()


def _first_line(exc: BaseException) -> str:
  text = str(exc).strip()
  return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


@contextlib.contextmanager
def _writing(what: str):
  """Re-raises what orbax raises while writing as a :class:`WriteError` starting with ``what``."""
  try:
    yield
  except WriteError:
    raise
  except Exception as exc:
    raise WriteError(f"{what}: {_first_line(exc)}") from exc


def restore_policy(run_dir: str, step: int | None = None):
  """The policy of a run's checkpoint (the base model's structure, the run's parameters; a PPO
  run's critic is restored with it and dropped).

  Returns:
    ``(model, config, step)``: the policy, the run's config and the step restored.
  """
  from rft_jax.models import load_hf
  from rft_jax.rl.learner import Learner
  from rft_jax.train.config import load_config

  cfg = load_config(os.path.join(run_dir, "config.yaml"))
  model = load_hf(cfg.model.path)
  learner = Learner(model, cfg.learner)
  template = learner.init(model)
  if cfg.learner.advantage == "gae":  # PPO's checkpoints hold the critic too; only the policy is used
    from flax import nnx

    from rft_jax.rl.critic import ActorCriticState, Critic, ValueModel

    value_model = ValueModel.from_policy(load_hf(cfg.model.path), rngs=nnx.Rngs(0))
    template = ActorCriticState(policy=template, critic=Critic(value_model, cfg.critic).init(value_model))
  checkpointer = RunCheckpointer(os.path.join(run_dir, "checkpoints"))
  state, _, restored = checkpointer.restore(template, step, move_corrupt=False)
  checkpointer.close()
  return learner.model(state), cfg, restored
