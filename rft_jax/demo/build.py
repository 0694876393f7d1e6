"""Rebuilds the demo's warm-started checkpoint: tokenizer, a small Qwen3-layout model,
supervised fine-tuning on worked addition answers from a teacher who forgets a carry in
30% of them (``rft-jax sft``'s code), saved in Hugging Face form. The 8000 problems
(of the 10,000 with operands below 100) exclude the demo's held-out ones; 2400 steps take
about 20 minutes on 2 CPU cores.

    python -m rft_jax.demo.build --out rft_jax/demo/checkpoint

The result is what ``configs/demo.yaml`` trains with RL, loaded through ``load_hf``
like any real Qwen checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Callable

import numpy as np
from flax import nnx

from rft_jax.data.config import DataConfig
from rft_jax.demo.task import SFT_SEED, addition_problems, heldout_problems, worked_answer
from rft_jax.demo.tokenizer import build_char_tokenizer
from rft_jax.models import Qwen, QwenConfig, save_hf
from rft_jax.train.sft import SFTConfig, sft_files


def demo_model_config(vocab_size: int) -> QwenConfig:
  """About 1M parameters: Qwen3 layout (q/k norm, GQA 4:2, tied embeddings)."""
  return QwenConfig(model_type="qwen3", vocab_size=vocab_size, hidden_size=128, intermediate_size=384,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    tie_word_embeddings=True, rope_theta=10_000.0, max_position_embeddings=256,
                    bos_token_id=None, eos_token_id=2)


def build(out: str, *, steps: int, problems: int, max_digits: int, slip_rate: float,
          log_every: int = 100, model_config: Callable[[int], QwenConfig] = demo_model_config) -> None:
  """Tokenizer and random model (``model_config(vocab_size)``, default the dense demo model's)
  saved in HF form, worked answers written as JSONL, then the same supervised fine-tuning as
  ``rft-jax sft --model INIT --data PAIRS --out OUT``."""
  held_out = {p.id for p in heldout_problems()}
  examples = addition_problems(problems, seed=SFT_SEED, max_digits=max_digits, exclude=held_out)
  rng = np.random.default_rng(SFT_SEED)
  with tempfile.TemporaryDirectory() as tmp:
    init = os.path.join(tmp, "init")
    tokenizer = build_char_tokenizer(init)
    save_hf(Qwen(model_config(len(tokenizer)), rngs=nnx.Rngs(0)), init, tokenizer=tokenizer)
    pairs = os.path.join(tmp, "pairs.jsonl")
    with open(pairs, "w") as f:
      f.writelines(json.dumps({"question": e.question, "response": worked_answer(e, slip_rate=slip_rate, rng=rng)}) + "\n"
                   for e in examples)
    start = time.time()

    def log(step, loss):
      if step == 1 or step % log_every == 0 or step == steps:
        print(f"sft step {step:5d}  loss {loss:.4f}  ({time.time() - start:.0f} s)", flush=True)

    config = SFTConfig(steps=steps, batch_size=64, lr=3e-3, warmup_steps=50, max_len=64)
    sft_files(init, pairs, out, config, log=log, prompt=DataConfig(instruction=""))  # as configs/demo.yaml
  print(f"saved {out}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint"),
                      help="HF directory to write (default: the package's rft_jax/demo/checkpoint)")
  parser.add_argument("--steps", type=int, default=2400)
  parser.add_argument("--problems", type=int, default=8000, help="distinct problems, none of them held out")
  parser.add_argument("--max-digits", type=int, default=2)
  parser.add_argument("--slip-rate", type=float, default=0.3,
                      help="fraction of worked answers in which the teacher forgets a carry")
  args = parser.parse_args()
  build(args.out, steps=args.steps, problems=args.problems, max_digits=args.max_digits,
        slip_rate=args.slip_rate)


if __name__ == "__main__":
  main()
