"""A small Qwen3-MoE's CPU decode step beside a dense Qwen3 of the same active parameters (issue 54).

The MoE model is a scaled-down Qwen3-30B-A3B (random, float32, tied embeddings): the peers'
``large`` shapes (``benchmarks/speed/learner_step.py``: hidden 512, 8 layers, 8 / 4 heads of
64, vocab 32,768) with 64 experts of width 256, top-8 (normalised weights). The dense model is
the same Qwen3 with ``intermediate_size = 8 x 256 = 2048``: a token's products use the same
weights (the MoE adds its ``512 x 64`` router), the MoE stores 8 times the MLP weights.

Contenders, alternated round by round (the median over rounds is reported):

* ``dense``: the dense model;
* ``moe``: the MoE model, its experts by the product :func:`rft_jax.models.moe.expert_product`
  picks (on CPU: the tiled loop of :mod:`rft_jax.models.expert_tiles`);
* ``moe ragged`` (``--ragged``): the MoE model with that rule forced to ``ragged``
  (:func:`jax.lax.ragged_dot`, the product before the tiled loop).

``step``: the continuous sampler's CPU decode step (``feature_major.decode_step`` and the
sampling strategy, temperature 1) timed by ``benchmarks/speed/cpu_decode_step.py``'s compiled
loop of ``--steps`` steps over ``rows`` prefilled rows (a prompt of ``--prompt`` tokens each),
at each of ``--rows``. ``rollout``: :func:`rft_jax.sampling.generate` of ``--prompts`` random
prompts (16 to 48 tokens) for ``--new-tokens`` tokens each (no stop tokens), first call
(compilation) excluded, for ``dense`` and ``moe`` only (the rollout's programs are cached by
model, not by the product; to time the ragged product's rollout, run this script with
``PYTHONPATH`` set to a checkout before the tiled loop, as ``cpu_decode_step.py`` says).

It prints the date, the CPU, the core count and the load average, then ms per step, tokens/s and
the ratio to the dense model.

    python benchmarks/speed/moe_decode_step.py [--rows 1 8 64] [--steps 8] [--rounds 3] [--ragged]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from speed.cpu_decode_step import attention_fn, loop, prefilled, timed  # noqa: E402
from speed.learner_step import MODELS  # noqa: E402
from rft_jax.models import Qwen, QwenConfig, moe  # noqa: E402
from rft_jax.models.decode import cpu_attention  # noqa: E402
from rft_jax.sampling import SamplingParams, generate  # noqa: E402

EXPERTS, TOP_K, EXPERT_WIDTH = 64, 8, 256


def configs() -> dict[str, QwenConfig]:
  """``{"dense": ..., "moe": ...}``: the two models' configs (float32, tied embeddings)."""
  shapes = dict(MODELS["large"])
  shapes.pop("intermediate_size")
  dense = QwenConfig(model_type="qwen3", tie_word_embeddings=True,
                     intermediate_size=TOP_K * EXPERT_WIDTH, **shapes)
  sparse = QwenConfig(model_type="qwen3_moe", tie_word_embeddings=True,
                      intermediate_size=TOP_K * EXPERT_WIDTH, num_experts=EXPERTS,
                      num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH,
                      norm_topk_prob=True, **shapes)
  return {"dense": dense, "moe": sparse}


def product(name: str):
  """The context a contender runs in: ``moe ragged`` forces the ragged expert product."""
  if name == "moe ragged":
    return mock.patch.object(moe, "expert_product", lambda platform, differentiable: "ragged")
  return contextlib.nullcontext()


def cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo``)."""
  with contextlib.suppress(OSError):
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  return "unknown CPU"


def parameters(model) -> tuple[int, int]:
  """(all parameters, those a token uses: all but the routed experts it is not sent to)."""
  c = model.config
  total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  if not c.is_moe:
    return total, total
  unused = (c.num_experts - c.num_experts_per_tok) * 3 * c.hidden_size * c.moe_intermediate_size
  return total, total - c.num_hidden_layers * unused


def step_times(models, names, rows: int, args) -> dict[str, float]:
  """Median ms per decode step of each contender at ``rows`` rows, alternating round by round."""
  kernel = cpu_attention.available()
  attention = attention_fn("kernel" if kernel else "xla")
  rng = np.random.default_rng(1)
  uniforms = jnp.asarray(rng.random((rows, args.steps)), jnp.float32)
  calls = {}
  for name in names:
    model = models[name.split()[0]]
    graphdef, state = nnx.split(model)
    tokens, cache = prefilled(model, rows, args.prompt, args.max_new, tiled=kernel)
    logits0 = jnp.zeros((model.config.vocab_size, rows), jnp.float32)
    calls[name] = (loop("step", args.steps, attention), (graphdef, state, tokens, cache, uniforms,
                                                         logits0))
  times = {name: [] for name in names}
  for round_ in range(args.rounds + 1):  # round 0 compiles
    for name, (run, call_args) in calls.items():
      with product(name):
        wall, _ = timed(run, *call_args)
      if round_:
        times[name].append(wall / args.steps * 1e3)
  return {name: statistics.median(ts) for name, ts in times.items()}


def rollout_times(models, names, args) -> dict[str, float]:
  """Median tokens/s of :func:`generate` per contender, alternating round by round."""
  rng = np.random.default_rng(2)
  vocab = models["dense"].config.vocab_size
  prompts = [rng.integers(3, vocab, rng.integers(16, 49)).tolist() for _ in range(args.prompts)]
  params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
  rates = {name: [] for name in names}
  for round_ in range(args.rounds + 1):  # round 0 compiles
    for name in names:
      with product(name):
        start = time.perf_counter()
        out = generate(models[name.split()[0]], prompts, params, seed=round_)
        seconds = time.perf_counter() - start
      if round_:
        rates[name].append(int(np.sum(out.completion_lengths)) / seconds)
  return {name: statistics.median(r) for name, r in rates.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
  parser.add_argument("--prompt", type=int, default=48)
  parser.add_argument("--max-new", type=int, default=256)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--prompts", type=int, default=4)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--ragged", action="store_true", help="time the ragged product too")
  parser.add_argument("--no-rollout", action="store_true")
  args = parser.parse_args()

  models = {name: Qwen(c, rngs=nnx.Rngs(0)) for name, c in configs().items()}
  names = ["dense", "moe"] + (["moe ragged"] if args.ragged else [])
  load = " ".join(f"{x:.2f}" for x in os.getloadavg())
  print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, "
        f"{os.cpu_count()} cores, load average {load}; {args.rounds} rounds, {args.steps} steps "
        f"a loop, prompt {args.prompt}; attention: "
        f"{'the kernel' if cpu_attention.available() else 'XLA'}", flush=True)
  for name, model in models.items():
    total, active = parameters(model)
    print(f"{name}: {total / 1e6:.1f}M parameters, {active / 1e6:.1f}M active per token")
  print("| work | rows | contender | ms/step | tokens/s | / dense |")
  print("|---|---|---|---|---|---|")
  for rows in args.rows:
    ms = step_times(models, names, rows, args)
    for name in names:
      print(f"| step | {rows} | {name} | {ms[name]:.2f} | {rows / ms[name] * 1e3:.0f} | "
            f"{ms[name] / ms['dense']:.2f}x |", flush=True)
  if not args.no_rollout:
    rollout_names = ["dense", "moe"]
    rates = rollout_times(models, rollout_names, args)
    for name in rollout_names:
      print(f"| rollout ({args.prompts} x {args.new_tokens}) | {args.prompts} | {name} | — | "
            f"{rates[name]:.0f} | {rates['dense'] / rates[name]:.2f}x |", flush=True)
  print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
  main()
