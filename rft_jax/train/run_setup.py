"""What a run builds once, before its first step (:func:`build_run`): the mesh, the policy, its
learner and train state (with LoRA adapters, the reference and PPO's critic: one recipe,
:func:`rft_jax.train.run_state.run_state`), the prompt stream and the validation split.
:mod:`rft_jax.train.loop` runs the steps."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from rft_jax import data as data_lib
from rft_jax.data.config import DataConfig
from rft_jax.parallel import is_main_process
from rft_jax.rl.advantages.critic import Critic
from rft_jax.rl.learner import Learner
from rft_jax.train.agent_round import AgentParts, agent_parts
from rft_jax.train.config import TrainConfig
from rft_jax.train.rollout_engine import RolloutEngine, rollout_engine
from rft_jax.train.policy import load_policy
from rft_jax.train.preflight import Inputs
from rft_jax.train.run_state import load_model, run_mesh, run_state
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
  agent: AgentParts | None = None  # multi-turn rollouts' environments and tools (rollout.environment)
  rollouts: RolloutEngine | None = None  # makes each step's rounds (rft_jax.train.rollout_engine)

  def close(self) -> None:
    """Stops what the run started besides the model (the environments' worker processes)."""
    if self.rollouts is not None:
      self.rollouts.close()
    elif self.agent is not None:
      self.agent.close()


def build_run(cfg: TrainConfig, inputs: Inputs) -> tuple[Run, Any]:
  """Builds the run from ``inputs`` (the data :func:`validate_for_training` loaded) and returns it
  with a fresh train state."""
  mesh = run_mesh(cfg)
  policy = load_policy(cfg, load=lambda path: load_model(cfg, path, mesh))
  model, tokenizer = policy.model, policy.tokenizer
  logger.info("model %s: %.3gM parameters, %s compute / %s storage, mesh data=%d x model=%d",
              cfg.model.path, sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) / 1e6,
              cfg.model.dtype, cfg.model.param_dtype, mesh.shape["data"], mesh.shape["model"])
  examples, report = inputs.train, inputs.train_report
  cfg = dataclasses.replace(cfg, rewards=policy.rewards([e.question for e in examples]))
  validation = []
  if cfg.data.val_size > 0:
    examples, validation = data_lib.split_validation(examples, cfg.data.val_size, cfg.seed)
  prompts, too_long = data_lib.tokenize_prompts(examples, policy.prompt_ids, cfg.data.max_prompt_len)
  stream = data_lib.PromptStream(prompts, prompts_per_step=cfg.data.prompts_per_step, seed=cfg.seed,
                                 epochs=cfg.data.epochs)
  dropped = _dropped_prompts(len(prompts), cfg.data)
  built = run_state(cfg, mesh, model)
  if cfg.model.lora is not None:
    logger.info("LoRA rank %d, alpha %g on %s: %.3gM trainable parameters; the base is frozen",
                cfg.model.lora.rank, cfg.model.lora.alpha, ", ".join(cfg.model.lora.targets),
                sum(x.size for x in jax.tree.leaves(nnx.state(built.model, nnx.LoRAParam))) / 1e6)
  agent = agent_parts(cfg, tokenizer, policy.stop_ids)
  run = Run(cfg, mesh, built.learner, tokenizer, stream, validation, inputs.eval_sets, policy.stop_ids,
            {"rows": report.rows, "skipped_rows": len(report.skipped), "prompts_too_long": too_long,
             "train_prompts": len(prompts), "validation_prompts": len(validation),
             "dropped_prompts": dropped}, built.critic, agent,
            rollout_engine(cfg, tokenizer, agent, mesh))
  return run, built.state


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
