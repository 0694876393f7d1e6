"""The paper's Figures 1-5 at demo scale, drawn from finished runs (PNG, matplotlib).

Per-step series of the training batch are drawn faintly under their running mean over a quarter
of the steps (``rft_jax.analysis.plots.plot_per_step``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from matplotlib.ticker import MaxNLocator

from rft_jax.analysis.plots import plot_per_step
from rft_jax.eval.metrics import pass_rate_histogram
from rft_jax.figures.claims import minus_covariance
from rft_jax.figures.results import RunResult

GRPO_COLOR = "0.45"
PANEL_TITLES = {("only", "pos"): "(a) positive samples: only these tokens",
                ("only", "neg"): "(b) negative samples: only these tokens",
                ("drop", "pos"): "(c) positive samples: GRPO without these tokens",
                ("drop", "neg"): "(d) negative samples: GRPO without these tokens"}


def _figure(rows: int, cols: int, width: float = 5.2, height: float = 3.6):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
  return fig, axes


def _one_panel():
  fig, axes = _figure(1, 1, width=7)
  return fig, axes[0, 0]


def _save(fig, path: str) -> str:
  import matplotlib.pyplot as plt

  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def _curve(ax, run: RunResult, key: str, color, label: str) -> None:
  plot_per_step(ax, run.steps, key, color, label=label, windows=4)
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def figure1(path: str, runs: Mapping[tuple[str, str, str], RunResult], grpo: RunResult,
            panels: Mapping[tuple[str, str], str]) -> str:
  """Training-batch entropy of the sign-mask runs against GRPO, one panel per experiment."""
  fig, axes = _figure(2, 2)
  for ax, (action, samples) in zip(axes.flat, PANEL_TITLES):
    _curve(ax, grpo, "actor/entropy", GRPO_COLOR, "GRPO")
    _curve(ax, runs[(action, samples, "pos")], "actor/entropy", "tab:red", "S* > 0 tokens")
    _curve(ax, runs[(action, samples, "neg")], "actor/entropy", "tab:blue", "S* < 0 tokens")
    ax.set_title(f"{PANEL_TITLES[(action, samples)]}: {panels[(action, samples)]}", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("entropy (nats / token)")
    ax.legend(fontsize=7)
  return _save(fig, path)


def figure2(path: str, method_runs: Mapping[str, Mapping[float, RunResult]], grpo: RunResult) -> str:
  """Per method (rows): masked share of tokens and training-batch entropy for each cut mu."""
  import matplotlib

  fig, axes = _figure(len(method_runs), 2)
  for row, (method, by_mu) in zip(axes, method_runs.items()):
    cmap = matplotlib.colormaps["viridis"]
    _curve(row[1], grpo, "actor/entropy", GRPO_COLOR, "GRPO (no cut)")
    for i, mu in enumerate(sorted(by_mu)):
      color = cmap(i / max(len(by_mu) - 1, 1) * 0.85)
      _curve(row[0], by_mu[mu], "mask/frac", color, f"mu = {mu:g}")
      _curve(row[1], by_mu[mu], "actor/entropy", color, f"mu = {mu:g}")
    row[0].set_title(f"{method}: share of tokens masked", fontsize=9)
    row[1].set_title(f"{method}: training-batch entropy", fontsize=9)
    for ax in row:
      ax.set_xlabel("step")
      ax.legend(fontsize=7)
  return _save(fig, path)


def figure3(path: str, grpo_runs: Sequence[RunResult]) -> str:
  """Batch means of S_* and of |S_* - E_p[S]| over GRPO's training (log scale)."""
  fig, ax = _one_panel()
  for i, run in enumerate(grpo_runs):
    steps, s_star = run.series("entropy/s_star_mean")
    _, centered = run.series("entropy/s_centered_mean")
    label = f" (seed {i})" if len(grpo_runs) > 1 else ""
    ax.semilogy(steps, np.abs(s_star), "-", color=f"C{i}", label=f"|mean S*|{label}")
    ax.semilogy(steps, np.abs(centered), "--", color=f"C{i}", label=f"|mean(S* - E_p[S])|{label}")
  ax.set_xlabel("step")
  ax.set_title("batch means under GRPO (Corollary 2)", fontsize=9)
  ax.legend(fontsize=7)
  return _save(fig, path)


def figure4(path: str, grpo_runs: Sequence[RunResult], clip_b_runs: Sequence[RunResult]) -> str:
  """Held-out problems by pass rate after training, GRPO against Clip_B (over the seeds)."""
  fig, ax = _one_panel()
  k = grpo_runs[0].correct.shape[1]
  for offset, (name, runs, color) in enumerate((("GRPO", grpo_runs, GRPO_COLOR), ("Clip_B", clip_b_runs, "tab:green"))):
    counts, _ = pass_rate_histogram(np.concatenate([r.correct for r in runs]))
    centers = np.arange(k + 1) / k
    ax.bar(centers + (offset - 0.5) * 0.35 / k, counts, width=0.35 / k, color=color, label=name)
  ax.set_xlabel(f"pass rate of a held-out problem ({k} answers each)")
  ax.set_ylabel(f"problems (over {len(grpo_runs)} seed(s))")
  ax.legend(fontsize=8)
  return _save(fig, path)


def figure5(path: str, grpo_runs: Sequence[RunResult]) -> str:
  """-Cov_B(A, S_* - E_p[S]) of every GRPO step."""
  fig, ax = _one_panel()
  for i, run in enumerate(grpo_runs):
    steps, values = minus_covariance(run)
    ax.plot(steps, values, "o-", markersize=3, color=f"C{i}", label=f"seed {i}")
  ax.axhline(0.0, color="k", linewidth=0.8)
  ax.set_xlabel("step")
  ax.set_ylabel("-Cov_B(A, S* - E_p[S])")
  ax.legend(fontsize=7)
  return _save(fig, path)
