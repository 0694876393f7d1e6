"""The paper's figures from one or several runs' ``metrics.jsonl``, side by side, as PNG.

Panels: policy entropy (of the training batch, and of the held-out answers where evaluated);
reward and accuracy (with evaluation Avg@K where logged); PPO
clip fractions and entropy-mask fractions; the Corollary 4 forecast of the entropy
change against the measured change (where ``forecast_every`` was set). Per-step series of
the training batch are drawn faintly with their running mean on top: they vary with the
batch's prompts as much as with the policy.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from rft_jax.train.metrics_log import read_metrics


def _series(records, key):
  points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
  return [p[0] for p in points], [p[1] for p in points]


def running_mean(values: Sequence[float], window: int) -> np.ndarray:
  """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
  sums = np.cumsum(np.concatenate([[0.0], np.asarray(values, np.float64)]))
  ends = np.arange(1, len(values) + 1)
  starts = np.maximum(ends - window, 0)
  return (sums[ends] - sums[starts]) / (ends - starts)


def _plot_per_step(ax, records, key, label, style="-", **kw):
  """A per-step series, faint, under its running mean (a tenth of the steps); returns the line."""
  steps, values = _series(records, key)
  window = max(len(steps) // 10, 1)
  line, = ax.plot(steps, running_mean(values, window), style, label=label, **kw)
  if window > 1:
    ax.plot(steps, values, style, color=line.get_color(), alpha=0.25, linewidth=0.8)
  return line


def _forecast_pairs(records: Sequence[dict]) -> np.ndarray:
  """``[N, 2]``: (forecast, measured) entropy change of each step that has both."""
  return np.array([(r["entropy_change_forecast"], r["entropy_change_measured"]) for r in records
                   if r.get("entropy_change_forecast") is not None
                   and r.get("entropy_change_measured") is not None], np.float64).reshape(-1, 2)


def forecast_correlation(records: Sequence[dict]) -> float:
  """Pearson correlation over a run's steps of the Corollary 4 forecast
  ``-lr Cov(A, S_* - E_p[S])`` with the measured entropy change (NaN under 3 steps or with
  a constant series). The forecast is first-order in a logit step of size ``lr``; an optimizer
  moves parameters instead, so the two agree in sign and proportion, not in scale."""
  pairs = _forecast_pairs(records)
  if len(pairs) < 3 or np.any(np.std(pairs, axis=0) == 0):
    return float("nan")
  return float(np.corrcoef(pairs.T)[0, 1])


def plot_runs(run_dirs: Sequence[str], out_path: str) -> str:
  """Draws the runs' curves into ``out_path`` (PNG) and returns the path."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs = {os.path.basename(os.path.normpath(d)): read_metrics(d) for d in run_dirs}
  fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
  for name, records in runs.items():
    entropy_line = _plot_per_step(axes[0], records, "entropy", f"{name} training batch")
    for key in sorted({k for r in records for k in r if k.startswith("eval_") and k.endswith("_entropy")}):
      axes[0].plot(*_series(records, key), "o--", color=entropy_line.get_color(),
                   label=f"{name} {key[5:]}")
    line = _plot_per_step(axes[1], records, "accuracy", f"{name} train acc")
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval_") and "avg@" in k})
    for key in eval_keys:
      axes[1].plot(*_series(records, key), "o--", color=line.get_color(), label=f"{name} {key[5:]}")
    for key, style in (("clip_frac_low", ":"), ("clip_frac_high", "--"), ("mask_frac", "-")):
      _plot_per_step(axes[2], records, key, f"{name} {key}", style)
    pairs = _forecast_pairs(records)
    if len(pairs):
      axes[3].scatter(pairs[:, 0], pairs[:, 1], s=12, label=f"{name} (r = {forecast_correlation(records):.2f})")
  titles = ("policy entropy (nats / token)", "accuracy", "clip and mask fractions",
            "entropy change: forecast vs measured")
  for ax, title in zip(axes, titles):
    ax.set_title(title)
    ax.set_xlabel("step")
    if ax.has_data():
      ax.legend(fontsize=7)
  axes[3].set_xlabel("forecast -lr Cov(A, S* - E[S])")
  axes[3].set_ylabel("measured")
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  fig.savefig(out_path, dpi=110)
  plt.close(fig)
  return out_path
