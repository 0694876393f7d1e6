"""The cost of one decode step at each batch size: rft_jax against vLLM-CPU (issue 33).

The long-tailed works (``benchmarks/peers/longtail.py``) mix every batch size, from the full
pool to the last row; their times say who is faster overall, not where. Here each engine decodes
fixed-length rows (no stops) at one batch size per work, ``decode_1`` ... ``decode_128``
(``runners/spec.py``: that many prompts of 100 tokens, the peers' random Qwen3 checkpoints,
float32), every row in one batch (rft_jax's pool holds them all; vLLM's scheduler too), and the
seconds of 128 decode steps are those of ``generate(132 tokens)`` less ``generate(4 tokens)``
(``runners/common.py::decode_steps``): prefill and per-call costs cancel out. The contenders
alternate round by round.

It prints milliseconds per step (median of the rounds) and the ratios (vLLM time / rft_jax
time, > 1: rft_jax is faster), with the floor no float32 step goes under on the machine: its
weight products' FLOPs at ``--peak`` GFLOP/s, or its weights read once at ``--bandwidth`` GB/s,
whichever is longer (attention, sampling and the cache writes come on top).

    bash benchmarks/peers/peers_setup.sh vllm
    python benchmarks/peers/decode_steps.py [--models large] [--rounds 3] [--work decode_1 decode_64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
CHILD_ENV = dict(os.environ)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from peers.runners.contenders import DECODE_WORKS  # noqa: E402
from peers.runners.driver import add_common_arguments, measure_models  # noqa: E402
from peers.runners.report import print_ratios  # noqa: E402
from peers.runners.spec import DECODE, DECODE_STEPS  # noqa: E402
from speed.learner_step import MODELS  # noqa: E402


def product_flops(model: str) -> float:
  """FLOPs of one row's weight products in a decode step (layers and unembedding)."""
  c = MODELS[model]
  d, h = c["hidden_size"], c["head_dim"]
  attn = d * h * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
  mlp = 3 * d * c["intermediate_size"]
  return 2 * (c["num_hidden_layers"] * (attn + mlp) + c["vocab_size"] * d)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_common_arguments(parser, rounds=3)
  parser.add_argument("--work", nargs="+", choices=DECODE_WORKS, default=list(DECODE_WORKS))
  parser.add_argument("--peak", type=float, default=192.0,
                      help="the machine's float32 GFLOP/s (2 cores x 32 FLOP a cycle x 3 GHz)")
  parser.add_argument("--bandwidth", type=float, default=29.0,
                      help="the machine's read GB/s (a 512 MiB sum by XLA on 2 cores)")
  args = parser.parse_args()
  args.peers = ["vllm"]
  results = measure_models(args, CHILD_ENV, decode=True)
  print_ratios(results, args.models, args.peers, args.work)
  print(f"\nms per decode step (median of the rounds); floor: the weight products at "
        f"{args.peak:.0f} GFLOP/s or the weights read at {args.bandwidth:.0f} GB/s")
  print("| model | rows | rft_jax | vLLM-CPU | vLLM / rft_jax | floor |")
  print("|---|---|---|---|---|---|")
  for model in args.models:
    for work in args.work:
      ms = {}
      for name in ("rft_jax", "vllm"):
        runs = results[model].get((name, work), {}).get("runs")
        ms[name] = statistics.median(s for s, _ in runs) / DECODE_STEPS * 1e3 if runs else None
      rows = DECODE[work]
      cells = [f"{ms[n]:.2f}" if ms[n] else "—" for n in ("rft_jax", "vllm")]
      ratio = f"{ms['vllm'] / ms['rft_jax']:.2f}x" if all(ms.values()) else "—"
      flops = product_flops(model)  # 2 per float32 weight
      floor = max(rows * flops / args.peak, 2 * flops / args.bandwidth) / 1e6
      print(f"| {model} | {rows} | {cells[0]} | {cells[1]} | {ratio} | {floor:.2f} |")


if __name__ == "__main__":
  main()
