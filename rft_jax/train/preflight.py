"""Checks of a training config against the files and the devices, before the model loads.

:func:`load_config` checks values; this checks what needs the disk or the device count, so that
a wrong path or a row count that cannot be split fails in the first second of a run, not at
its first evaluation (``rft-jax plan`` loads configs whose data files need not exist, so these
checks are separate):

* ``model.path``: a directory with a readable ``config.json`` of a supported model, safetensors
  weights and tokenizer files;
* ``data.train_path``: loads (format, columns, rows, UTF-8), and holds more usable rows than
  ``data.val_size``, leaving at least one batch of ``data.prompts_per_step``;
* each ``eval.sets[i].path``: loads, when evaluation is on (``eval.every`` or ``eval.at_start``);
* ``rewards.functions``: each imports; ``logging.wandb``: the wandb package is installed;
* ``run_dir``: a directory, or one that can be made (no file in its place or above it);
* ``learner.routing_replay``: the model is a mixture of experts;
* the mesh: ``mesh.data x mesh.model`` fits ``n_devices``, and every micro-batch (so every
  step's prompts x samples) splits evenly over the data-parallel devices.

Every failure is a :class:`ConfigError` naming the setting, the file and the value, except a
model directory's own files, whose :class:`~rft_jax.models.CheckpointError` names the file.
What was loaded on the way (:class:`Inputs`) is handed to the run, which reads no file twice.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import NamedTuple

from rft_jax.data import DatasetError, LoadReport, MathExample, load_math_dataset
from rft_jax.models.hf import read_config
from rft_jax.models.safetensors_io import weight_map
from rft_jax.models.tokenizer import check_tokenizer_files
from rft_jax.rewards.user_functions import load_function
from rft_jax.train.config import ConfigError, TrainConfig
from rft_jax.train.output_paths import check_directory
from rft_jax.train.resolve import mesh_axes


class Inputs(NamedTuple):
  """The data files as checked: the training rows and each evaluation set's problems."""

  train: list[MathExample]
  train_report: LoadReport
  eval_sets: dict[str, list[MathExample]]  # by eval.sets[i].name; empty when evaluation is off


def validate_for_training(cfg: TrainConfig, n_devices: int) -> Inputs:
  """Raises :class:`ConfigError` (or ``CheckpointError``) for the first input that cannot run.

  Args:
    cfg: the loaded config.
    n_devices: all devices of the run (``jax.device_count()``, every host's).

  Returns:
    The data files' contents, loaded once for the checks and the run.
  """
  data_parallel_devices(cfg, n_devices)
  check_model_dir(cfg.model.path)
  check_routing_replay(cfg)
  if cfg.model.ref_path and cfg.learner.kl_coef > 0:
    check_model_dir(cfg.model.ref_path, key="model.ref_path", tokenizer=False)
  if cfg.model.critic_path and cfg.learner.algorithm.needs_critic:
    check_model_dir(cfg.model.critic_path, key="model.critic_path", tokenizer=False)
  train, report = check_training_data(cfg)
  eval_sets = check_eval_sets(cfg)
  check_reward_functions(cfg.rewards.functions)
  check_logging(cfg)
  check_directory(cfg.run_dir, "run_dir")
  return Inputs(train, report, eval_sets)


def check_reward_functions(functions, key: str = "rewards.functions", near=()) -> None:
  """Each of ``functions`` (``module:function``) imports here: a :class:`ConfigError` naming
  ``key``, with the ``PYTHONPATH`` to set where the module is not found
  (:func:`~rft_jax.rewards.user_functions.load_function`; ``near``: directories where its file
  may be), before any model loads."""
  for name in functions:
    try:
      load_function(name, key, near)
    except ValueError as exc:
      raise ConfigError(str(exc)) from exc


def check_logging(cfg: TrainConfig) -> None:
  """``logging.wandb`` needs the (optional) wandb package."""
  if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
    raise ConfigError("logging.wandb=true needs the wandb package: pip install 'rft_jax[wandb]' "
                      "(or set logging.wandb=false)")


def data_parallel_devices(cfg: TrainConfig, n_devices: int) -> int:
  """The mesh's ``data`` size on ``n_devices`` (``mesh.data=-1``: devices / ``mesh.model``),
  checked to split every micro-batch evenly."""
  data, model = mesh_axes(cfg, n_devices)
  if cfg.mesh.data > 0:
    how = f"mesh.data={data}"
    if data * model > n_devices:
      raise ConfigError(f"mesh.data={data} x mesh.model={model} = {data * model} devices, but "
                        f"{n_devices} are available")
  else:
    how = f"mesh.data=-1: {n_devices} devices / mesh.model={model}"
    if n_devices % model:
      raise ConfigError(f"mesh.model={model} does not divide the {n_devices} devices "
                        f"(mesh.data=-1 takes all of them)")
  critic_micro = cfg.critic.micro_batch_size
  if cfg.learner.algorithm.needs_critic and critic_micro % data:
    raise ConfigError(f"critic.micro_batch_size={critic_micro} is not a multiple of the {data} "
                      f"data-parallel devices ({how})")
  micro = cfg.learner.micro_batch_size
  rollouts = cfg.data.prompts_per_step * cfg.sampling.n
  if cfg.learner.micro_batch_tokens is not None:  # packed rows are rounded up to the devices
    if rollouts % (cfg.learner.mini_batches * data):
      raise ConfigError(f"data.prompts_per_step x sampling.n = {rollouts} rollouts do not split into "
                        f"learner.mini_batches={cfg.learner.mini_batches} x the {data} data-parallel "
                        f"devices ({how})")
  elif micro % data:
    raise ConfigError(
        f"learner.micro_batch_size={micro} is not a multiple of the {data} data-parallel devices "
        f"({how}): data.prompts_per_step x sampling.n = "
        f"{cfg.data.prompts_per_step * cfg.sampling.n} rollouts must split into micro-batches "
        f"whose rows split evenly over those devices")
  return data


def check_model_dir(path: str, key: str = "model.path", tokenizer: bool = True) -> None:
  """``key`` names a model directory: config.json (parsed), weights and (``tokenizer``) a
  tokenizer."""
  if not os.path.isdir(path):
    raise ConfigError(f"{key}={path!r}: no such directory")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise ConfigError(f"{key}={path!r}: no config.json in that directory "
                      "(not a Hugging Face model directory?)")
  read_config(path)  # CheckpointError naming the file: not JSON, missing keys, unsupported
  weight_map(Path(path))  # weights present, their headers readable
  if tokenizer:
    check_tokenizer_files(path)


def check_routing_replay(cfg: TrainConfig) -> None:
  """``learner.routing_replay`` needs a mixture-of-experts policy (``model.path``'s config.json)."""
  if cfg.learner.routing_replay and not read_config(cfg.model.path).is_moe:
    raise ConfigError(f"learner.routing_replay=true needs a mixture-of-experts model; "
                      f"model.path={cfg.model.path!r} is model_type {read_config(cfg.model.path).model_type!r}")


def check_training_data(cfg: TrainConfig) -> tuple[list[MathExample], LoadReport]:
  """Loads ``data.train_path`` as the run does; returns its usable rows and the load report,
  checked against ``data.val_size`` and ``data.prompts_per_step``."""
  d = cfg.data
  try:
    examples, report = load_math_dataset(d.train_path, d.format, question_field=d.question_field,
                                         answer_field=d.answer_field, on_bad_row=d.on_bad_row,
                                         extras_field=d.extras_field)
  except DatasetError as exc:
    raise ConfigError(f"data.train_path: {exc}") from exc
  usable = len(examples)
  rows = f"{report.rows} rows" + (f" ({usable} usable)" if usable != report.rows else "")
  if d.val_size >= usable:
    raise ConfigError(f"data.val_size={d.val_size} must be below the number of training "
                      f"questions: data.train_path={d.train_path!r} has {rows}")
  left = usable - d.val_size
  if left < d.prompts_per_step:
    raise ConfigError(
        f"data.train_path={d.train_path!r} has {rows}; holding out data.val_size={d.val_size} "
        f"leaves {left}, fewer than one batch of data.prompts_per_step={d.prompts_per_step}")
  return examples, report


def check_eval_sets(cfg: TrainConfig) -> dict[str, list[MathExample]]:
  """Loads every ``eval.sets`` entry as the evaluation does (when evaluation is on); returns
  their problems by name."""
  if not (cfg.eval.every or cfg.eval.at_start):
    return {}
  sets = {}
  for i, s in enumerate(cfg.eval.sets):
    if not s.path:
      raise ConfigError(f"eval.sets[{i}] ({s.name!r}): path is required")
    try:
      sets[s.name], _ = load_math_dataset(s.path, s.format, on_bad_row="skip")
    except DatasetError as exc:
      raise ConfigError(f"eval.sets[{i}] ({s.name!r}) path: {exc}") from exc
  return sets
