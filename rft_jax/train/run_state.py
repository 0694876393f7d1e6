"""A run's model and train state, built in one place from its config and a mesh.

Training (:func:`rft_jax.train.run_setup.build_run`), the commands that restore a checkpoint
(``eval``, ``export``, ``attribute``, the policy loader: :func:`rft_jax.train.checkpoint.restore_policy`)
and ``rft-jax plan`` all build a run's state with :func:`run_state`, so that the state a run
trains, the state its checkpoint is restored onto and the state that is planned are one recipe:

* the model options of the config (``model.dtype``, ``model.param_dtype``, ``model.remat``,
  ``model.attention``, ``model.decode_kernels``, ``model.lora``) become the model's
  :class:`~rft_jax.models.QwenConfig` in :func:`model_options` / :func:`model_config` only;
* the policy is laid out on the mesh by its parameters' logical axes; with ``model.lora`` it
  carries adapters (the base frozen); PPO's critic (``learner.algorithm.needs_critic``) starts
  from the policy's decoder without adapters (it is trained in full);
* the train state is the learner's (with the critic's beside it, an
  :class:`~rft_jax.rl.advantages.critic.ActorCriticState`).

Concrete (training: the starting weights given) or abstract (restore and plan: every array a
``jax.ShapeDtypeStruct`` with its sharding, nothing allocated), the structure, dtypes and
shardings are the same: a checkpoint restores directly into the run's layout and dtypes on the
mesh, never through an unsharded float32 copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from rft_jax.models import QwenConfig, load_hf
from rft_jax.models.hf import abstract_model, read_config
from rft_jax.models.lora_model import add_adapters
from rft_jax.parallel import make_mesh, state_shardings, with_shardings
from rft_jax.rl.advantages.critic import ActorCriticState, Critic, ValueModel
from rft_jax.rl.learner import Learner
from rft_jax.train.config import TrainConfig
from rft_jax.train.resolve import DTYPES, mesh_axes


def model_options(cfg: TrainConfig) -> dict[str, Any]:
  """The runtime options of ``cfg.model`` as :class:`~rft_jax.models.QwenConfig` fields (what
  ``load_hf`` and ``read_config`` take): the one mapping of the config's model options."""
  m = cfg.model
  return {"dtype": DTYPES[m.dtype], "param_dtype": DTYPES[m.param_dtype], "remat": m.remat,
          "attention": m.attention, "decode_kernels": m.decode_kernels}


def model_config(cfg: TrainConfig) -> QwenConfig:
  """The run's architecture (``model.path/config.json`` alone) with its options and adapters."""
  return read_config(cfg.model.path, **model_options(cfg)).replace(lora=cfg.model.lora)


def load_model(cfg: TrainConfig, path: str, mesh: Mesh | None) -> nnx.Module:
  """The Hugging Face directory ``path`` read with the run's model options, laid out on ``mesh``."""
  return load_hf(path, mesh=mesh, **model_options(cfg))


def _laid_out(module: nnx.Module, mesh: Mesh) -> nnx.Module:
  """An abstract module with each array's sharding on ``mesh`` (by its logical axes)."""
  graphdef, state = nnx.split(module)
  return nnx.merge(graphdef, with_shardings(state, state_shardings(state, mesh)))


@dataclasses.dataclass
class RunState:
  """A run's policy, learner, train state and (PPO) critic.

  Attributes:
    model: the policy as the learner holds it (with ``model.lora``: the base and its adapters).
    learner: the policy's :class:`~rft_jax.rl.learner.Learner`.
    state: the learner's ``TrainState``, or an ``ActorCriticState`` with the critic's; concrete
      or abstract (``jax.ShapeDtypeStruct`` leaves with shardings).
    critic: PPO's :class:`~rft_jax.rl.advantages.critic.Critic`; None without one.
  """

  model: nnx.Module
  learner: Learner
  state: Any
  critic: Critic | None = None


def run_state(cfg: TrainConfig, mesh: Mesh, policy: nnx.Module | None = None) -> RunState:
  """The run's state on ``mesh``.

  Args:
    cfg: the run's config.
    mesh: the run's mesh (or one the user names): every array is laid out on it.
    policy: the starting policy, loaded on ``mesh`` with :func:`load_model` (a training run: the
      state is concrete, ``model.ref_path`` / ``model.critic_path`` loaded the same way); None: the
      abstract state (to restore a checkpoint onto, or to compile for devices this process does
      not have).

  Returns:
    The :class:`RunState`; a concrete one's train state owns the policy's arrays (the step donates
    them: use ``learner.model(state)`` afterwards).
  """
  if policy is None:
    return _abstract_run_state(cfg, mesh)
  def load(path: str) -> nnx.Module:
    return load_model(cfg, path, mesh)

  reference = load(cfg.model.ref_path) if cfg.model.ref_path and cfg.learner.kl_coef > 0 else None
  critic = critic_state = None
  if cfg.learner.algorithm.needs_critic:  # a copy of the starting policy's decoder (or model.critic_path)
    value_model = ValueModel.from_policy(load(cfg.model.critic_path) if cfg.model.critic_path else policy,
                                         rngs=nnx.Rngs(cfg.seed))
    critic = Critic(value_model, cfg.critic, mesh=mesh)
    critic_state = critic.init(value_model)
  if cfg.model.lora is not None:  # after the critic's copy: the critic is trained in full
    policy = add_adapters(policy, cfg.model.lora, seed=cfg.seed, mesh=mesh)
    if reference is not None:  # the policy's structure, with adapters that change nothing (B = 0)
      reference = add_adapters(reference, cfg.model.lora, seed=cfg.seed, mesh=mesh)
  learner = Learner(policy, cfg.learner, mesh=mesh, reference=reference)
  state = learner.init(policy)  # with kl_coef > 0, copies the reference (default: these weights)
  if critic is not None:
    state = ActorCriticState(policy=state, critic=critic_state)
  return RunState(policy, learner, state, critic)


def _abstract_run_state(cfg: TrainConfig, mesh: Mesh) -> RunState:
  """:func:`run_state`'s abstract state: the same structure, dtypes and shardings, no array."""
  config = model_config(cfg)
  policy = _laid_out(abstract_model(config), mesh)
  learner = Learner(policy, cfg.learner, mesh=mesh)
  state = learner.abstract_state(nnx.state(policy, nnx.Param))
  critic = None
  if cfg.learner.algorithm.needs_critic:  # the policy's decoder without adapters, as training's
    value_model = _laid_out(nnx.eval_shape(lambda: ValueModel(config.replace(lora=None), rngs=nnx.Rngs(0))), mesh)
    critic = Critic(value_model, cfg.critic, mesh=mesh)
    state = ActorCriticState(policy=state, critic=critic.abstract_state(nnx.state(value_model, nnx.Param)))
  return RunState(policy, learner, state, critic)


def run_mesh(cfg: TrainConfig) -> Mesh:
  """The run's mesh (its ``mesh`` section) on this process group's devices, as training builds
  it: ``mesh.data = -1`` takes every device not on ``model``; sizes that name fewer devices take
  the first ones."""
  data, model = mesh_axes(cfg, len(jax.devices()))
  return make_mesh(data=data, model=model)
