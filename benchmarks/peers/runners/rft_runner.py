"""rft_jax as a contender of ``benchmarks/peers/peers.py`` (runs in rft_jax's own virtualenv).

rollout: ``rft_jax.sampling.generate`` of the 32 prompts, no stop tokens.
learner: ``Learner.step`` on the saved batch: one update (LearnerConfig defaults: GRPO,
  token-mean loss, clip 0.2, AdamW, global-norm clip 1.0, its default micro-batch; the entropy
  statistics computed, no entropy mask, no forecast), metrics read back.
e2e: ``generate`` 8 prompts x 4 samples from the current parameters, rewards and group
  advantages on the host, ``learner_batch``, ``Learner.step``.
longtail_128 / longtail_512: ``generate`` of the spec's long-tailed work (``peers.spec.LONGTAIL``:
  n = 8 samples a prompt, its stop tokens), with the spec's ``scheduler`` and ``decode_slots``
  (``RFT_JAX_BENCH_SCHEDULER`` in the environment overrides the scheduler).
decode_1 ... decode_128: ``common.decode_steps`` of ``generate`` on the work's rows, no stop
  tokens, every row in the pool at once (``decode_slots`` = the rows).

On CPU the runner builds the decode attention kernel where it is not built (``rft-jax
build-kernels``, as ``launch/local.sh`` does: a new machine has none, and without it the sampler
decodes with XLA's attention) and its ready line says whether the kernel is on.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import decode_steps, group_advantages, load_batch, reward, serve  # noqa: E402
from rft_jax.models import load_hf  # noqa: E402
from rft_jax.models.decode import cpu_attention  # noqa: E402
from rft_jax.rl.config import LearnerConfig  # noqa: E402
from rft_jax.rl.learner import Learner, LearnerBatch, learner_batch  # noqa: E402
from rft_jax.rl.optimizer import OptimizerConfig  # noqa: E402
from rft_jax.sampling import SamplingParams, generate  # noqa: E402


SETTINGS: dict[str, str] = {}


def setup(spec: dict) -> dict:
  if jax.default_backend() == "cpu":  # as `rft-jax build-kernels` (launch/local.sh) does
    cpu_attention.build()
  model = load_hf(spec["checkpoint"])
  vocab = model.config.vocab_size
  config = LearnerConfig(optim=OptimizerConfig(lr=spec["lr"]), forecast_every=0, temperature=spec["temperature"])
  learner = Learner(model, config)
  state = {"train": learner.init(model)}
  scheduler = os.environ.get("RFT_JAX_BENCH_SCHEDULER", spec["scheduler"])
  sampler = dict(temperature=spec["temperature"], scheduler=scheduler,
                 decode_slots=spec["decode_slots"])
  SETTINGS.update({"scheduler": scheduler, "decode_slots": str(spec["decode_slots"] or "rows"),
                   "XLA_FLAGS": os.environ.get("XLA_FLAGS", "unset")})
  rollout_params = SamplingParams(n=1, max_new_tokens=spec["new_tokens"], **sampler)
  group_params = SamplingParams(n=spec["group_size"], max_new_tokens=spec["new_tokens"], **sampler)
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
    advantages = jnp.asarray(group_advantages(rewards, spec["group_size"]), jnp.float32)
    step_batch = jax.tree.map(jnp.asarray, learner_batch(out, advantages=advantages))
    state["train"], _ = learner.step(state["train"], step_batch)
    jax.block_until_ready(state["train"].params)
    return int(out.completion_lengths.sum())

  def longtail(work: dict):
    params = SamplingParams(n=work["n"], max_new_tokens=work["new_tokens"],
                            stop_token_ids=tuple(spec["stop_token_ids"]), **sampler)

    def run(seed: int) -> int:
      out = generate(learner.model(state["train"]), work["prompts"], params, seed=seed)
      return int(out.completion_lengths.sum())
    return run

  def decode(work: dict):
    rows = len(work["prompts"])

    def run(seed: int) -> dict:
      def call(new: int):
        params = SamplingParams(n=1, max_new_tokens=new, **(sampler | {"decode_slots": rows}))
        generate(learner.model(state["train"]), work["prompts"], params, seed=seed)
      return decode_steps(call, rows, work["steps"])
    return run

  return {"rollout": rollout, "learner": learner_step, "e2e": e2e,
          **{name: longtail(work) for name, work in spec["longtail"].items()},
          **{name: decode(work) for name, work in spec.get("decode", {}).items()}}


if __name__ == "__main__":
  serve(setup, ("jax", "flax"), about=lambda: SETTINGS | {
      "CPU attention kernel": "on" if cpu_attention.available() else "off"})
