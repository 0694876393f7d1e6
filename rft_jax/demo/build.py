"""Rebuilds the demo's warm-started checkpoint: tokenizer, a small Qwen3-layout model,
supervised fine-tuning on worked addition answers, saved in Hugging Face form.

    python -m rft_jax.demo.build --out rft_jax/demo/checkpoint

The result is what ``configs/demo.yaml`` trains with RL, loaded through ``load_hf``
like any real Qwen checkpoint.
"""

from __future__ import annotations

import argparse
import time

from flax import nnx

from rft_jax.demo.task import addition_problems, worked_answer
from rft_jax.demo.tokenizer import build_char_tokenizer
from rft_jax.models import Qwen, QwenConfig, chat_token_ids, save_hf
from rft_jax.train.sft import SFTConfig, encode_pairs, sft

SFT_SEED, RL_SEED, EVAL_SEED = 11, 12, 13


def demo_model_config(vocab_size: int) -> QwenConfig:
  """About 1M parameters: Qwen3 layout (q/k norm, GQA 4:2, tied embeddings)."""
  return QwenConfig(model_type="qwen3", vocab_size=vocab_size, hidden_size=128, intermediate_size=384,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    tie_word_embeddings=True, rope_theta=10_000.0, max_position_embeddings=256,
                    bos_token_id=None, eos_token_id=2)


def build(out: str, *, steps: int, problems: int, max_digits: int, log_every: int = 100) -> None:
  tokenizer = build_char_tokenizer(out)
  model = Qwen(demo_model_config(len(tokenizer)), rngs=nnx.Rngs(0))
  examples = addition_problems(problems, seed=SFT_SEED, max_digits=max_digits)
  prompts = [chat_token_ids(tokenizer, e.question) for e in examples]
  responses = [tokenizer(worked_answer(e) + "<|im_end|>", add_special_tokens=False)["input_ids"] for e in examples]
  ids, mask, attention = encode_pairs(prompts, responses, max_len=64)
  start = time.time()

  def log(step, loss):
    if step % log_every == 0 or step == steps - 1:
      print(f"sft step {step:5d}  loss {loss:.4f}  ({time.time() - start:.0f} s)", flush=True)

  sft(model, ids, mask, attention, SFTConfig(steps=steps, batch_size=64, lr=3e-3, warmup_steps=50), log)
  save_hf(model, out, tokenizer=tokenizer)
  print(f"saved {out}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="rft_jax/demo/checkpoint")
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--problems", type=int, default=2000)
  parser.add_argument("--max-digits", type=int, default=3)
  args = parser.parse_args()
  build(args.out, steps=args.steps, problems=args.problems, max_digits=args.max_digits)


if __name__ == "__main__":
  main()
