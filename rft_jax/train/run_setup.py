"""What a run builds once, before its first step (:func:`build_run`): the mesh, the policy (with
LoRA adapters), the reference and PPO's critic, the learner and its train state, the prompt
stream and the validation split. :mod:`rft_jax.train.loop` runs the steps."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from rft_jax import data as data_lib
from rft_jax.data.config import DataConfig
from rft_jax.models import load_hf
from rft_jax.models.lora_model import add_adapters
from rft_jax.parallel import is_main_process, make_mesh
from rft_jax.rl.advantages.critic import ActorCriticState, Critic, ValueModel
from rft_jax.rl.learner import Learner
from rft_jax.train.config import TrainConfig
from rft_jax.train.policy import load_policy
from rft_jax.train.preflight import Inputs
from rft_jax.train.resolve import DTYPES, mesh_axes
from rft_jax.train.status import logger


@dataclasses.dataclass
class Run:
  """What a run builds once: mesh, model, tokenizer, learner, data."""

  config: TrainConfig
  mesh: Any
  learner: Learner
  tokenizer: Any
  stream: data_lib.PromptStream
  validation: list
  eval_sets: dict[str, list]  # eval.sets' problems by name, as loaded by the preflight checks
  stop_ids: tuple[int, ...]
  data_report: dict
  critic: Critic | None = None  # PPO's (learner.advantage: gae); the state is then an ActorCriticState


def build_run(cfg: TrainConfig, inputs: Inputs) -> tuple[Run, Any]:
  """Builds the run from ``inputs`` (the data :func:`validate_for_training` loaded) and returns it
  with a fresh train state."""
  data_size, model_size = mesh_axes(cfg, len(jax.devices()))
  mesh = make_mesh(data=data_size, model=model_size)

  def load(path):
    return load_hf(path, dtype=DTYPES[cfg.model.dtype], param_dtype=DTYPES[cfg.model.param_dtype],
                   mesh=mesh, remat=cfg.model.remat, attention=cfg.model.attention,
                   decode_kernels=cfg.model.decode_kernels)

  policy = load_policy(cfg, load=load)
  model, tokenizer = policy.model, policy.tokenizer
  logger.info("model %s: %.3gM parameters, %s compute / %s storage, mesh data=%d x model=%d",
              cfg.model.path, sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) / 1e6,
              cfg.model.dtype, cfg.model.param_dtype, data_size, model_size)
  examples, report = inputs.train, inputs.train_report
  cfg = dataclasses.replace(cfg, rewards=policy.rewards([e.question for e in examples]))
  validation = []
  if cfg.data.val_size > 0:
    examples, validation = data_lib.split_validation(examples, cfg.data.val_size, cfg.seed)
  prompts, too_long = data_lib.tokenize_prompts(examples, policy.prompt_ids, cfg.data.max_prompt_len)
  stream = data_lib.PromptStream(prompts, prompts_per_step=cfg.data.prompts_per_step, seed=cfg.seed,
                                 epochs=cfg.data.epochs)
  dropped = _dropped_prompts(len(prompts), cfg.data)
  reference = load(cfg.model.ref_path) if cfg.model.ref_path and cfg.learner.kl_coef > 0 else None
  critic = critic_state = None
  if cfg.learner.algorithm.needs_critic:  # a copy of the starting policy's decoder (or model.critic_path)
    value_model = ValueModel.from_policy(load(cfg.model.critic_path) if cfg.model.critic_path else model,
                                         rngs=nnx.Rngs(cfg.seed))
    critic = Critic(value_model, cfg.critic, mesh=mesh)
    critic_state = critic.init(value_model)
  if cfg.model.lora is not None:  # after the critic's copy: the critic is trained in full
    model = add_adapters(model, cfg.model.lora, seed=cfg.seed, mesh=mesh)
    if reference is not None:  # the policy's structure, with adapters that change nothing (B = 0)
      reference = add_adapters(reference, cfg.model.lora, seed=cfg.seed, mesh=mesh)
    logger.info("LoRA rank %d, alpha %g on %s: %.3gM trainable parameters; the base is frozen",
                cfg.model.lora.rank, cfg.model.lora.alpha, ", ".join(cfg.model.lora.targets),
                sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))) / 1e6)
  learner = Learner(model, cfg.learner, mesh=mesh, reference=reference)
  state = learner.init(model)  # with kl_coef > 0, copies the reference (default: these weights)
  if critic is not None:
    state = ActorCriticState(policy=state, critic=critic_state)
  del reference
  run = Run(cfg, mesh, learner, tokenizer, stream, validation, inputs.eval_sets, policy.stop_ids,
            {"rows": report.rows, "skipped_rows": len(report.skipped), "prompts_too_long": too_long,
             "train_prompts": len(prompts), "validation_prompts": len(validation),
             "dropped_prompts": dropped}, critic)
  return run, state


def _dropped_prompts(prompts: int, data: DataConfig) -> int:
  """How many of ``data.epochs`` passes' prompts do not fill a last step (said once, here)."""
  if not data.epochs:
    return 0
  dropped = prompts * data.epochs % data.prompts_per_step
  if dropped and is_main_process():
    logger.warning("data: %d training prompts x data.epochs=%d make %d steps of data.prompts_per_step=%d; "
                   "the last %d prompt(s), too few for another step, are dropped", prompts, data.epochs,
                   prompts * data.epochs // data.prompts_per_step, data.prompts_per_step, dropped)
  return dropped
