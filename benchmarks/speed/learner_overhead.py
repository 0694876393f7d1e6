"""Step time of the GRPO learner with and without Clip_B / Clip_V, and how well the
Corollary 4 forecast tracks the measured entropy change.

Builds a small random Qwen3-layout model, samples completions from it once, and times
the compiled train step (median of several steps after warm-up) for the masks
``none``, ``clip_b`` and ``clip_v`` on the same batch. Then runs a short training run
with ``forecast_every=1`` and prints the Pearson correlation of the forecast
``-lr * Cov_B(A, S_* - E_p[S])`` with the measured entropy change.

    python benchmarks/speed/learner_overhead.py [--batch 32] [--completion 32] [--steps 8]
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


def build(seed: int, vocab: int) -> Qwen:
  config = QwenConfig(model_type="qwen3", vocab_size=vocab, hidden_size=128, intermediate_size=384,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, tie_word_embeddings=True)
  return Qwen(config, rngs=nnx.Rngs(seed))


def sample_batch(model, batch, prompt, completion, vocab, seed, group=8):
  """Completions from the model (a causal forward per token), reward = share of even tokens."""
  forward = nnx.jit(lambda m, ids: m(ids))
  key = jax.random.key(seed)
  prompts = jax.random.randint(key, (batch // group, prompt), 1, vocab).repeat(group, axis=0)
  ids = jnp.concatenate([prompts, jnp.zeros((batch, completion), jnp.int32)], axis=1)
  logps = jnp.zeros(ids.shape)
  for t in range(prompt, prompt + completion):
    logits = forward(model, ids)[:, t - 1]
    key, sub = jax.random.split(key)
    tok = jax.random.categorical(sub, logits)
    ids = ids.at[:, t].set(tok)
    logps = logps.at[:, t].set(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], -1)[:, 0])
  reward = jnp.mean((ids[:, prompt:] % 2 == 0).astype(jnp.float32), axis=1).reshape(-1, group)
  adv = ((reward - reward.mean(1, keepdims=True)) / (reward.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
  response = (jnp.arange(ids.shape[1]) >= prompt).astype(jnp.float32)[None].repeat(batch, 0)
  return LearnerBatch(input_ids=ids, attention_mask=jnp.ones_like(ids), response_mask=response,
                      advantages=adv, sampler_logp=logps)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--prompt", type=int, default=16)
  parser.add_argument("--completion", type=int, default=48)
  parser.add_argument("--vocab", type=int, default=4096)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--lr", type=float, default=1e-3)
  args = parser.parse_args()

  batch = sample_batch(build(0, args.vocab), args.batch, args.prompt, args.completion, args.vocab, 0)
  print(f"backend {jax.default_backend()}, batch {args.batch} x {args.prompt + args.completion} tokens, "
        f"vocab {args.vocab}")
  times = {}
  for kind in ("none", "clip_b", "clip_v"):
    model = build(0, args.vocab)
    learner = Learner(model, LearnerConfig(optim=OptimizerConfig(lr=args.lr), micro_batch_size=8,
                                           entropy_mask=EntropyMaskConfig(kind=kind)))
    state = learner.init(model)
    state, _ = learner.step(state, batch)  # compile
    samples = []
    for _ in range(args.steps):
      start = time.perf_counter()
      state, _ = learner.step(state, batch)
      jax.block_until_ready(state.params)
      samples.append(time.perf_counter() - start)
    times[kind] = statistics.median(samples)
    print(f"{kind:<7} median step {times[kind] * 1e3:8.1f} ms")
  for kind in ("clip_b", "clip_v"):
    print(f"{kind} overhead over plain GRPO: {100 * (times[kind] / times['none'] - 1):+.2f}%")

  model = build(1, args.vocab)
  learner = Learner(model, LearnerConfig(optim=OptimizerConfig(lr=args.lr), micro_batch_size=8, forecast_every=1))
  state = learner.init(model)
  forecast, measured = [], []
  for step in range(args.steps * 2):
    batch = sample_batch(learner.model(state), args.batch, args.prompt, args.completion, args.vocab, 100 + step)
    state, metrics = learner.step(state, batch)
    forecast.append(metrics["entropy_change_forecast"])
    measured.append(metrics["entropy_change_measured"])
  r = float(np.corrcoef(forecast, measured)[0, 1])
  print(f"forecast vs measured entropy change over {len(forecast)} steps: Pearson r = {r:.3f}")
  print("  forecast:", " ".join(f"{x:+.2e}" for x in forecast))
  print("  measured:", " ".join(f"{x:+.2e}" for x in measured))


if __name__ == "__main__":
  main()
