"""The run's one config tree: dataclasses as the schema, YAML + dotted CLI overrides merged
by OmegaConf (structured configs), so an unknown key or a wrong type is an error naming it.

    cfg = load_config("configs/demo.yaml", ["learner.optim.lr=1e-6", "sampling.n=8"])

Cross-field checks (batch sizes that must divide, the sampling temperature the learner's
statistics use) run when the config is loaded, not at step 1 on a GPU. Relative paths
(:data:`PATH_KEYS`, each ``eval.sets[i].path``) are resolved against the current directory
when the config is loaded and kept absolute, so the run's ``config.yaml`` reads the same
from any directory.

Some sections are defined by the packages they configure: ``data``
(:class:`rft_jax.data.config.DataConfig`), ``learner`` (:mod:`rft_jax.rl.config`), ``critic``
(:mod:`rft_jax.rl.advantages.critic`), ``rewards`` (:mod:`rft_jax.rewards`), ``sampling``
(:class:`rft_jax.sampling.SamplingParams`), ``eval`` (:mod:`rft_jax.train.eval_config`). Reading
the YAML file and the overrides, and :class:`ConfigError`, are :mod:`rft_jax.train.config_sources`'.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rft_jax.data.config import DataConfig
from rft_jax.models.config import ATTENTION_KINDS, DECODE_KERNEL_KINDS
from rft_jax.models.lora import LoraConfig
from rft_jax.rewards import RewardConfig
from rft_jax.rl.config import LearnerConfig
from rft_jax.rl.advantages.critic import CriticConfig
from rft_jax.rollout.config import RolloutConfig
from rft_jax.sampling.params import SamplingParams
from rft_jax.train.config_sources import ConfigError, describe_error, load_yaml, parse_overrides
from rft_jax.train.eval_config import EvalConfig, EvalSetConfig  # noqa: F401 (imported from here)
from rft_jax.train.renamed_keys import renamed_overrides


@dataclasses.dataclass
class ModelConfig:
  """The policy: a Hugging Face Qwen directory (config.json + safetensors + tokenizer).

  Attributes:
    path: the directory (required).
    dtype / param_dtype: compute and storage dtypes (``float32`` or ``bfloat16``).
    remat: rematerialise each decoder layer in the backward pass.
    attention: causal self-attention of the learner's forward and the sampler's prefill:
      ``auto`` (splash kernel on TPU, cuDNN flash attention on GPU with 16-bit activations,
      else ``blockwise``), or one of ``blockwise``, ``cudnn``, ``splash``, ``reference`` (the
      materialised ``[B, N, T, T]`` einsum, for checks).
    decode_kernels: the sampler's decode step on an accelerator: ``auto`` (five Pallas kernels
      a layer on one GPU where they take the shapes, else XLA's), ``xla``, ``fused``, or
      ``fused_interpret`` (Pallas' interpret mode; for tests) (``QwenConfig.decode_kernels``).
    ref_path: the reference policy of the KL term (``learner.kl_coef > 0``), another HF
      directory of the same architecture; empty: the starting weights (``path``).
    critic_path: the decoder PPO's critic starts from (``learner.advantage: gae``), an HF
      directory of the policy's architecture; empty: a copy of the policy's starting weights.
    lora: train LoRA adapters of the policy instead of all its weights
      (:class:`~rft_jax.models.lora.LoraConfig`: ``rank``, ``alpha``, ``targets``; e.g.
      ``model.lora.rank=16``); null (the default): full fine-tuning. The base weights stay
      frozen in ``param_dtype`` (``bfloat16`` halves them); the adapters and their AdamW
      moments are float32. A PPO critic is trained in full.
  """

  path: str = ""
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  attention: str = "auto"
  decode_kernels: str = "auto"
  ref_path: str = ""
  critic_path: str = ""
  lora: Optional[LoraConfig] = None

  def __post_init__(self):
    if self.attention not in ATTENTION_KINDS:
      raise ConfigError(f"model.attention={self.attention!r} is not one of {list(ATTENTION_KINDS)}")
    if self.decode_kernels not in DECODE_KERNEL_KINDS:
      raise ConfigError(f"model.decode_kernels={self.decode_kernels!r} is not one of "
                        f"{list(DECODE_KERNEL_KINDS)}")


def rollout_sampling() -> SamplingParams:
  """The ``sampling`` section's defaults: :class:`~rft_jax.sampling.SamplingParams`, the schema
  of the section (every key declared, documented and checked there, once), with a run's
  defaults: 16 completions per prompt, at most 1,024 new tokens. A run's stop tokens are its
  tokenizer's end-of-sequence ids and then ``sampling.stop_token_ids``
  (:func:`rft_jax.train.resolve.sampling_params`)."""
  return SamplingParams(n=16, max_new_tokens=1024)


@dataclasses.dataclass
class LoggingConfig:
  """Where metrics go besides ``metrics.jsonl`` and TensorBoard (always written).

  Attributes:
    wandb: also log every metric to Weights & Biases (needs ``pip install 'rft_jax[wandb]'``;
      never required otherwise). The W&B run lives in ``RUN_DIR/wandb`` and is resumed with the
      training run.
    wandb_project / wandb_entity: the W&B project and entity (None: your default entity).
    wandb_mode: ``online``, or ``offline`` to write the run under ``RUN_DIR/wandb`` without a
      network (``wandb sync`` uploads it later).
  """

  wandb: bool = False
  wandb_project: str = "rft_jax"
  wandb_entity: Optional[str] = None
  wandb_mode: str = "online"

  def __post_init__(self):
    if self.wandb_mode not in ("online", "offline"):
      raise ConfigError(f"logging.wandb_mode={self.wandb_mode!r} is not one of ['offline', 'online']")


@dataclasses.dataclass
class MeshConfig:
  """Device mesh: ``data`` x ``model`` devices (``data=-1``: all devices / model)."""

  data: int = -1
  model: int = 1

  def __post_init__(self):
    if self.data != -1 and self.data < 1:
      raise ConfigError(f"mesh.data={self.data} must be -1 (all devices / mesh.model) or >= 1")
    if self.model < 1:
      raise ConfigError(f"mesh.model={self.model} must be >= 1")


@dataclasses.dataclass
class TrainConfig:
  """A training run.

  Attributes:
    run_dir: where metrics, checkpoints, plots and the resolved config go.
    seed: seeds the data order, the sampler and everything else.
    steps: training steps (batches), numbered 1 to ``steps`` in the run's files and lines
      (:mod:`rft_jax.train.step_numbers`).
    dynamic_sampling: drop groups whose rewards all agree (zero advantage) and refill
      with fresh prompts, up to ``max_refills`` extra sampling rounds per step.
    checkpoint_every: save a checkpoint every this many steps (0: only at the end; a run
      stopped by a signal or an error saves its last step too).
    keep_checkpoints: how many of the latest checkpoints to keep on disk (older ones are deleted;
      at least 1).
    progress: show a progress bar.
    compilation_cache_dir: where JAX keeps compiled programs across processes, so that a
      resumed run or a rerun skips the compilations it has seen before (None, the default:
      JAX's ``JAX_COMPILATION_CACHE_DIR`` if set, else ``RUN_DIR/.jax_cache``; '' = off;
      :mod:`rft_jax.train.compilation_cache`).
    max_nonfinite_steps: the run stops with an error after this many consecutive steps whose
      loss or gradient norm was not finite (each such step is skipped: parameters and
      optimizer state unchanged).
    log_rollouts_every: the completions of step 1 and of every this many steps after it (1, 11,
      21, ... for 10; 0: never) go to ``RUN_DIR/rollouts.jsonl``: prompt, completion, answer,
      reward, advantage, and the completion's mean entropy, mean S_* and entropy-masked token
      count (a multi-turn trajectory's turns too, with their roles and ids).
    rollout: single-turn completions, or multi-turn trajectories with an environment and its
      tools (:class:`~rft_jax.rollout.config.RolloutConfig`).

  Checks that need files or the device count (paths, row counts, the data-parallel split)
  are :func:`rft_jax.train.preflight.validate_for_training`'s, run before the model loads.
  """

  run_dir: str = "runs/default"
  seed: int = 0
  steps: int = 100
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  sampling: SamplingParams = dataclasses.field(default_factory=rollout_sampling)
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
  learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
  rewards: RewardConfig = dataclasses.field(default_factory=RewardConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
  logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
  dynamic_sampling: bool = False
  max_refills: int = 0
  checkpoint_every: int = 0
  keep_checkpoints: int = 3
  progress: bool = True
  compilation_cache_dir: str | None = None
  max_nonfinite_steps: int = 3
  log_rollouts_every: int = 10

  def __post_init__(self):
    if self.model.dtype not in ("float32", "bfloat16") or self.model.param_dtype not in ("float32", "bfloat16"):
      raise ConfigError(f"model.dtype / model.param_dtype must be float32 or bfloat16, got "
                        f"{self.model.dtype!r} / {self.model.param_dtype!r}")
    if self.data.prompts_per_step <= 0:
      raise ConfigError(f"data.prompts_per_step must be > 0, got {self.data.prompts_per_step}")
    if self.data.val_size < 0:
      raise ConfigError(f"data.val_size must be >= 0, got {self.data.val_size}")
    if self.rollout.multi_turn:
      self._check_multi_turn()
    rollouts = self.data.prompts_per_step * self.sampling.n
    if self.learner.micro_batch_tokens is not None:  # packed micro-batches: any rows per mini-batch
      if rollouts % self.learner.mini_batches:
        raise ConfigError(f"data.prompts_per_step x sampling.n = {rollouts} rollouts do not split into "
                          f"learner.mini_batches={self.learner.mini_batches}")
    elif rollouts % (self.learner.micro_batch_size * self.learner.mini_batches):
      raise ConfigError(
          f"data.prompts_per_step x sampling.n = {rollouts} rollouts do not split into "
          f"learner.mini_batches={self.learner.mini_batches} x learner.micro_batch_size="
          f"{self.learner.micro_batch_size}")
    if self.learner.algorithm.needs_critic and rollouts % self.critic.micro_batch_size:
      raise ConfigError(f"data.prompts_per_step x sampling.n = {rollouts} rollouts do not split into "
                        f"critic.micro_batch_size={self.critic.micro_batch_size}")
    if (self.mesh.data > 0 and self.learner.micro_batch_tokens is None
        and self.learner.micro_batch_size % self.mesh.data):
      raise ConfigError(f"learner.micro_batch_size={self.learner.micro_batch_size} is not a multiple "
                        f"of mesh.data={self.mesh.data}")
    if self.sampling.n < 2:
      raise ConfigError(f"sampling.n={self.sampling.n}: group advantages need at least 2 samples per prompt")
    if self.sampling.temperature <= 0:
      raise ConfigError("sampling.temperature must be > 0 for RL rollouts (0 is greedy)")
    if self.learner.temperature is None:
      self.learner.temperature = self.sampling.temperature
    elif self.learner.temperature != self.sampling.temperature:
      raise ConfigError(
          f"learner.temperature={self.learner.temperature} differs from sampling.temperature="
          f"{self.sampling.temperature}: the learner's log p and entropy statistics must be those of "
          f"the distribution the rollouts were sampled from (leave learner.temperature unset)")
    if self.learner.routing_replay and not self.sampling.record_routing:
      raise ConfigError("learner.routing_replay=true with sampling.record_routing=false: replay needs the "
                        "experts the sampler recorded (set sampling.record_routing=true)")
    if self.learner.max_len is None:
      self.learner.max_len = self.rollout.max_trajectory_tokens or self.sampling.max_new_tokens
    updates = {"learner": self.steps * self.learner.mini_batches * self.learner.ppo_epochs,
               "critic": self.steps}  # the run's optimizer updates: the horizon of a decaying schedule
    for section, optim in (("learner", self.learner.optim), ("critic", self.critic.optim)):
      if optim.total_steps is None and optim.schedule != "constant":
        optim.total_steps = updates[section]
    for name in ("steps", "keep_checkpoints", "max_nonfinite_steps"):
      if getattr(self, name) <= 0:
        raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

  def _check_multi_turn(self) -> None:
    """What multi-turn rollouts (``rollout.environment``) do not take yet, refused in one line."""
    unsupported = {"learner.routing_replay=true (multi-turn rollouts record no routing)":
                   self.learner.routing_replay,
                   "data.chat_template=none (a conversation is rendered by the chat template)":
                   self.data.chat_template == "none"}
    for what, on in unsupported.items():
      if on:
        raise ConfigError(f"rollout.environment={self.rollout.environment!r} with {what}")


# Paths a training run cannot start without (``rft-jax plan`` needs only the model's config.json).
REQUIRED_PATHS = ("model.path", "data.train_path")


# Settings that name a file or directory (besides each ``eval.sets[i].path``): resolved
# against the current directory when the config is loaded ('' stays '': unset or off).
PATH_KEYS = ("run_dir", "compilation_cache_dir", "model.path", "model.ref_path", "model.critic_path",
             "data.train_path")


def load_config(path: str | None = None, overrides: Sequence[str] = (), *,
                required: Sequence[str] = REQUIRED_PATHS, **defaults) -> TrainConfig:
  """Merges the schema, ``defaults`` (a dict of fields), the YAML file and dotted overrides
  (``key=value``; ``key=`` sets the empty string, ``key=null`` None), checks that the
  ``required`` settings are not empty and makes relative paths absolute (against the current
  directory, :func:`resolve_paths`)."""
  where = path or "the command line"
  config = _merge(path, renamed_overrides(overrides), defaults, where)
  for key in required:
    section, field = key.split(".")
    if not getattr(getattr(config, section), field):
      raise ConfigError(f"{where}: {key} is required (set it in the YAML or as {key}=...)")
  return resolve_paths(config)


def absolute_path(path: str) -> str:
  """``path`` made absolute against the current directory (``~`` expanded); '' and URLs
  (``gs://...``) unchanged."""
  if not path or "://" in path:
    return path
  return os.path.abspath(os.path.expanduser(path))


def resolve_paths(config: TrainConfig) -> TrainConfig:
  """Makes every path setting of ``config`` absolute (:func:`absolute_path`), in place."""
  for key in PATH_KEYS:
    *sections, field = key.split(".")
    owner = config
    for section in sections:
      owner = getattr(owner, section)
    setattr(owner, field, absolute_path(getattr(owner, field)))
  for eval_set in config.eval.sets:
    eval_set.path = absolute_path(eval_set.path)
  return config


def _merge(path: str | None, overrides: Sequence[str], defaults: dict, where: str) -> TrainConfig:
  """The config of the schema, ``defaults``, the YAML file and the overrides, in that order; an
  error names where the bad value came from: the file, or the command line and its override
  (:func:`_source_of`)."""
  stage = where  # whose values are being merged, for an error OmegaConf raises while merging
  try:
    merged = OmegaConf.structured(TrainConfig)
    if defaults:
      merged = OmegaConf.merge(merged, OmegaConf.create(defaults))
    if path:
      merged = OmegaConf.merge(merged, load_yaml(path))
    if overrides:
      stage = "the command line"
      merged = OmegaConf.merge(merged, parse_overrides(overrides))
    stage = None
    return OmegaConf.to_object(merged)
  except ConfigError as exc:
    if stage is not None:  # the file or an override could not be read: the message names it
      raise
    raise ConfigError(f"{_source_of(str(exc), path, overrides, defaults)}: {exc}") from exc
  except OmegaConfBaseException as exc:
    key = getattr(exc, "full_key", None)
    source = stage or _source_of(str(key or exc), path, overrides, defaults)
    if stage == "the command line" and key:
      source = _source_of(key, None, overrides, {})
    raise ConfigError(f"{source}: {describe_error(exc)}") from exc
  except ValueError as exc:  # a dataclass __post_init__ check
    raise ConfigError(f"{_source_of(str(exc), path, overrides, defaults)}: {exc}") from exc


def _override_key(override: str) -> str:
  return override.partition("=")[0].strip()


def _source_of(message: str, path: str | None, overrides: Sequence[str], defaults: dict) -> str:
  """Where the value a check refused (its ``message``) came from: ``the command line
  (key=value)`` when the message names an override's key; else the YAML file if it fails the
  same check without the overrides (else the file and the command line together)."""
  named = [o for o in overrides if re.search(rf"(?<![\w.]){re.escape(_override_key(o))}(?![\w])", message)]
  if named:
    return f"the command line ({', '.join(named)})"
  if not path:
    return "the command line"
  if not overrides:
    return path
  try:
    _merge(path, (), defaults, path)
  except ConfigError as exc:
    if str(exc) == f"{path}: {message}":
      return path
  return f"{path} with the command line's overrides"


def to_yaml(config: TrainConfig) -> str:
  """The resolved config, as written to ``RUN_DIR/config.yaml``."""
  return OmegaConf.to_yaml(OmegaConf.structured(config))


def config_keys(schema: type = TrainConfig, prefix: str = "", instance: Any = None) -> list[tuple[str, Any]]:
  """``(dotted key, default)`` of every setting of ``schema``, nested config dataclasses walked
  (``learner.entropy_mask.kind``); the fields of a list's config items appear as
  ``key[i].field``. A nested config's defaults are read from its ``default_factory``'s value
  (``instance``), the top level's from the class (before ``__post_init__`` derives any)."""
  hints = typing.get_type_hints(schema)
  keys = []
  for field in dataclasses.fields(schema):
    key = prefix + field.name
    if instance is not None:
      default = getattr(instance, field.name)
    elif field.default is not dataclasses.MISSING:
      default = field.default
    elif field.default_factory is not dataclasses.MISSING:
      default = field.default_factory()
    else:
      default = dataclasses.MISSING
    if dataclasses.is_dataclass(default):
      keys += config_keys(type(default), key + ".", default)
      continue
    keys.append((key, default))
    item = typing.get_args(hints[field.name])
    if typing.get_origin(hints[field.name]) is list and item and dataclasses.is_dataclass(item[0]):
      keys += config_keys(item[0], key + "[i].")
  return keys
