r"""Evaluation metrics over sampled answers: Avg@K, pass@k, best-of-k, pass-rate histograms.

Inputs are boolean ``correct`` arrays of shape ``[P, n]``: ``P`` problems with ``n``
sampled answers each (``correct[p, j]``: answer ``j`` to problem ``p`` is right).
Pure numpy; nothing here imports the rest of the project.

* **Avg@K** -- mean accuracy with ``K`` samples per problem:
  :math:`\frac{1}{P}\sum_p \frac{1}{K}\sum_{j<K} \text{correct}_{pj}`.
* **pass@k** -- probability that at least one of ``k`` answers drawn **without
  replacement** from the ``n`` is right; unbiased estimator (Chen et al. 2021,
  arXiv 2107.03374, Eq. 1) with :math:`c` right answers out of :math:`n`:

  .. math::
     \text{pass@}k = 1 - \frac{\binom{n-c}{k}}{\binom{n}{k}}
                   = 1 - \prod_{i=n-c+1}^{n} \left(1 - \frac{k}{i}\right),

  and 1 when :math:`n - c < k` (every size-``k`` subset holds a right answer).
  The product form never forms a binomial coefficient, so ``n = 1000`` is fine.
* **best@k by bootstrap** -- ``k`` answers drawn **with replacement**; its
  expectation :math:`1 - (1 - c/n)^k` is below pass@k (1 right of 4 gives 0.68 at
  ``k = 4`` instead of 1). Kept only to compare with frameworks that report it.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Union

import numpy as np


def _correct_matrix(correct) -> np.ndarray:
  arr = np.asarray(correct)
  if arr.ndim != 2 or arr.shape[1] == 0:
    raise ValueError(f"correct must have shape [P, n] with n >= 1, got shape {arr.shape}")
  if arr.dtype != bool and not np.isin(arr, (0, 1)).all():
    raise ValueError("correct must be boolean (or 0/1)")
  return arr.astype(bool)


def avg_at_k(correct, k: Optional[int] = None) -> float:
  r"""Avg@K: :math:`\frac{1}{P}\sum_p \frac{1}{K}\sum_{j<K}\text{correct}_{pj}`.

  Uses the first ``k`` samples of each problem (``k`` None: all ``n``). With the same
  ``n`` for every problem it equals the overall mean accuracy.
  """
  c = _correct_matrix(correct)
  n = c.shape[1]
  k = n if k is None else k
  if not 1 <= k <= n:
    raise ValueError(f"k={k!r} must be in [1, n={n}]")
  return float(c[:, :k].mean(axis=1).mean())


def pass_at_k(n, c, k: int):
  r"""Unbiased pass@k :math:`1 - \prod_{i=n-c+1}^{n}(1 - k/i)` (1 when ``n - c < k``).

  Args:
    n: samples per problem (int or array).
    c: right samples per problem, :math:`0 \le c \le n` (int or array; broadcast with n).
    k: the ``k`` of pass@k, :math:`1 \le k \le n`.

  Returns:
    a float for scalar ``n`` and ``c``, else a float64 array of their broadcast shape.
  """
  n_arr, c_arr = np.broadcast_arrays(np.asarray(n), np.asarray(c))
  if not (np.issubdtype(n_arr.dtype, np.integer) and np.issubdtype(c_arr.dtype, np.integer)):
    raise ValueError(f"n and c must be integers, got dtypes {n_arr.dtype} and {c_arr.dtype}")
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"k must be an int >= 1, got {k!r}")
  if (c_arr < 0).any() or (c_arr > n_arr).any():
    raise ValueError(f"need 0 <= c <= n, got c={c_arr.tolist()} for n={n_arr.tolist()}")
  if (n_arr < k).any():
    raise ValueError(f"k={k} exceeds the number of samples n={n_arr.min()}")
  out = np.empty(n_arr.shape, np.float64)
  for idx in np.ndindex(n_arr.shape):
    ni, ci = int(n_arr[idx]), int(c_arr[idx])
    if ni - ci < k:
      out[idx] = 1.0
    else:
      out[idx] = 1.0 - np.prod(1.0 - k / np.arange(ni - ci + 1, ni + 1, dtype=np.float64))
  return float(out) if out.ndim == 0 else out


def pass_at_k_from_samples(correct, k: int) -> float:
  """Mean over problems of the unbiased pass@k of each row of ``correct [P, n]``."""
  c = _correct_matrix(correct)
  n = np.full(c.shape[0], c.shape[1])
  return float(np.mean(pass_at_k(n, c.sum(axis=1), k)))


def best_at_k_bootstrap(correct, k: int, *, num_resamples: int = 1000, seed: int = 0) -> float:
  r"""Best-of-k by resampling ``k`` answers **with replacement**, averaged over
  ``num_resamples`` draws and the problems.

  Biased low as an estimate of pass@k: its expectation is
  :math:`\frac1P\sum_p 1 - (1 - c_p/n)^k`. For comparison with other frameworks only;
  report :func:`pass_at_k_from_samples`.
  """
  c = _correct_matrix(correct)
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"k must be an int >= 1, got {k!r}")
  if num_resamples < 1:
    raise ValueError(f"num_resamples must be >= 1, got {num_resamples!r}")
  rng = np.random.default_rng(seed)
  p, n = c.shape
  rows = np.arange(p)[:, None]
  hits = 0
  for _ in range(num_resamples):  # one [P, k] draw at a time: memory O(P k)
    hits += int(c[rows, rng.integers(0, n, size=(p, k))].any(axis=1).sum())
  return hits / (num_resamples * p)


def pass_rate_histogram(correct, bins: Optional[Union[int, np.ndarray]] = None) -> tuple[np.ndarray, np.ndarray]:
  r"""Counts of problems by pass rate :math:`c_p / n` (the paper's Figure 4).

  Args:
    correct: ``[P, n]``.
    bins: None (default): ``n + 1`` bins, one per possible count ``c = 0..n``, with
      edges :math:`(c \pm 1/2)/n`; an int: that many equal bins on [0, 1]; an array:
      bin edges. As ``np.histogram``, every bin is half-open except the last.

  Returns:
    ``(counts, edges)``: int64 counts ``[num_bins]`` summing to ``P``, float edges
    ``[num_bins + 1]``.
  """
  c = _correct_matrix(correct)
  n = c.shape[1]
  rate = c.sum(axis=1) / n
  if bins is None:
    counts = np.bincount(c.sum(axis=1), minlength=n + 1).astype(np.int64)
    edges = (np.arange(n + 2) - 0.5) / n
    return counts, edges
  if isinstance(bins, (int, np.integer)) and bins < 1:
    raise ValueError(f"bins must be >= 1, got {bins!r}")
  counts, edges = np.histogram(rate, bins=bins, range=(0.0, 1.0) if np.ndim(bins) == 0 else None)
  return counts.astype(np.int64), edges


def plot_pass_rate_histogram(
    path: Union[str, os.PathLike],
    correct: Union[np.ndarray, Mapping[str, np.ndarray]],
    *,
    bins: Optional[Union[int, np.ndarray]] = None,
    title: Optional[str] = None,
) -> str:
  """Write a PNG bar chart of :func:`pass_rate_histogram` to ``path``; returns ``path``.

  ``correct`` is one ``[P, n]`` array or a mapping label -> array (e.g. ``{"base":
  ..., "GRPO": ...}``), drawn as side-by-side bars; arrays under one mapping must give
  the same bin edges (same ``n`` with ``bins=None``). Uses the Agg canvas directly:
  no pyplot, no global backend change.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  series = dict(correct) if isinstance(correct, Mapping) else {"": correct}
  hists = {label: pass_rate_histogram(arr, bins) for label, arr in series.items()}
  edges = next(iter(hists.values()))[1]
  for label, (_, e) in hists.items():
    if e.shape != edges.shape or not np.allclose(e, edges):
      raise ValueError(f"series {label!r} has different bin edges; use the same n or explicit bins")
  centres, width = (edges[:-1] + edges[1:]) / 2, np.diff(edges)
  fig = Figure(figsize=(6, 4))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  m = len(hists)
  for j, (label, (counts, _)) in enumerate(hists.items()):
    offset = (j - (m - 1) / 2) * width / m
    ax.bar(centres + offset, counts, width=0.9 * width / m, label=label or None)
  ax.set_xlabel("pass rate per problem (c / n)")
  ax.set_ylabel("problems")
  if title:
    ax.set_title(title)
  if any(series):
    ax.legend()
  fig.tight_layout()
  fig.savefig(os.fspath(path), format="png")
  return os.fspath(path)
