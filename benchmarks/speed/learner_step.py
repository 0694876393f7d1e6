"""Time of the compiled GRPO learner step on random Qwen3 models (issue 17).

Builds random Qwen3-layout models in memory (no checkpoint) and one synthetic batch of 32
rows: prompts left-padded to 64 tokens followed by completions right-padded to 128 tokens,
float32, random tokens, advantages and sampler log-probs. Times ``Learner.step`` (one update,
statistics of the pre-update pass included; metrics read back) for each
``learner.micro_batch_size``: median and spread (min-max) of ``--repeats`` steps after a
compiling step and a warm-up step.

    python benchmarks/speed/learner_step.py --model both [--micro 8 32] [--repeats 5] [--mask none]

Models: ``small`` (hidden 256, 4 layers, vocab 8192, ~5M parameters) and ``large`` (hidden
512, 8 layers, vocab 32768, ~40M parameters), tied embeddings.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rft_jax.models import Qwen, QwenConfig
from rft_jax.rl.config import EntropyMaskConfig, LearnerConfig
from rft_jax.rl.learner import Learner, LearnerBatch
from rft_jax.rl.optimizer import OptimizerConfig

MODELS = {
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "large": dict(vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
}


def config_of(name: str) -> QwenConfig:
  """The config of the Qwen3 of size ``name`` (float32, tied embeddings)."""
  return QwenConfig(model_type="qwen3", tie_word_embeddings=True, **MODELS[name])


def build(name: str, seed: int = 0) -> Qwen:
  """A random Qwen3 of size ``name`` (:func:`config_of`)."""
  return Qwen(config_of(name), rngs=nnx.Rngs(seed))


def synthetic_batch(vocab: int, rows: int = 32, prompt: int = 64, completion: int = 128,
                    seed: int = 0) -> LearnerBatch:
  """``rows`` sequences of ``[prompt | completion]`` tokens: prompts of 32..64 tokens left-padded
  (the longest fills the block, as after the loop's trim), completions of 16..128 tokens
  right-padded (the longest fills the block); groups of 4 rows share an advantage sign pattern."""
  rng = np.random.default_rng(seed)
  prompt_len = rng.integers(prompt // 2, prompt + 1, rows)
  prompt_len[0] = prompt
  completion_len = rng.integers(completion // 8, completion + 1, rows)
  completion_len[0] = completion
  column = np.arange(prompt + completion)[None]
  prompt_mask = (column >= prompt - prompt_len[:, None]) & (column < prompt)
  response_mask = (column >= prompt) & (column < prompt + completion_len[:, None])
  attention_mask = prompt_mask | response_mask
  ids = np.where(attention_mask, rng.integers(1, vocab, (rows, prompt + completion)), 0)
  sampler_logp = np.where(response_mask, -rng.exponential(2.0, (rows, prompt + completion)), 0.0)
  return LearnerBatch(input_ids=jnp.asarray(ids, jnp.int32),
                      attention_mask=jnp.asarray(attention_mask, jnp.int32),
                      response_mask=jnp.asarray(response_mask, jnp.float32),
                      advantages=jnp.asarray(rng.standard_normal(rows), jnp.float32),
                      sampler_logp=jnp.asarray(sampler_logp, jnp.float32))


def time_step(name: str, batch: LearnerBatch, micro: int, mask: str, repeats: int) -> list[float]:
  """Seconds per step of ``repeats`` steps, after one compiling and one warm-up step."""
  model = build(name)
  learner = Learner(model, LearnerConfig(optim=OptimizerConfig(lr=1e-5), micro_batch_size=micro, forecast_every=0,
                                         entropy_mask=EntropyMaskConfig(kind=mask)))
  state = learner.init(model)
  for _ in range(2):  # compile, warm up
    state, _ = learner.step(state, batch)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    state, _ = learner.step(state, batch)  # reads the metrics back: the step has finished
    jax.block_until_ready(state.params)
    times.append(time.perf_counter() - start)
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=("small", "large", "both"), default="both")
  parser.add_argument("--micro", type=int, nargs="+", default=[8, 32],
                      help="learner.micro_batch_size values (32: one forward pass)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--mask", default="none", help="entropy_mask.kind")
  args = parser.parse_args()
  names = ("small", "large") if args.model == "both" else (args.model,)
  print(f"backend {jax.default_backend()} ({jax.device_count()} devices), 32 rows x (64 prompt + "
        f"128 completion) tokens, float32, entropy_mask {args.mask}")
  print(f"{'model':<6} {'params':>7} {'micro':>5} {'median s':>9} {'min s':>7} {'max s':>7}")
  for name in names:
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(build(name), nnx.Param)))
    batch = synthetic_batch(MODELS[name]["vocab_size"])
    for micro in args.micro:
      times = time_step(name, batch, micro, args.mask, args.repeats)
      print(f"{name:<6} {n_params / 1e6:6.1f}M {micro:5d} {statistics.median(times):9.3f} "
            f"{min(times):7.3f} {max(times):7.3f}", flush=True)


if __name__ == "__main__":
  main()
