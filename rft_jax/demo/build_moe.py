"""Builds the demo's mixture-of-experts model: the dense demo model's layout (:mod:`rft_jax.demo.build`)
with each feed-forward block a Qwen3-MoE block of 8 experts, top-2, warm-started the same way (the
same tokenizer, the same careless teacher's worked answers, ``rft-jax sft``'s code, the dense
model's 2400 steps of 64 examples) and saved in Hugging Face form (``model_type: qwen3_moe``) as
package data beside the dense one. The shipped checkpoint is this build (its time, final loss
and held-out Avg@4, which GRPO lifts:
docs/results/demo.md#the-mixture-of-experts-variants-issue-54).

    python -m rft_jax.demo.build_moe --out rft_jax/demo/moe_checkpoint

The demo's ``moe_*`` variants (:mod:`rft_jax.demo.methods`) train it; it is never downloaded.
"""

from __future__ import annotations

import argparse
import os

from rft_jax.demo.build import build
from rft_jax.demo.paths import MOE_CHECKPOINT
from rft_jax.models import QwenConfig


def moe_demo_model_config(vocab_size: int) -> QwenConfig:
  """About 1.0M parameters, 0.4M of them active per token (the dense demo model: 0.8M): its
  attention, embedding and depth, each layer's feed-forward block 8 SwiGLU experts of width 64
  of which the router picks 2 (renormalised, as Qwen3-MoE). An expert is a sixth of the dense
  model's 384-wide block, so a token's 2 experts are a third of it, which keeps the whole model
  under 4 MB in float32 as package data (experts as wide as the dense block would make it 10 MB)."""
  return QwenConfig(model_type="qwen3_moe", vocab_size=vocab_size, hidden_size=128, intermediate_size=384,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    tie_word_embeddings=True, rope_theta=10_000.0, max_position_embeddings=256,
                    bos_token_id=None, eos_token_id=2, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=64, norm_topk_prob=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=MOE_CHECKPOINT,
                      help="HF directory to write (default: the package's rft_jax/demo/moe_checkpoint)")
  parser.add_argument("--steps", type=int, default=2400)
  parser.add_argument("--problems", type=int, default=8000, help="distinct problems, none of them held out")
  parser.add_argument("--slip-rate", type=float, default=0.3,
                      help="fraction of worked answers in which the teacher forgets a carry")
  args = parser.parse_args()
  build(args.out, steps=args.steps, problems=args.problems, max_digits=2, slip_rate=args.slip_rate,
        model_config=moe_demo_model_config)


if __name__ == "__main__":
  main()
