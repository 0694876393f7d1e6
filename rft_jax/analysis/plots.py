"""The paper's figures from one or several runs' ``metrics.jsonl``, side by side, as PNG.

Panels: policy entropy (of the training batch, and of the held-out answers where evaluated);
reward and accuracy (with evaluation Avg@K where logged); PPO
clip fractions and entropy-mask fractions; the Corollary 4 forecast of the entropy
change against the measured change (where ``forecast_every`` was set). Per-step series of
the training batch are drawn faintly with their running mean on top: they vary with the
batch's prompts as much as with the policy. Each run has one colour, each series of a panel
one line style (the legends list both), so that several runs can be told apart.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from rft_jax.train.metrics_log import read_metrics


def metric_series(records: Sequence[dict], key: str) -> tuple[list, list]:
  """``(steps, values)`` of a metric over a run's records, where it was logged."""
  points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
  return [p[0] for p in points], [p[1] for p in points]


def running_mean(values: Sequence[float], window: int) -> np.ndarray:
  """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
  sums = np.cumsum(np.concatenate([[0.0], np.asarray(values, np.float64)]))
  ends = np.arange(1, len(values) + 1)
  starts = np.maximum(ends - window, 0)
  return (sums[ends] - sums[starts]) / (ends - starts)


def plot_per_step(ax, records, key, color, style="-", *, label: str | None = None, windows: int = 10):
  """A per-step series, faint, under its running mean over ``1 / windows`` of the steps;
  labelled ``label`` (default: ``key``)."""
  steps, values = metric_series(records, key)
  if not steps:
    return
  window = max(len(steps) // windows, 1)
  ax.plot(steps, running_mean(values, window), style, color=color, label=key if label is None else label)
  if window > 1:
    ax.plot(steps, values, style, color=color, alpha=0.25, linewidth=0.8)


def _forecast_pairs(records: Sequence[dict], forecast: str = "entropy/forecast") -> np.ndarray:
  """``[N, 2]``: (forecast, measured) entropy change of each step that has both."""
  return np.array([(r[forecast], r["entropy/measured"]) for r in records
                   if r.get(forecast) is not None and r.get("entropy/measured") is not None],
                  np.float64).reshape(-1, 2)


def forecast_correlation(records: Sequence[dict], forecast: str = "entropy/forecast") -> float:
  """Pearson correlation over a run's steps of a forecast of the entropy change with the
  measured change (NaN under 3 steps or with a constant series).

  ``entropy/forecast`` is Corollary 4's ``-lr Cov(A, S_* - E_p[S])``, first-order in a logit step
  of size ``lr``; an optimizer moves parameters instead, so the two agree in sign and proportion,
  not in scale. ``entropy/first_order`` is the exact first-order change under the update applied
  (the jvp along the parameters' change), which should track the measurement in scale too."""
  pairs = _forecast_pairs(records, forecast)
  if len(pairs) < 3 or np.any(np.std(pairs, axis=0) == 0):
    return float("nan")
  return float(np.corrcoef(pairs.T)[0, 1])


def correlation_label(r: float) -> str:
  """``r = 0.83``; ``r = n/a`` where there is none (under 3 steps, or a constant series)."""
  return "r = n/a" if not np.isfinite(r) else f"r = {r:.2f}"


# One line style per series of a panel (the same for every run); the colour says the run.
TRAINING_STYLE = "-"
EVAL_STYLES = ("o--", "s-.", "^:", "D--", "v-.")  # one per evaluation set, in key order
FRACTION_STYLES = {"mask/frac": "-", "mask/method_frac": "--", "actor/pg_clipfrac_low": ":",
                   "actor/pg_clipfrac_high": "-."}


def run_names(run_dirs: Sequence[str]) -> list[str]:
  """Each run's directory name, or its last two path parts where names repeat."""
  paths = [os.path.normpath(os.path.abspath(d)) for d in run_dirs]
  names = [os.path.basename(p) for p in paths]
  return [os.path.join(os.path.basename(os.path.dirname(p)), n) if names.count(n) > 1 else n
          for p, n in zip(paths, names)]


def run_colors(count: int) -> list:
  """``count`` distinct colours (tab10, tab20 above 10 runs, a colour map above 20)."""
  import matplotlib

  if count <= 20:
    cmap = matplotlib.colormaps["tab10" if count <= 10 else "tab20"]
    return [cmap(i) for i in range(count)]
  return [matplotlib.colormaps["viridis"](i / (count - 1)) for i in range(count)]


def default_out_path(run_dirs: Sequence[str]) -> str:
  """Where ``rft-jax plot`` writes without ``--out``: ``plots.png`` beside the first run's
  metrics (in its run directory)."""
  return os.path.join(run_dirs[0], "plots.png")


def draw_runs(run_dirs: Sequence[str]):
  """The runs' curves as a matplotlib ``Figure`` of four panels (entropy, accuracy, clip and
  mask fractions, forecast vs measured entropy change): one colour per run, one line style
  per series; each panel's legend names the runs (colours) and the series (styles)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.lines import Line2D

  fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
  colors = run_colors(len(run_dirs))
  series = [{} for _ in axes]  # per panel: label -> line style, in drawing order
  eval_styles = [{}, {}]  # of the entropy and accuracy panels: evaluation label -> style
  for name, run_dir, color in zip(run_names(run_dirs), run_dirs, colors):
    records = read_metrics(run_dir)
    for panel, key, label in ((0, "actor/entropy", "training batch"), (1, "train/accuracy", "train acc")):
      if metric_series(records, key)[0]:
        plot_per_step(axes[panel], records, key, color, TRAINING_STYLE)
        series[panel].setdefault(label, TRAINING_STYLE)
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/")})
    for panel, keys in ((0, [k for k in eval_keys if k.endswith("/entropy")]),
                        (1, [k for k in eval_keys if "/avg@" in k])):
      for key in keys:
        label = key[len("eval/"):]  # <set>/avg@k, <set>/entropy
        style = eval_styles[panel].setdefault(label, EVAL_STYLES[len(eval_styles[panel]) % len(EVAL_STYLES)])
        series[panel][label] = style
        axes[panel].plot(*metric_series(records, key), style, color=color, label=label)
    for key, style in FRACTION_STYLES.items():
      if metric_series(records, key)[0]:
        plot_per_step(axes[2], records, key, color, style)
        series[2].setdefault(key, style)
    pairs = _forecast_pairs(records)
    if len(pairs):
      axes[3].scatter(pairs[:, 0], pairs[:, 1], s=12, color=color,
                      label=f"{name} ({correlation_label(forecast_correlation(records))})")
  titles = ("policy entropy (nats / token)", "accuracy", "clip and mask fractions",
            "entropy change: forecast vs measured")
  run_handles = [Line2D([], [], color=c, label=n) for n, c in zip(run_names(run_dirs), colors)]
  for ax, title, styles in zip(axes, titles, series):
    ax.set_title(title)
    ax.set_xlabel("step")
    if ax is axes[3]:
      if ax.has_data():
        ax.legend(fontsize=7)
    elif ax.has_data():
      style_handles = [Line2D([], [], linestyle=_linestyle(s), marker=_marker(s), color="0.4", label=label)
                       for label, s in styles.items()]
      ax.legend(handles=run_handles + style_handles, fontsize=7)
  axes[3].set_xlabel("forecast -lr Cov(A, S* - E[S])")
  axes[3].set_ylabel("measured")
  fig.tight_layout()
  return fig


def _marker(style: str) -> str:
  return style[0] if style[0] in "osD^v" else ""


def _linestyle(style: str) -> str:
  return style[1:] if _marker(style) else style


def plot_runs(run_dirs: Sequence[str], out_path: str | None = None) -> str:
  """Draws the runs' curves (:func:`draw_runs`) into ``out_path`` (PNG; default
  :func:`default_out_path`, beside the first run) and returns the path."""
  out_path = out_path or default_out_path(run_dirs)
  fig = draw_runs(run_dirs)
  import matplotlib.pyplot as plt

  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  fig.savefig(out_path, dpi=110)
  plt.close(fig)
  return out_path
