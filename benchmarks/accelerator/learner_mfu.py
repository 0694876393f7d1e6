"""Model-FLOPs utilisation of the GRPO learner step at Qwen2.5-1.5B shapes (meant for a GPU).

A random Qwen2.5-1.5B (bfloat16 compute, float32 parameters and Adam state, as in the paper's
configs) and one synthetic batch (``--rows`` sequences of ``--prompt`` + ``--completion`` tokens,
every position real, benchmarks/speed/learner_step.py's ``synthetic_batch``); times ``Learner.step``
(one update, metrics read back) for each ``--micro`` micro-batch size and ``--remat`` setting,
median of ``--repeats`` steps after a compiling and a warm-up step. Model FLOPs per step, the
PaLM convention (rematerialisation and the entropy statistics not counted):

    6 * N * T  +  6 * L * heads * head_dim * S * T

with N the parameters of the matrix products (embedding lookup excluded, the unembedding
product included), T = rows * S tokens, S the sequence length (causal attention: half of the
S x S scores, forward and backward). MFU is given against the bfloat16 peak ``--peak-tflops``
(datasheet, dense: H100 SXM and H200 989) and against a measured 8192^3 bfloat16 product.

    python benchmarks/accelerator/learner_mfu.py [--rows 16] [--prompt 256] [--completion 768] [--micro 4 16]

``--profile`` then traces one more step of each setting and prints its GPU kernels by name
(``benchmarks/accelerator/decode_profile.py``'s summary, per learner step): where the time goes.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from accelerator.decode_profile import summarise  # noqa: E402
from speed.learner_step import synthetic_batch  # noqa: E402
from speed.sampler import median_seconds  # noqa: E402
from rft_jax.models import Qwen, QwenConfig  # noqa: E402
from rft_jax.rl.config import LearnerConfig  # noqa: E402
from rft_jax.rl.learner import Learner  # noqa: E402
from rft_jax.rl.optimizer import OptimizerConfig  # noqa: E402


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
  """Measured bfloat16 rate of an ``n^3`` product (random operands), TFLOP/s."""
  a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in range(2))
  return 2 * n ** 3 / median_seconds(jax.jit(lambda a, b: a @ b), a, b, repeats=repeats) / 1e12


def model_flops(config: QwenConfig, rows: int, length: int) -> float:
  """Model FLOPs of one forward and backward pass over ``rows x length`` tokens (docstring)."""
  model = nnx.eval_shape(lambda: Qwen(config, rngs=nnx.Rngs(0)))
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  # The lookup table is no product; the unembedding's matrix is (tied: the same table).
  matmul = params if config.tie_word_embeddings else params - config.vocab_size * config.hidden_size
  tokens = rows * length
  attention = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * length
  return 6 * matmul * tokens + attention * tokens


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=16)
  parser.add_argument("--prompt", type=int, default=256)
  parser.add_argument("--completion", type=int, default=768)
  parser.add_argument("--micro", type=int, nargs="+", default=[4, 16])
  parser.add_argument("--remat", type=int, nargs="+", default=[1], help="1: remat, 0: none")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--peak-tflops", type=float, default=989.0)
  parser.add_argument("--profile", action="store_true", help="trace one more step, by kernel")
  parser.add_argument("--top", type=int, default=25, help="kernels listed with --profile")
  args = parser.parse_args()
  measured = matmul_tflops()
  length = args.prompt + args.completion
  batch = synthetic_batch(151936, rows=args.rows, prompt=args.prompt, completion=args.completion)
  # every position real: the FLOPs count all rows x length tokens
  batch = batch.replace(attention_mask=jnp.ones_like(batch.attention_mask))
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), Qwen2.5-1.5B "
        f"shapes, {args.rows} rows x {length} tokens, bfloat16 compute, float32 parameters; "
        f"8192^3 bfloat16 product {measured:.0f} TFLOP/s", flush=True)
  for remat in args.remat:
    config = QwenConfig.qwen2_5_1_5b(dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                     remat=bool(remat))
    flops = model_flops(config, args.rows, length)
    for micro in args.micro:
      model = Qwen(config, rngs=nnx.Rngs(0))
      learner = Learner(model, LearnerConfig(optim=OptimizerConfig(lr=1e-6), micro_batch_size=micro, forecast_every=0))
      state = learner.init(model)
      del model
      start = time.perf_counter()
      state, _ = learner.step(state, batch)
      compile_s = time.perf_counter() - start
      state, _ = learner.step(state, batch)
      times = []
      for _ in range(args.repeats):
        start = time.perf_counter()
        state, _ = learner.step(state, batch)  # reads the metrics back: the step has finished
        jax.block_until_ready(state.params)
        times.append(time.perf_counter() - start)
      step = statistics.median(times)
      print(f"remat {remat} micro {micro:3d}: step {step * 1e3:8.1f} ms (min "
            f"{min(times) * 1e3:.1f}, first {compile_s:.1f} s), {flops / step / 1e12:6.1f} TFLOP/s model: MFU "
            f"{flops / step / 1e12 / args.peak_tflops:6.1%} of {args.peak_tflops:.0f}, "
            f"{flops / step / 1e12 / measured:6.1%} of the measured product", flush=True)
      if args.profile:
        root = tempfile.mkdtemp()
        with jax.profiler.trace(root):
          state, _ = learner.step(state, batch)
          jax.block_until_ready(state.params)
        summarise(glob.glob(f"{root}/**/*.xplane.pb", recursive=True)[0], 1, args.top,
                  unit="learner step")
      del state, learner


if __name__ == "__main__":
  main()
