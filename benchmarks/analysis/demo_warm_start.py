"""How well the demo's warm start adds: held-out accuracy by the number of carries in the sum.

Evaluates a checkpoint (default: the shipped one) on the demo's 256 held-out problems with
the demo's prompt and answer length (``configs/demo.yaml``), greedily and at T = 0.7 and 1.0 (4 answers each), and prints the
accuracy over all problems and over those whose sum has 0, 1 and 2 carries. A student of
the careless teacher (``rft_jax/demo/build.py``) should add almost perfectly where nothing
carries and forget a carry about as often as its teacher (30%) where one is due: that is
what RL then has to fix.

    python benchmarks/analysis/demo_warm_start.py [--model rft_jax/demo/checkpoint]
"""

from __future__ import annotations

import argparse

import numpy as np

from rft_jax.data.prompts import prompt_ids, stop_token_ids
from rft_jax.demo.task import carrying_columns, heldout_problems
from rft_jax.models import load_hf, load_tokenizer
from rft_jax.train.config import load_config
from rft_jax.train.evaluate import evaluate


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="rft_jax/demo/checkpoint")
  args = parser.parse_args()
  cfg = load_config("configs/demo.yaml")
  model, tokenizer = load_hf(args.model), load_tokenizer(args.model)
  problems = heldout_problems()
  carries = np.array([len(carrying_columns(*map(int, p.id.split("+")))) for p in problems])
  groups = [(f"{n} carries", carries == n) for n in range(carries.max() + 1)]
  print(f"{args.model}: {len(problems)} held-out problems "
        + ", ".join(f"{name} {mask.sum()}" for name, mask in groups))
  print(f"{'sampling':<14} {'all':>6} " + " ".join(f"{name:>10}" for name, _ in groups))
  for temperature, k in ((0.0, 1), (0.7, 4), (1.0, 4)):
    correct = evaluate(model, tokenizer, problems, k=k, temperature=temperature,
                       max_new_tokens=cfg.sampling.max_new_tokens,
                       stop_ids=stop_token_ids(tokenizer, model.config.eos_token_id), rewards=cfg.rewards,
                       prompt_fn=lambda q: prompt_ids(tokenizer, cfg.data, q))["correct"].mean(axis=1)
    name = "greedy" if temperature == 0 else f"T={temperature}, k={k}"
    print(f"{name:<14} {correct.mean():>6.3f} " + " ".join(f"{correct[m].mean():>10.3f}" for _, m in groups))


if __name__ == "__main__":
  main()
