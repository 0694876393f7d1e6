"""The learner step on a long-tailed batch: row micro-batches against token micro-batches
(``learner.micro_batch_tokens``, issue 33 point 3).

RL completions are long-tailed: lengths drawn geometric (stop with probability ``p = 1/200`` per
token, mean ~200) truncated at the maximum. Shapes (``SHAPES``): ``a`` 128 rows, completions of
at most 1,024 tokens; ``b`` 512 rows, at most 512; prompts of 16-48 random tokens left-padded to
48, the completion block the full maximum (as the loop's ``chosen_batch`` gives the learner: the
width rounded up to a multiple of 16). Models: ``MODELS`` of ``benchmarks/speed/learner_step.py``
(``small`` ~5M and ``large`` ~40M parameters, float32, the peers' models).

Contenders, the same config but for the micro-batching: ``rows``, micro-batches of
``--micro`` rows (8) padded to the batch's width, today's path; ``tokens``, packed micro-batches of
``micro x width`` token slots (the same micro-batch shape, so the same peak activation memory).
Each compiles on a first step from the same parameters, whose updates are compared
(``max |d_rows - d_tokens| / max |d_rows|`` of the parameter moves, with Adam's epsilon 1 so the
move is about linear in the gradient; and the relative difference of loss and gradient norm);
then ``--warmup`` steps each, then ``--repeats`` rounds alternating the two contenders; the
table gives the median seconds per step (``Learner.step``, metrics read back) and the speedup.

    python benchmarks/speed/learner_longtail.py [--models small large] [--shapes a b] [--repeats 3]

``learner_longtail_rows(model, shape, ...)`` returns the table's rows as dicts (for
``benchmarks/peers/longtail.py``).

On the 2-core CPU of the development machine, shared with other benchmarks while it ran (load
average 3.4-6), ``--models small --shapes a --repeats 2 --warmup 0`` (lr 1e-3 then): rows 282 s
(258-306), tokens 97 s (91-103) a step, 2.90x (per round 2.84x, 2.96x); 25% of the batch's slots
are real tokens; first steps (compile included) 383 s and 114 s; loss equal to 2.5e-7, gradient
norm equal. ``--models small --shapes b --repeats 1 --warmup 0`` (2026-11-27, load average 1.5-2):
rows 255 s, tokens 97.2 s a step, 2.62x; first steps 311 s and 115 s; 39% of the slots real;
parameter moves equal to 4.4e-6 of their size, loss to 8.6e-8. ``--models large --shapes b
--repeats 1 --warmup 0`` (2026-11-27, other work beside it at lower priority): rows 1,612 s,
tokens 636 s a step, 2.53x; first steps 1,642 s and 728 s; parameter moves equal to 7.5e-5 of
their size, loss to 8.6e-8, gradient norm equal. ``--models large --shapes a --repeats 1
--warmup 0`` (2026-11-27, another machine: an AVX-512 EPYC, quiet): rows 514 s, tokens 164 s a
step, 3.13x; first steps 504 s and 169 s; parameter moves equal to 2.5e-5 of their size, loss to
2.5e-7, gradient norm equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from speed.learner_step import MODELS, build  # noqa: E402

from rft_jax.rl.config import EntropyMaskConfig, LearnerConfig  # noqa: E402
from rft_jax.rl.learner import Learner, LearnerBatch  # noqa: E402
from rft_jax.rl.optimizer import OptimizerConfig  # noqa: E402

SHAPES = {"a": dict(rows=128, max_completion=1024), "b": dict(rows=512, max_completion=512)}
PROMPT = (16, 48)
STOP_P = 1 / 200


def longtail_batch(vocab: int, rows: int, max_completion: int, stop_p: float = STOP_P,
                   seed: int = 0) -> LearnerBatch:
  """``rows`` sequences ``[48 prompt | max_completion]`` (width rounded up to 16): prompts of
  16-48 tokens left-padded, completions of ``min(Geometric(stop_p), max_completion)`` tokens
  right-padded; random tokens, advantages of both signs in groups of 8, sampler log-probs."""
  rng = np.random.default_rng(seed)
  prompt = PROMPT[1]
  width = -(-(prompt + max_completion) // 16) * 16
  prompt_len = rng.integers(PROMPT[0], PROMPT[1] + 1, rows)
  completion_len = np.minimum(rng.geometric(stop_p, rows), max_completion)
  column = np.arange(width)[None]
  prompt_mask = (column >= prompt - prompt_len[:, None]) & (column < prompt)
  response_mask = (column >= prompt) & (column < prompt + completion_len[:, None])
  attention = prompt_mask | response_mask
  ids = np.where(attention, rng.integers(1, vocab, (rows, width)), 0)
  rewards = rng.random(rows).reshape(-1, 8)
  advantages = ((rewards - rewards.mean(1, keepdims=True)) / rewards.std(1, keepdims=True)).reshape(-1)
  sampler_logp = np.where(response_mask, -rng.exponential(2.0, (rows, width)), 0.0)
  return LearnerBatch(input_ids=jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(attention, jnp.int32),
                      response_mask=jnp.asarray(response_mask, jnp.float32),
                      advantages=jnp.asarray(advantages, jnp.float32),
                      sampler_logp=jnp.asarray(sampler_logp, jnp.float32))


def _contender(model: str, config: LearnerConfig):
  """A learner and its fresh state, and the starting parameters (host copies)."""
  policy = build(model)
  start = [np.asarray(x) for x in jax.tree.leaves(nnx.state(policy, nnx.Param))]
  learner = Learner(policy, config)
  return learner, learner.init(policy), start


def _timed_step(learner: Learner, state, batch, label: str = ""):
  begin = time.perf_counter()
  state, metrics = learner.step(state, batch)  # reads the metrics back: the step has finished
  jax.block_until_ready(state.params)
  seconds = time.perf_counter() - begin
  print(f"  {label}: {seconds:.2f} s", file=sys.stderr, flush=True)  # progress
  return state, metrics, seconds


def learner_longtail_rows(model: str, shape: str = "a", *, micro: int = 8, repeats: int = 3,
                          warmup: int = 1, mask: str = "none", seed: int = 0) -> list[dict]:
  """Times the learner step of ``model`` (``small`` / ``large``) on the long-tailed batch of
  ``shape`` (``a`` / ``b``, :data:`SHAPES`) with row and with token micro-batches.

  Returns:
    one dict per contender (``rows``, ``tokens``): ``model``, ``shape``, ``rows``, ``width``,
    ``real_tokens`` (share of the batch's slots that are real tokens), ``contender``,
    ``micro_batch`` (rows, or token slots), ``compile_s`` (the first step), ``median_s``,
    ``min_s``, ``max_s``, ``speedup`` (rows' median / this median), ``param_rel_diff`` (the
    first updates' largest difference relative to the largest move; 0 for ``rows``),
    ``loss_rel_diff``, ``grad_norm_rel_diff``.
  """
  batch = longtail_batch(MODELS[model]["vocab_size"], seed=seed, **SHAPES[shape])
  rows, width = batch.input_ids.shape
  # lr 1 and Adam's epsilon 1: the first move is about the (clipped) gradient itself, large
  # enough that float32 rounding of the updated parameters does not hide its differences.
  base = dict(optim=OptimizerConfig(lr=1.0, adam_eps=1.0), micro_batch_size=micro, forecast_every=0,
              entropy_mask=EntropyMaskConfig(kind=mask))
  configs = {"rows": LearnerConfig(**base),
             "tokens": LearnerConfig(**base, micro_batch_tokens=micro * width)}
  runs = {}
  for name, config in configs.items():  # compile on the first step, from the same parameters
    learner, state, start = _contender(model, config)
    state, metrics, compile_s = _timed_step(learner, state, batch, f"{model} {shape} {name} first step")
    moves = [np.asarray(b) - a for a, b in zip(start, jax.tree.leaves(state.params))]
    for _ in range(warmup):
      state, _, _ = _timed_step(learner, state, batch, f"{model} {shape} {name} warm-up")
    runs[name] = dict(learner=learner, state=state, metrics=metrics, moves=moves, compile_s=compile_s, times=[])
  for _ in range(repeats):  # alternate: both see the same machine load
    for name, run in runs.items():
      run["state"], _, seconds = _timed_step(run["learner"], run["state"], batch, f"{model} {shape} {name}")
      run["times"].append(seconds)
  reference = runs["rows"]
  scale = max(float(np.max(np.abs(m))) for m in reference["moves"])
  out = []
  for name, run in runs.items():
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(reference["moves"], run["moves"]))
    rel = lambda key: abs(run["metrics"][key] - reference["metrics"][key]) / max(abs(reference["metrics"][key]), 1e-30)
    out.append(dict(model=model, shape=shape, rows=rows, width=width,
                    real_tokens=float(np.mean(np.asarray(batch.attention_mask))), contender=name,
                    micro_batch=micro if name == "rows" else micro * width, compile_s=run["compile_s"],
                    median_s=statistics.median(run["times"]), min_s=min(run["times"]), max_s=max(run["times"]),
                    speedup=statistics.median(reference["times"]) / statistics.median(run["times"]),
                    param_rel_diff=diff / scale, loss_rel_diff=rel("loss"), grad_norm_rel_diff=rel("grad_norm")))
  return out


def print_table(models, shapes, *, micro: int = 8, repeats: int = 3, warmup: int = 1,
                mask: str = "none") -> None:
  """:func:`learner_longtail_rows` of every model and shape, as a table."""
  print(f"backend {jax.default_backend()} ({jax.device_count()} devices, {os.cpu_count()} cpus), float32, "
        f"entropy_mask {mask}, load average {os.getloadavg()[0]:.1f}")
  print(f"{'model':<6} {'shape':<5} {'rows x width':>12} {'real':>5} {'contender':<9} {'micro-batch':>11} "
        f"{'compile s':>9} {'median s':>8} {'min s':>7} {'max s':>7} {'speedup':>7} {'d params':>8} "
        f"{'d loss':>8} {'d gnorm':>8}")
  for model in models:
    for shape in shapes:
      for r in learner_longtail_rows(model, shape, micro=micro, repeats=repeats, warmup=warmup,
                                     mask=mask):
        print(f"{r['model']:<6} {r['shape']:<5} {r['rows']:>5} x {r['width']:<4} {r['real_tokens']:5.2f} "
              f"{r['contender']:<9} {r['micro_batch']:>11} {r['compile_s']:9.1f} {r['median_s']:8.2f} "
              f"{r['min_s']:7.2f} {r['max_s']:7.2f} {r['speedup']:7.2f} {r['param_rel_diff']:8.1e} "
              f"{r['loss_rel_diff']:8.1e} {r['grad_norm_rel_diff']:8.1e}", flush=True)
  print(f"load average {os.getloadavg()[0]:.1f}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["small", "large"])
  parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["a", "b"])
  parser.add_argument("--micro", type=int, default=8, help="rows per micro-batch of today's path")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--mask", default="none", help="entropy_mask.kind")
  args = parser.parse_args()
  print_table(args.models, args.shapes, micro=args.micro, repeats=args.repeats,
              warmup=args.warmup, mask=args.mask)


if __name__ == "__main__":
  main()
