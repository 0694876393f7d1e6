"""Evaluation of a policy on held-out problems: Avg@K and unbiased Pass@K at a temperature.

With ``entropy_temperature`` it also reports the policy's token-mean entropy over the sampled
answers, under ``softmax(z / entropy_temperature)`` (the training runs pass the rollout
temperature): the same prompts every time, so across evaluations it follows the policy rather
than the composition of a training batch.

Used every ``eval.every`` training steps (on the validation split and the configured
sets) and by ``rft-jax eval`` on a checkpoint or a Hugging Face directory.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from rft_jax.data import MathExample, tokenize_prompts
from rft_jax.data.prompts import prompt_ids
from rft_jax.entropy import token_stats
from rft_jax.eval import avg_at_k, pass_at_k_from_samples
from rft_jax.parallel import global_array, host_array
from rft_jax.rewards import RewardConfig, score_batch
from rft_jax.rewards.user_functions import example_rows
from rft_jax.rl.learner import LearnerBatch, learner_batch
from rft_jax.sampling import SamplingParams, generate


def evaluate(model, tokenizer, problems: Sequence[MathExample], *, k: int, temperature: float,
             max_new_tokens: int, stop_ids: tuple[int, ...], rewards: RewardConfig, prompt_fn,
             seed: int = 0, mesh=None, max_prompt_len: int = 4096, batch_prompts: int = 64,
             entropy_temperature: float | None = None, entropy_rows: int = 16,
             max_rollouts_per_call: int | None = None, completions: bool = False,
             trajectories=None) -> dict[str, Any]:
  """Samples ``k`` answers per problem; returns Avg@k, Pass@k, the correctness matrix and, with
  ``entropy_temperature``, the mean entropy per answer token (``entropy_rows`` answers per
  forward pass). ``max_rollouts_per_call``: as ``SamplingParams`` (a run passes its
  ``sampling.max_rollouts_per_call``, so evaluation fits where training rollouts do). With
  ``completions``, ``result["completions"]`` lists every answer with its score (one dict each:
  problem index, question, reference answer, sample, completion, reward, correct, length,
  finish reason). ``trajectories``: a multi-turn run's sampler, ``(problems, params, seed) ->
  (rollouts, texts, scored)`` with its environment (its verdicts are ``correct``), used instead of
  one answer per sample; the entropy is then its model tokens'."""
  prompts, too_long = tokenize_prompts(problems, prompt_fn, max_prompt_len)
  params = SamplingParams(n=k, temperature=temperature, max_new_tokens=max_new_tokens,
                          stop_token_ids=stop_ids, record_routing=False,  # nothing reads it here
                          max_rollouts_per_call=(None if max_rollouts_per_call is None
                                                 else max(max_rollouts_per_call, k)))
  correct, lengths, entropy_sum, entropy_count, records = [], [], 0.0, 0.0, []
  for start in range(0, len(prompts), batch_prompts):
    chunk = prompts[start:start + batch_prompts]
    examples = [chunk[i // k].example for i in range(len(chunk) * k)]
    if trajectories is not None:
      rollouts, texts, scored = trajectories([p.example for p in chunk], params, seed + start)
    else:
      rollouts = generate(model, [list(p.token_ids) for p in chunk], params, seed=seed + start, mesh=mesh)
      texts = tokenizer.batch_decode(rollouts.completions(), skip_special_tokens=True)
      scored = score_batch(texts, [e.answer for e in examples], list(rollouts.finish_reason),
                           [int(x) for x in rollouts.completion_lengths], rewards,
                           rows=example_rows(examples))
    correct.append(np.asarray(scored.correct, bool).reshape(len(chunk), k))
    if completions:
      records += [{"problem": start + int(p), "question": examples[i].question, "answer": examples[i].answer,
                   "sample": i % k, "completion": texts[i], "reward": float(scored.reward[i]),
                   "correct": bool(scored.correct[i]), "length": int(rollouts.completion_lengths[i]),
                   "finish_reason": str(rollouts.finish_reason[i])}
                  for i, p in enumerate(rollouts.prompt_index)]
    lengths.append(rollouts.completion_lengths)
    if entropy_temperature is not None:
      total, count = answer_entropy(model, learner_batch(rollouts), entropy_temperature,
                                    entropy_rows, mesh)
      entropy_sum, entropy_count = entropy_sum + total, entropy_count + count
  matrix = np.concatenate(correct) if correct else np.zeros((0, k), bool)
  return {"avg": float(avg_at_k(matrix)) if len(matrix) else float("nan"),
          "pass": float(pass_at_k_from_samples(matrix, k)) if len(matrix) else float("nan"),
          "correct": matrix, "prompts_too_long": too_long,
          "entropy": entropy_sum / entropy_count if entropy_count else float("nan"),
          **({"completions": records} if completions else {}),
          "response_length_mean": float(np.concatenate(lengths).mean()) if lengths else float("nan")}


@nnx.jit(static_argnames=("temperature", "mesh"))
def _entropy_sums(model, input_ids, attention_mask, response_mask, temperature: float, mesh=None):
  hidden = model(input_ids, attention_mask, return_hidden=True, mesh=mesh)
  stats = token_stats(hidden[:, :-1], input_ids[:, 1:], unembedding=model.unembedding(),
                      product_dtype=model.config.dtype, temperature=temperature)
  mask = response_mask[:, 1:].astype(jnp.float32)  # position t predicts token t + 1
  return jnp.sum(stats.entropy * mask), jnp.sum(mask)


def answer_entropy(model, batch: LearnerBatch, temperature: float, rows: int,
                   mesh=None) -> tuple[float, float]:
  """``(sum of entropies, number of answer tokens)`` of a batch's answers (its advantages unused), ``rows``
  at a time (the last block zero-padded, so one compiled program serves every block); with a
  mesh (the model's) the block's rows are split over its ``data`` axis (``rows`` rounded up to
  a multiple of it), as the learner's are."""
  if mesh is not None:
    rows = -(-rows // mesh.shape["data"]) * mesh.shape["data"]
  total = count = 0.0
  for start in range(0, len(batch.input_ids), rows):
    block = [v[start:start + rows] for v in (batch.input_ids, batch.attention_mask, batch.response_mask)]
    block = [np.pad(v, ((0, rows - len(v)), (0, 0))) for v in block]
    block = [jnp.asarray(v) if mesh is None else global_array(v, NamedSharding(mesh, P("data")))
             for v in block]
    s, c = _entropy_sums(model, *block, float(temperature), mesh)
    total, count = total + float(host_array(s)), count + float(host_array(c))
  return total, count


def evaluate_problems(run, state, completions: list | None = None) -> dict[str, float]:
  """The periodic evaluation of a training run (validation split + configured sets); with a
  ``completions`` list, every sampled answer is appended to it (with ``set``: the set's name)."""
  cfg = run.config
  sets: list[tuple[str, list[MathExample], int]] = []
  if run.validation:
    sets.append(("val", run.validation[: cfg.eval.max_val_problems], cfg.eval.val_k))
  for s in cfg.eval.sets:
    sets.append((s.name, run.eval_sets[s.name], s.k))
  model = run.learner.model(state)
  metrics = {}
  for name, problems, k in sets:
    result = evaluate(model, run.tokenizer, problems, k=k, temperature=cfg.eval.temperature,
                      max_new_tokens=cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
                      stop_ids=run.stop_ids, rewards=cfg.rewards,
                      prompt_fn=lambda q: prompt_ids(run.tokenizer, cfg.data, q), seed=cfg.seed, mesh=run.mesh,
                      entropy_temperature=run.learner.config.sampling_temperature,
                      max_rollouts_per_call=cfg.sampling.max_rollouts_per_call,
                      completions=completions is not None,
                      trajectories=None if run.agent is None else run.agent.sampler(
                          cfg, model, run.tokenizer, run.mesh))
    if completions is not None:
      completions += [{"set": name, **r} for r in result["completions"]]
    metrics[f"eval_{name}_avg@{k}"] = result["avg"]
    metrics[f"eval_{name}_pass@{k}"] = result["pass"]
    metrics[f"eval_{name}_entropy"] = result["entropy"]
  return metrics
