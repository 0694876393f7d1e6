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

Faults: :meth:`RunCheckpointer.wait` (the loop calls it after the step that follows a save)
returns a save's step only once its directory is committed; a save that failed in the
background (a full disk) is a :class:`WriteError` of one line naming the step, the directory
and the OS error, its partial directory is removed, and orbax's traceback goes to the
``rft_jax.debug`` logger (``RUN_DIR/debug.log``), not the console. (Orbax's own finalizing
thread can log such an error and drop it, so a save is judged by its committed directory.) A
state with non-finite parameters is never saved (:class:`NonFiniteError`); a latest checkpoint
that cannot be restored, or whose arrays fail their checksums, is moved to
``RUN_DIR/checkpoints.corrupt/`` with a one-line warning and the previous one is restored
instead.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from rft_jax.parallel import host_array, is_main_process, sync_processes
from rft_jax.rl import nonfinite
from rft_jax.train.debug_log import debug_logger, linger
from rft_jax.train.errors import CorruptCheckpointError, NonFiniteError, WriteError
from rft_jax.train.status import logger


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


@jax.jit
def _leaves_finite(tree):
  return jax.tree.map(lambda x: nonfinite.all_finite([x]), tree)


def nonfinite_arrays(tree: Any) -> list[str]:
  """The tree paths of the floating-point arrays of ``tree`` that hold NaN or infinity."""
  return [jax.tree_util.keystr(path) for path, finite in jax.tree_util.tree_leaves_with_path(
      _leaves_finite(tree)) if not bool(host_array(finite))]


class _OrbaxErrors(logging.Handler):
  """Keeps the last exception orbax logged (through absl), for a save it logged and dropped."""

  def __init__(self):
    super().__init__(logging.ERROR)
    self.last: BaseException | None = None

  def emit(self, record: logging.LogRecord) -> None:
    if record.exc_info and record.exc_info[1] is not None:
      self.last = record.exc_info[1]


class RunCheckpointer:
  """Saves and restores ``(state, meta)`` pairs of a run directory."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           create=True)
    with _writing(f"cannot create {self.directory}"):
      self._manager = ocp.CheckpointManager(self.directory, options=options,
                                            item_names=("state", "meta"))
    self._pending: int | None = None  # the step of a save started and not yet waited for
    self._failed = False  # a save failed (reported once, by wait)
    self._orbax_errors = _OrbaxErrors()
    logging.getLogger("absl").addHandler(self._orbax_errors)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Starts saving ``state`` as step ``step`` (refused if its parameters are not finite)."""
    if not all_finite(state.params):
      raise NonFiniteError(f"not saving step {step} to {self.directory}: its parameters hold NaN or "
                           f"infinity")
    self.wait()  # a save still pending is judged first, under its own step
    meta = {**meta, "checksums": state_checksums(state)}
    self._orbax_errors.last = None
    try:
      saved = self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                               meta=ocp.args.JsonSave(meta)))
    except Exception as exc:  # what is written in the calling thread (metadata, directories)
      raise self._failure(step, exc) from exc
    if not saved:
      raise WriteError(f"orbax did not save step {step} to {self.directory} (a checkpoint of that "
                       f"step exists: is another run writing here?)")
    self._pending = step

  def restore(self, template: Any, step: int | None = None, *,
              move_corrupt: bool = True, part: tuple[str, ...] = ()) -> tuple[Any, dict, int]:
    """Restores the state onto ``template``'s shapes, dtypes and shardings (abstract or concrete).

    Without ``step``, the latest checkpoint that restores and matches its checksums: a
    failing one is skipped with a warning naming its step and, with ``move_corrupt`` (a
    trainer about to save again), moved to ``checkpoints.corrupt/``. ``part``: the attribute
    path of the one subtree to read (``("params",)``: the parameters alone, no optimizer state),
    returned instead of the whole state; nothing else is read from disk.
    """
    if step is not None:
      return self._restore(template, step, part)
    failures = []
    for candidate in sorted(self.all_steps(), reverse=True):
      try:
        return self._restore(template, candidate, part)
      except CorruptCheckpointError as exc:
        failures.append(str(exc))
        if move_corrupt:
          self._move_aside(candidate)
        moved = f"moved it to {self.directory}.corrupt/, " if move_corrupt else ""
        logger.warning("%s; %strying the previous checkpoint", exc, moved)
        debug_logger.warning("checkpoint of step %d does not restore", candidate, exc_info=exc.__cause__)
        linger()  # orbax's abandoned reads report when they are collected
    if failures:
      raise CorruptCheckpointError("no checkpoint restores: " + "; ".join(failures))
    raise FileNotFoundError(f"no checkpoint in {self.directory}")

  def _restore(self, template: Any, step: int, part: tuple[str, ...] = ()) -> tuple[Any, dict, int]:
    path = os.path.join(self.directory, str(step))
    if step not in self.all_steps():
      raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}")
    for name in part:
      template = getattr(template, name)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    if part:  # orbax's partial restore: the subtree at its path in the saved state, nothing else
      item = abstract
      for name in reversed(part):
        item = {name: item}
      state_args = ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                          partial_restore=True)
    else:
      state_args = ocp.args.StandardRestore(abstract)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore()))
    except Exception as exc:  # orbax / tensorstore raise many kinds on torn files
      raise CorruptCheckpointError(f"checkpoint {path} (step {step}) does not restore: "
                                   f"{_root_cause(exc)}") from exc
    state = restored.state
    for name in part:
      state = state[name]
    meta = dict(restored.meta)
    expected = meta.pop("checksums", None)
    if expected is not None:
      prefix = "".join(f".{name}" for name in part)  # the subtree's keys in the whole state's
      bad = [prefix + k for k, v in state_checksums(state).items() if expected.get(prefix + k) != v]
      if bad:
        raise CorruptCheckpointError(f"checkpoint {path} (step {step}) fails its checksum in "
                                     f"{len(bad)} array(s), e.g. state{bad[0]}")
    return state, meta, step

  def _move_aside(self, step: int) -> None:
    if is_main_process():
      target = os.path.join(f"{self.directory}.corrupt", str(step))
      shutil.rmtree(target, ignore_errors=True)
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.move(os.path.join(self.directory, str(step)), target)
    sync_processes("rft_jax.move_corrupt_checkpoint")
    self._manager.reload()

  def wait(self) -> int | None:
    """Blocks until the pending save is on disk; returns its step once its directory is
    committed (None if no save was pending).

    Raises :class:`WriteError` ``cannot save step N to DIR: <OS error>`` if it failed (its
    partial directory removed, orbax's traceback sent to the debug log).
    """
    step, self._pending = self._pending, None
    try:
      self._manager.wait_until_finished()
      error = None
    except Exception as exc:  # the background save's error, raised here by orbax
      error = exc
    if step is None:
      if error is not None:
        raise WriteError(f"saving a checkpoint to {self.directory} failed: {_os_error(error)}") from error
      return None
    if error is None and os.path.isdir(os.path.join(self.directory, str(step))):
      return step
    error = error or self._orbax_errors.last
    raise self._failure(step, error) from error

  def _failure(self, step: int, error: BaseException | None) -> WriteError:
    """The one-line error of a save of ``step`` that failed with ``error`` (None: orbax did not
    say why), its traceback sent to the debug log and its partial directory removed."""
    self._failed = True
    linger()  # orbax's abandoned writes report when they are collected, at exit: not on the console
    if is_main_process():  # first: on a full disk, that makes room for the debug log's traceback
      for partial in glob.glob(os.path.join(glob.escape(self.directory), f"{step}.orbax-checkpoint-tmp*")):
        shutil.rmtree(partial, ignore_errors=True)
    debug_logger.error("saving step %d to %s failed", step, self.directory, exc_info=error)
    reason = _os_error(error) if error is not None else "orbax did not commit it"
    return WriteError(f"cannot save step {step} to {self.directory}: {reason}")

  def close(self) -> None:
    """Waits for the pending save (:meth:`wait`) and closes orbax's manager; a failure that
    :meth:`wait` has already raised is not raised again."""
    reported = self._failed
    failure = None
    try:
      self.wait()
    except WriteError as exc:
      failure = None if reported else exc
    try:
      self._manager.close()
    except Exception as exc:  # orbax re-raises a background error it has raised before
      if not self._failed and failure is None:
        failure = WriteError(f"saving a checkpoint to {self.directory} failed: {_os_error(exc)}")
        failure.__cause__ = exc
    logging.getLogger("absl").removeHandler(self._orbax_errors)
    if failure is not None:
      raise failure


def _chain(exc: BaseException) -> list[BaseException]:
  """``exc`` and the exceptions it was raised from, outermost first."""
  chain = []
  while exc is not None and exc not in chain:
    chain.append(exc)
    exc = exc.__cause__ or exc.__context__
  return chain


def _root_cause(exc: BaseException) -> str:
  """One short line of the innermost error under ``exc`` (TensorStore's first errors carry a
  multi-line spec; the innermost says what is wrong with the file)."""
  root = _chain(exc)[-1]
  text = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
  text = re.sub(r' in OCDBT database at local file "[^"]*"', "", text)
  return text if len(text) <= 200 else text[:197] + "..."


def _os_error(exc: BaseException) -> str:
  """The OS error under an orbax / TensorStore failure (``No space left on device (errno 28)``),
  else :func:`_root_cause`."""
  for cause in _chain(exc):
    if isinstance(cause, OSError) and cause.errno:
      return f"{cause.strerror or os.strerror(cause.errno)} (errno {cause.errno})"
    code = re.search(r"os_error_code='(\d+)'", str(cause))
    if code:
      return f"{os.strerror(int(code[1]))} (errno {code[1]})"
  return _root_cause(exc)


@contextlib.contextmanager
def _writing(what: str):
  """Re-raises what orbax raises while writing as a :class:`WriteError` starting with ``what``."""
  try:
    yield
  except WriteError:
    raise
  except Exception as exc:
    raise WriteError(f"{what}: {_os_error(exc)}") from exc


def restore_policy(run_dir: str, step: int | None = None, mesh=None):
  """The policy of a run's checkpoint, restored onto ``mesh`` (default: the run's ``mesh``
  section on this process's devices) in the run's dtypes: the parameters of the abstract state of
  :func:`rft_jax.train.run_state.run_state` are the restore's target, so each array is read
  directly into its shards, never through an unsharded float32 copy, and nothing else is read
  (AdamW's moments, a PPO run's critic). A LoRA run's policy comes back merged (a plain model, its
  targeted weights ``W + alpha/r A B`` computed on the mesh, shard by shard).

  Returns:
    ``(model, config, step)``: the policy, the run's config and the step restored.
  """
  import dataclasses

  from rft_jax.train.config import load_config
  from rft_jax.train.run_state import run_mesh, run_state

  cfg = load_config(os.path.join(run_dir, "config.yaml"))
  built = run_state(cfg, run_mesh(cfg) if mesh is None else mesh)
  policy = built.state if built.critic is None else built.state.policy
  checkpointer = RunCheckpointer(os.path.join(run_dir, "checkpoints"))
  try:  # the policy's parameters alone: neither AdamW's moments nor a critic is read
    params, _, restored = checkpointer.restore(built.state, step, move_corrupt=False,
                                               part=("params",) if built.critic is None else ("policy", "params"))
  finally:
    checkpointer.close()
  return built.learner.model(dataclasses.replace(policy, params=params)), cfg, restored
