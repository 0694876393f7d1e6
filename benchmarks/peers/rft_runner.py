"""rft_jax as a contender of ``benchmarks/peers.py`` (runs in rft_jax's own virtualenv).

rollout: ``rft_jax.sampling.generate`` of the 32 prompts, no stop tokens.
learner: ``Learner.step`` on the saved batch: one update (LearnerConfig defaults: GRPO,
  token-mean loss, clip 0.2, AdamW, global-norm clip 1.0, its default micro-batch; the entropy
  statistics computed, no entropy mask, no forecast), metrics read back.
e2e: ``generate`` 8 prompts x 4 samples from the current parameters, rewards and group
  advantages on the host, ``learner_arrays``, ``Learner.step``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import group_advantages, load_batch, reward, serve  # noqa: E402
from rft_jax.models import load_hf  # noqa: E402
from rft_jax.rl.config import LearnerConfig  # noqa: E402
from rft_jax.rl.learner import Learner, LearnerBatch  # noqa: E402
from rft_jax.sampling import SamplingParams, generate  # noqa: E402
from rft_jax.sampling.rollouts import learner_arrays  # noqa: E402


def setup(spec: dict) -> dict:
  model = load_hf(spec["checkpoint"])
  vocab = model.config.vocab_size
  config = LearnerConfig(lr=spec["lr"], forecast_every=0, temperature=spec["temperature"])
  learner = Learner(model, config)
  state = {"train": learner.init(model)}
  rollout_params = SamplingParams(n=1, temperature=spec["temperature"],
                                  max_new_tokens=spec["new_tokens"])
  group_params = SamplingParams(n=spec["group_size"], temperature=spec["temperature"],
                                max_new_tokens=spec["new_tokens"])
  arrays = load_batch(spec["batch"])
  batch = LearnerBatch(**{k: jnp.asarray(v) for k, v in arrays.items()})

  def rollout(seed: int) -> int:  # the current parameters: a learner step donates the ones before
    out = generate(learner.model(state["train"]), spec["rollout_prompts"], rollout_params, seed=seed)
    return int(out.completion_lengths.sum())

  def learner_step(seed: int) -> None:
    state["train"], metrics = learner.step(state["train"], batch)  # metrics are host floats
    jax.block_until_ready(state["train"].params)

  def e2e(seed: int) -> int:
    out = generate(learner.model(state["train"]), spec["group_prompts"], group_params, seed=seed)
    rewards = [reward(c, vocab) for c in out.completions()]
    a = learner_arrays(out)
    step_batch = LearnerBatch(advantages=jnp.asarray(group_advantages(rewards, spec["group_size"]),
                                                     jnp.float32),
                              **{k: jnp.asarray(v) for k, v in a.items()})
    state["train"], _ = learner.step(state["train"], step_batch)
    jax.block_until_ready(state["train"].params)
    return int(out.completion_lengths.sum())

  return {"rollout": rollout, "learner": learner_step, "e2e": e2e}


if __name__ == "__main__":
  serve(setup, ("jax", "flax"))
