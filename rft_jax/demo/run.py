"""``rft-jax demo``: GRPO, GRPO + Clip_B and GRPO + Clip_V on the synthetic task, side by side.

Writes the task's data (training and held-out problems, disjoint), trains the three
variants from the same checkpoint and seed, prints a table (held-out Avg@K and policy entropy
on the held-out answers before and after training, Pass@K, training accuracy over the first
and last quarter of the steps, mask fractions, and the correlation over the steps of the
Corollary 4 forecast of the entropy change with the measured one) and draws the
paper-style plots of the three runs into ``RUN_DIR/demo.png``. ``variants=...`` among the
overrides runs other :data:`VARIANTS` instead (:mod:`rft_jax.demo.methods`): the methods of the
paper's Table 3 (Clip-Cov, KL-Cov, forking tokens, the unlikeliness reward) on the same learner,
or the ``moe_*`` variants, which train the demo's mixture-of-experts model instead (a line per
variant below the table gives its routing mismatch and load-balancing loss).
It runs from any directory
(:mod:`rft_jax.demo.paths`): the default config is the package's ``rft_jax/configs/demo.yaml``,
and the runs, their data and the compilation cache go under ``RUN_DIR``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Sequence

import jax
import numpy as np

from rft_jax.analysis.plots import forecast_correlation, plot_runs
from rft_jax.demo.methods import DEFAULT_VARIANTS, METHODS
from rft_jax.demo.paths import load_demo_config
from rft_jax.demo.task import HELDOUT_SIZE, RL_SEED, addition_problems, heldout_problems, write_problems
from rft_jax.train.loop import train
from rft_jax.train.metrics_log import read_metrics
from rft_jax.train.output_paths import check_directory
from rft_jax.train.preflight import validate_for_training
from rft_jax.train.run_setup import build_run

VARIANTS = METHODS  # the demo runs any of them by name


def split_variants(overrides: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
  """``variants=a,b`` among the demo's overrides: the variants to run (default
  :data:`DEFAULT_VARIANTS`) and the other overrides."""
  chosen = [o for o in overrides if o.startswith("variants=")]
  rest = [o for o in overrides if not o.startswith("variants=")]
  if not chosen:
    return DEFAULT_VARIANTS, rest
  names = tuple(n.strip() for n in chosen[-1].split("=", 1)[1].split(",") if n.strip())
  unknown = [n for n in names if n not in VARIANTS]
  if unknown or not names:
    raise ValueError(f"{chosen[-1]!r}: unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
  return names, rest


def write_demo_data(data_dir: str, train_size: int = 4000, heldout_size: int = HELDOUT_SIZE) -> tuple[str, str]:
  """Training and held-out addition problems (no held-out problem is in the training set)."""
  heldout = heldout_problems(heldout_size)
  train_set = addition_problems(train_size, seed=RL_SEED, exclude={p.id for p in heldout})
  return (write_problems(train_set, os.path.join(data_dir, "train.jsonl")),
          write_problems(heldout, os.path.join(data_dir, "heldout.jsonl")))


def build_demo_run(root: str, overrides: Sequence[str] = ()):
  """The demo's run (``configs/demo.yaml`` + ``overrides``, data written under ``root``, no
  evaluation) and a fresh train state, for benchmarks that look inside one demo step.

  Returns:
    ``(config, run, state)`` as :func:`rft_jax.train.run_setup.build_run` gives them.
  """
  train_path, _ = write_demo_data(os.path.join(root, "data"))
  cfg = load_demo_config(None, [f"run_dir={root}", f"data.train_path={train_path}", "eval.every=0",
                                "progress=false", *overrides])
  return (cfg, *build_run(cfg, validate_for_training(cfg, jax.device_count())))


def _summary(run_dir: str) -> dict[str, float]:
  records = read_metrics(run_dir)
  evals = [r for r in records if any(k.startswith("eval/") for k in r)]
  steps = [r for r in records if r["step"] >= 1]  # step 0: the evaluation before training

  def score(record: dict, kind: str) -> float:  # kind: /avg@, /pass@, /entropy of the (one) set
    return next((v for k, v in record.items() if k.startswith("eval/") and kind in k), float("nan"))

  quarter = max(len(steps) // 4, 1)
  start = evals[0] if evals and evals[0]["step"] == 0 else {}
  end = evals[-1] if evals else {}
  return {
      "heldout_avg_start": score(start, "/avg@"), "heldout_avg": score(end, "/avg@"),
      "heldout_pass": score(end, "/pass@"),
      "entropy_start": score(start, "/entropy"), "entropy_final": score(end, "/entropy"),
      "mask_frac": float(np.mean([r.get("mask/method_frac", r["mask/frac"]) for r in steps])),
      "mask_frac_negative": float(np.mean([r["mask/frac_neg"] for r in steps])),
      "acc_start": float(np.mean([r["train/accuracy"] for r in steps[:quarter]])),
      "acc_end": float(np.mean([r["train/accuracy"] for r in steps[-quarter:]])),
      "forecast_r": forecast_correlation(steps),
      # an MoE policy's (nan for a dense one): the share of completion tokens whose experts the
      # learner's router chose unlike the sampler, and the load-balancing loss, means over the steps
      "routing_mismatch": _mean(steps, "router/routing_mismatch"),
      "load_balancing_loss": _mean(steps, "router/load_balancing_loss"),
  }


def _mean(records: list[dict], key: str) -> float:
  values = [r[key] for r in records if key in r]
  return float(np.mean(values)) if values else float("nan")


def run_demo(config_path: str | None = None, overrides: Sequence[str] = (),
             variants: Sequence[str] = DEFAULT_VARIANTS, *, overwrite: bool = False,
             allow_config_change: bool = False) -> dict[str, dict[str, float]]:
  """Runs the variants and returns their summaries (also printed and plotted).

  ``config_path``: default the package's ``rft_jax/configs/demo.yaml``
  (:func:`rft_jax.demo.paths.load_demo_config` says how its paths are read). Run again, the demo
  works from what it left: a variant whose run is finished is not trained again (one line says
  so, and its row is read from its saved metrics), an interrupted one resumes; ``overwrite``
  trains the variants from the start, deleting their runs; ``allow_config_change`` resumes them
  under a config that changes what they compute (:func:`rft_jax.train.loop.train`).
  """
  base = load_demo_config(config_path, list(overrides))
  check_directory(base.run_dir, "run_dir")
  data_dir = os.path.join(base.run_dir, "data")
  train_path, heldout_path = write_demo_data(data_dir)
  start = time.time()
  summaries = {}
  for name in variants:
    cfg = load_demo_config(config_path, [*overrides, *VARIANTS[name], f"run_dir={os.path.join(base.run_dir, name)}",
                                         f"data.train_path={train_path}"])
    cfg.compilation_cache_dir = base.compilation_cache_dir  # one cache for the variants
    cfg.eval.sets = [dataclasses.replace(s, path=heldout_path) for s in cfg.eval.sets]
    metrics = train(cfg, resume=not overwrite, overwrite=overwrite, allow_config_change=allow_config_change)
    if "reward_mean" not in metrics:  # no step ran: finished by an earlier demo
      print(f"{name}: finished earlier ({metrics['steps_done']} steps in {cfg.run_dir}); its row is read from "
            f"its metrics.jsonl (--overwrite trains it again)")
    summaries[name] = _summary(cfg.run_dir)
  k = base.eval.sets[0].k if base.eval.sets else 0
  print(f"\nrft-jax demo: {base.steps} steps x {base.data.prompts_per_step} prompts x {base.sampling.n} samples "
        f"per variant, {time.time() - start:.0f} s")
  print("\n".join(table(summaries, k)))
  plot = plot_runs([os.path.join(base.run_dir, v) for v in variants], os.path.join(base.run_dir, "demo.png"))
  print(f"plots: {plot}")
  return summaries


def table(summaries: dict[str, dict[str, float]], k: int) -> list[str]:
  """The demo's table, a line per variant (``k``: the held-out set's samples per problem), then
  a line per mixture-of-experts variant with its router's statistics. A forecast correlation
  there is none of (under 3 forecasts) is ``n/a``."""
  w = max(8, *map(len, summaries))  # the variant column
  lines = [f"{'variant':<{w}} {'held-out Avg@' + str(k) + ' start -> end':>27} {'Pass@' + str(k):>7} "
           f"{'held-out entropy start -> end':>30} {'tokens %':>8} {'mask % neg':>10} "
           f"{'train acc first -> last quarter':>32} {'forecast r':>10}"]
  for name, s in summaries.items():
    r = "n/a" if not np.isfinite(s["forecast_r"]) else f"{s['forecast_r']:.2f}"
    lines.append(f"{name:<{w}} {s['heldout_avg_start']:>18.3f} -> {s['heldout_avg']:.3f} {s['heldout_pass']:>7.3f} "
                 f"{s['entropy_start']:>21.4f} -> {s['entropy_final']:.4f} {100 * s['mask_frac']:>8.3f} "
                 f"{100 * s['mask_frac_negative']:>10.3f} {s['acc_start']:>23.3f} -> {s['acc_end']:.3f} "
                 f"{r:>10}")
  for name, s in summaries.items():  # MoE variants only: the dense table is unchanged
    if not np.isnan(s["load_balancing_loss"]):
      lines.append(f"{name:<{w}} router: routing mismatch {100 * s['routing_mismatch']:.2f}% of completion tokens, "
                   f"load-balancing loss {s['load_balancing_loss']:.3f} (means over the steps)")
  return lines
