"""google-tunix as a contender of ``benchmarks/peers/peers.py`` (rollout, learner step, e2e step).

JAX on the CPU (the jax / flax of rft_jax's pins where tunix accepts them), float32, its Qwen3
model loaded from the checkpoint's safetensors (``models.qwen3.params``).

rollout: tunix's ``Sampler`` (what its ``vanilla`` rollout engine runs) on the 32 prompt texts,
  temperature 1, ``top_p=1`` (its sampling mode; no top-k), KV cache of 256 slots (64-token prompt
  bucket + 128), ``eos_tokens=[vocab_size]``: a token id that cannot be drawn, so no row stops.
learner: an ``RLCluster`` (actor and rollout share the model, no reference: ``beta=0``) and a
  ``GRPOLearner`` (token-mean loss, clip 0.2, AdamW at lr 1e-5 after global-norm clipping at
  1.0); the actor trainer's compiled train step (``jit_train_and_eval_step``, as
  ``PeftTrainer.train`` calls it) on the saved batch as a ``TrainExample``, loss read back; no
  entropy statistics, log p of the completion positions only.
e2e: ``GRPOLearner._generate_and_compute_advantage`` (rollout of 8 prompts x 4 samples, reward,
  group advantages), the same compiled train step, ``RLCluster.sync_weights``: the body of
  ``GRPOLearner.train``'s step, without its data pipeline and metric logging.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import load_batch, reward, serve, split_batch  # noqa: E402


def model_config(path: str):
  import json

  from tunix.models.qwen3 import model as qwen3

  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  return qwen3.ModelConfig(
      num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
      embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
      num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
      num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_parameters"]["rope_theta"]),
      norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"])


def setup(spec: dict) -> dict:
  import jax
  import jax.numpy as jnp
  import optax
  from transformers import AutoTokenizer
  from tunix.generate import sampler as sampler_lib
  from tunix.models.qwen3 import params as qwen3_params
  from tunix.rl import rl_cluster as rl
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  path, vocab = spec["checkpoint"], spec["vocab_size"]
  group, new = spec["group_size"], spec["new_tokens"]
  tokenizer = AutoTokenizer.from_pretrained(path)
  config = model_config(path)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  model = qwen3_params.create_model_from_safe_tensors(path, config, mesh, dtype=jnp.float32)
  rollout_texts = [" ".join(f"w{t}" for t in p) for p in spec["rollout_prompts"]]
  group_texts = [" ".join(f"w{t}" for t in p) for p in spec["group_prompts"]]
  sampler = sampler_lib.Sampler(model, tokenizer, sampler_lib.CacheConfig(
      cache_size=256, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim))

  def rollout(seed: int) -> int:
    out = sampler(rollout_texts, max_generation_steps=new, max_prompt_length=64,
                  temperature=spec["temperature"], top_p=1.0, eos_tokens=[vocab], seed=seed,
                  pad_output=True)
    jax.block_until_ready(out.tokens)
    return int(sum(len(t) for t in out.tokens))

  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(spec["lr"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0))
  cluster = rl.RLCluster(actor=model, tokenizer=tokenizer, cluster_config=rl.ClusterConfig(
      role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
      rollout_engine="vanilla", offload_to_cpu=False,
      training_config=rl.RLTrainingConfig(actor_optimizer=optimizer, eval_every_n_steps=10**9,
                                          max_steps=10**6, mini_batch_size=len(group_texts),
                                          train_micro_batch_size=len(group_texts),  # prompts
                                          rollout_micro_batch_size=len(group_texts),
                                          compute_logps_micro_batch_size=len(group_texts)),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=new, max_prompt_length=64, kv_cache_size=256,
          temperature=spec["temperature"], top_p=1.0, eos_tokens=[vocab])))
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster,
      algo_config=grpo_learner.GRPOConfig(num_generations=group, num_iterations=1, beta=0.0,
                                          epsilon=0.2, loss_agg_mode="token-mean"),
      reward_fns=lambda prompts, completions, **_: [
          reward(tokenizer.convert_tokens_to_ids(c.split()), vocab) for c in completions])
  train_step, _ = cluster.actor_trainer.jit_train_and_eval_step(False, True)
  arrays = split_batch(load_batch(spec["batch"]))
  batch = grpo_learner.TrainExample(
      prompt_ids=jnp.asarray(arrays["prompt_ids"]), prompt_mask=jnp.asarray(arrays["prompt_mask"]),
      completion_ids=jnp.asarray(arrays["completion_ids"]),
      completion_mask=jnp.asarray(arrays["completion_mask"]),
      advantages=jnp.asarray(arrays["advantages"]), ref_per_token_logps=None,
      old_per_token_logps=None)

  def learner_step(seed: int) -> None:
    loss, _, _ = train_step(batch)
    float(loss)

  def e2e(seed: int) -> int:
    cluster.cluster_config.rollout_config.seed = jax.random.PRNGKey(seed)
    example = learner._generate_and_compute_advantage(
        {"prompts": [t for t in group_texts for _ in range(group)]})
    loss, _, _ = train_step(example)
    float(loss)
    cluster.sync_weights()
    return int(example.completion_mask.sum())

  return {"rollout": rollout, "learner": learner_step, "e2e": e2e}


if __name__ == "__main__":
  serve(setup, ("jax", "flax", "google-tunix"))
