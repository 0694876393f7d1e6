"""Evaluation of a policy on held-out problems: Avg@K and unbiased Pass@K at a temperature.

Used every ``eval.every`` training steps (on the validation split and the configured
sets) and by ``rft-jax eval`` on a checkpoint or a Hugging Face directory.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rft_jax.data import MathExample, load_math_dataset, tokenize_prompts
from rft_jax.eval import avg_at_k, pass_at_k_from_samples
from rft_jax.rewards import RewardConfig, score_batch
from rft_jax.sampling import SamplingParams, generate


def evaluate(model, tokenizer, problems: Sequence[MathExample], *, k: int, temperature: float,
             max_new_tokens: int, stop_ids: tuple[int, ...], rewards: RewardConfig, prompt_fn,
             seed: int = 0, mesh=None, max_prompt_len: int = 4096, batch_prompts: int = 64) -> dict[str, Any]:
  """Samples ``k`` answers per problem; returns Avg@k, Pass@k and the correctness matrix."""
  prompts, too_long = tokenize_prompts(problems, prompt_fn, max_prompt_len)
  params = SamplingParams(n=k, temperature=temperature, max_new_tokens=max_new_tokens,
                          stop_token_ids=stop_ids)
  correct, lengths = [], []
  for start in range(0, len(prompts), batch_prompts):
    chunk = prompts[start:start + batch_prompts]
    rollouts = generate(model, [list(p.token_ids) for p in chunk], params, seed=seed + start, mesh=mesh)
    texts = tokenizer.batch_decode(rollouts.completions(), skip_special_tokens=True)
    answers = [chunk[i].example.answer for i in rollouts.prompt_index]
    scored = score_batch(texts, answers, list(rollouts.finish_reason),
                         [int(x) for x in rollouts.completion_lengths], rewards)
    correct.append(np.asarray(scored.correct, bool).reshape(len(chunk), k))
    lengths.append(rollouts.completion_lengths)
  matrix = np.concatenate(correct) if correct else np.zeros((0, k), bool)
  return {"avg": float(avg_at_k(matrix)) if len(matrix) else float("nan"),
          "pass": float(pass_at_k_from_samples(matrix, k)) if len(matrix) else float("nan"),
          "correct": matrix, "prompts_too_long": too_long,
          "response_length_mean": float(np.concatenate(lengths).mean()) if lengths else float("nan")}


def evaluate_problems(run, state) -> dict[str, float]:
  """The periodic evaluation of a training run (validation split + configured sets)."""
  from rft_jax.train.loop import prompt_ids

  cfg = run.config
  sets: list[tuple[str, list[MathExample], int]] = []
  if run.validation:
    sets.append(("val", run.validation[: cfg.eval.max_val_problems], cfg.eval.val_k))
  for s in cfg.eval.sets:
    problems, _ = load_math_dataset(s.path, s.format, on_bad_row="skip")
    sets.append((s.name, problems, s.k))
  model = run.learner.model(state)
  metrics = {}
  for name, problems, k in sets:
    result = evaluate(model, run.tokenizer, problems, k=k, temperature=cfg.eval.temperature,
                      max_new_tokens=cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
                      stop_ids=run.stop_ids, rewards=cfg.rewards,
                      prompt_fn=lambda q: prompt_ids(run.tokenizer, cfg, q), seed=cfg.seed, mesh=run.mesh)
    metrics[f"eval_{name}_avg@{k}"] = result["avg"]
    metrics[f"eval_{name}_pass@{k}"] = result["pass"]
  return metrics
