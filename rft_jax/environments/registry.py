"""Environments by name: the project's own, skyrl-gym's, and any importable class.

An :class:`EnvironmentSpec` names an environment and holds its config; the dataset row gives
each trajectory its ``extras`` (skyrl-gym's word: ``reward_spec``, ``extra_info``,
``max_turns``, ...). A name is one of:

* a registered name without a colon: ``guess_number`` and ``tools`` (tool calls, then a graded
  answer: ``tool_use.py``) here, and what is registered with :func:`register_environment`;
* ``skyrl_gym:<id>``: ``skyrl_gym.make(id, env_config=config, extras=extras)``, skyrl-gym's own
  environments unchanged (``gsm8k``, ``gsm8k_multi_turn``, ...; the ``agents`` extra installs
  it). The config is handed over as an omegaconf ``DictConfig``, which is what skyrl-gym's
  environments read (by attribute or by ``.get``);
* ``package.module:ClassName``: ``ClassName(env_config=config, extras=extras)``, the way
  skyrl-gym constructs its environments, so a user's class written for skyrl-gym works as is.

:func:`environment_factory` resolves a name to a picklable factory without constructing or
importing the environment: the workers resolve it in the trainer (an unknown name fails there,
at once) and construct in the worker process. A registered factory must therefore be picklable by
reference -- a class or a module-level function of an importable module.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from typing import Any, Callable, Union

from rft_jax.environments.base import Environment

# Called as factory(env_config=..., extras=...), as skyrl-gym calls an environment's class.
Factory = Callable[..., Environment]
SKYRL_GYM_PREFIX = "skyrl_gym:"
_INSTALL_HINT = "pip install 'rft_jax[agents]'"

# name -> a factory, or "module:attribute" naming one (imported when first used).
_REGISTRY: dict[str, Union[Factory, str]] = {
    "guess_number": "rft_jax.environments.guess_number:GuessNumber",
    "tools": "rft_jax.environments.tool_use:ToolUse",
}


@dataclasses.dataclass(frozen=True)
class EnvironmentSpec:
  """Which environment, and its config (shared by every trajectory; the row gives ``extras``).

  Attributes:
    name: a registered name, ``skyrl_gym:<id>`` or ``package.module:ClassName`` (module doc).
    config: the environment's ``env_config``.
  """

  name: str
  config: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"EnvironmentSpec.name must be a non-empty string, got {self.name!r}")
    if not isinstance(self.config, dict):
      raise ValueError(f"EnvironmentSpec.config must be a dict, got {type(self.config).__name__}")


def register_environment(name: str, factory: Union[Factory, str]) -> None:
  """Registers a builtin environment under ``name``.

  Args:
    name: the name specs use; no colon (those are ``skyrl_gym:`` and import paths).
    factory: called as ``factory(env_config=config, extras=extras)`` to make one environment: a
      class or a module-level function (picklable by reference: the workers are sent it), or
      ``"module:attribute"`` naming one, imported when first used.

  Raises:
    ValueError: a name with a colon, or one already registered to another factory.
  """
  if not isinstance(name, str) or not name or ":" in name:
    raise ValueError(f"environment name {name!r} must be a non-empty string without ':'")
  if name in _REGISTRY and _REGISTRY[name] != factory:
    raise ValueError(f"environment {name!r} is already registered ({_REGISTRY[name]!r})")
  _REGISTRY[name] = factory


def registered_names() -> list[str]:
  """The builtin environments' names, sorted."""
  return sorted(_REGISTRY)


def _import_attribute(path: str) -> Any:
  """``"package.module:attribute"`` imported."""
  module, _, attribute = path.partition(":")
  return getattr(importlib.import_module(module), attribute)


def _make_by_path(path: str, env_config: dict[str, Any], extras: dict[str, Any]) -> Environment:
  return _import_attribute(path)(env_config=env_config, extras=extras)


def _make_skyrl_gym(env_id: str, env_config: dict[str, Any], extras: dict[str, Any]) -> Environment:
  """``skyrl_gym.make(env_id, ...)``, the config as the ``DictConfig`` skyrl-gym's envs read."""
  skyrl_gym = _import_skyrl_gym(env_id)
  from omegaconf import OmegaConf

  return skyrl_gym.make(env_id, env_config=OmegaConf.create(dict(env_config)), extras=extras)


def _import_skyrl_gym(env_id: str):
  try:
    import skyrl_gym
  except ImportError as e:
    raise ImportError(f"environment {SKYRL_GYM_PREFIX}{env_id} needs skyrl-gym, which is not "
                      f"installed ({e}): {_INSTALL_HINT}") from None
  return skyrl_gym


def environment_factory(name: str) -> Factory:
  """The factory that makes environment ``name``, picklable by reference; nothing constructed.

  Args:
    name: a registered name, ``skyrl_gym:<id>`` or ``package.module:ClassName``.

  Returns:
    A callable taking ``env_config=`` and ``extras=``.

  Raises:
    ValueError: an unknown registered name (the message lists the registered ones) or a
      malformed ``module:Class`` path.
    ImportError: ``skyrl_gym:<id>`` where skyrl-gym is not installed (names the extra).
  """
  if name.startswith(SKYRL_GYM_PREFIX):
    env_id = name[len(SKYRL_GYM_PREFIX):]
    if not env_id:
      raise ValueError(f"environment {name!r} names no skyrl-gym id (skyrl_gym:gsm8k_multi_turn)")
    if importlib.util.find_spec("skyrl_gym") is None:
      _import_skyrl_gym(env_id)  # raises, naming the extra
    return functools.partial(_make_skyrl_gym, env_id)
  if ":" in name:
    module, _, attribute = name.partition(":")
    if not module or not attribute.isidentifier():
      raise ValueError(f"environment {name!r} is not 'package.module:ClassName'")
    return functools.partial(_make_by_path, name)
  if name not in _REGISTRY:
    raise ValueError(f"unknown environment {name!r}: the builtins are {registered_names()}; or "
                     f"'{SKYRL_GYM_PREFIX}<id>', or 'package.module:ClassName'")
  factory = _REGISTRY[name]
  return functools.partial(_make_by_path, factory) if isinstance(factory, str) else factory


def construct(factory: Factory, spec: EnvironmentSpec, extras: dict[str, Any]) -> Environment:
  """``factory(env_config=spec.config, extras=extras)``, checked to have init, step and close.

  Raises:
    TypeError: the factory made something without ``init``, ``step`` and ``close``.
  """
  env = factory(env_config=dict(spec.config), extras=extras)
  if not isinstance(env, Environment):
    raise TypeError(f"environment {spec.name!r} made a {type(env).__name__}, which lacks "
                    "init / step / close")
  return env


def make_environment(spec: EnvironmentSpec, extras: dict[str, Any]) -> Environment:
  """Makes one environment in this process.

  Args:
    spec: which environment and its config.
    extras: the dataset row's extras for this trajectory.

  Returns:
    The environment, ready for ``init``.
  """
  return construct(environment_factory(spec.name), spec, extras)
