"""Evaluation metrics against closed forms: pass@k (Chen et al. 2021), Avg@K, histograms."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from rft_jax import eval as E


def closed_form(n: int, c: int, k: int) -> float:
  """1 - C(n-c, k) / C(n, k) in exact integer arithmetic (math.comb is 0 when n-c < k)."""
  from fractions import Fraction

  return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def rows(n: int, cs) -> np.ndarray:
  """A [P, n] matrix whose row p has cs[p] right answers (at shuffled positions)."""
  rng = np.random.default_rng(0)
  return np.stack([rng.permutation(np.arange(n) < c) for c in cs])


@pytest.mark.parametrize("n,c,k", [
    (4, 0, 1), (4, 0, 4),  # c = 0
    (4, 4, 1), (4, 4, 4),  # c = n
    (10, 8, 3), (5, 3, 3),  # n - c < k: 1
    (10, 3, 1), (7, 2, 1),  # k = 1: c / n
    (10, 3, 2), (16, 5, 8), (64, 1, 32),
    (200, 7, 100), (200, 1, 100), (1000, 13, 500),  # large n: no overflow
])
def test_pass_at_k_matches_closed_form(n, c, k):
  got = E.pass_at_k(n, c, k)
  assert isinstance(got, float)
  assert got == pytest.approx(closed_form(n, c, k), rel=1e-12, abs=1e-14)
  if k == 1:
    assert got == pytest.approx(c / n)
  if n - c < k:
    assert got == 1.0
  if c == 0:
    assert got == 0.0


def test_pass_at_k_vectorised_over_problems():
  n = np.array([10, 10, 20, 200])
  c = np.array([0, 3, 20, 50])
  got = E.pass_at_k(n, c, 5)
  assert got.shape == (4,)
  np.testing.assert_allclose(got, [closed_form(int(a), int(b), 5) for a, b in zip(n, c)], rtol=1e-12)


def test_pass_at_k_from_samples_is_mean_over_problems():
  cs = [0, 1, 4, 8]
  correct = rows(8, cs)
  want = np.mean([closed_form(8, c, 3) for c in cs])
  assert E.pass_at_k_from_samples(correct, 3) == pytest.approx(want, rel=1e-12)


def test_style_example_resampling_with_replacement_is_biased_low():
  """STYLE pitfall: 1 right of 4 at k=4 is pass@4 = 1; resampling with replacement
  scores about 1 - (3/4)^4 = 0.684."""
  correct = np.array([[True, False, False, False]])
  assert E.pass_at_k_from_samples(correct, 4) == 1.0
  boot = E.best_at_k_bootstrap(correct, 4, num_resamples=20000, seed=1)
  assert boot == pytest.approx(1 - 0.75**4, abs=0.01)
  assert boot < 0.7


def test_bootstrap_is_deterministic_per_seed():
  correct = rows(6, [1, 2, 3])
  a = E.best_at_k_bootstrap(correct, 2, num_resamples=50, seed=3)
  assert a == E.best_at_k_bootstrap(correct, 2, num_resamples=50, seed=3)


def test_avg_at_k():
  correct = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], bool)
  assert E.avg_at_k(correct) == pytest.approx((0.5 + 0.25 + 1.0) / 3)
  assert E.avg_at_k(correct, k=1) == 1.0
  assert E.avg_at_k(correct, k=2) == pytest.approx((1.0 + 0.5 + 1.0) / 3)
  # Avg@K equals pass@1 averaged over problems.
  assert E.avg_at_k(correct) == pytest.approx(E.pass_at_k_from_samples(correct, 1))


def test_pass_rate_histogram_counts():
  correct = rows(4, [0, 0, 1, 2, 4, 4, 4])
  counts, edges = E.pass_rate_histogram(correct)
  np.testing.assert_array_equal(counts, [2, 1, 1, 0, 3])  # c = 0, 1, 2, 3, 4
  assert counts.sum() == 7
  np.testing.assert_allclose((edges[:-1] + edges[1:]) / 2, [0, 0.25, 0.5, 0.75, 1.0])
  counts2, edges2 = E.pass_rate_histogram(correct, bins=2)  # [0, .5), [.5, 1]
  np.testing.assert_array_equal(counts2, [3, 4])
  np.testing.assert_allclose(edges2, [0, 0.5, 1])


def test_plot_pass_rate_histogram_writes_png(tmp_path):
  base, tuned = rows(8, [0, 1, 2, 8]), rows(8, [3, 8, 8, 8])
  path = E.plot_pass_rate_histogram(tmp_path / "fig4.png", {"base": base, "GRPO": tuned}, title="Figure 4")
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  E.plot_pass_rate_histogram(tmp_path / "one.png", base)
  with pytest.raises(ValueError, match="different bin edges"):
    E.plot_pass_rate_histogram(tmp_path / "bad.png", {"a": base, "b": rows(4, [1])})


@pytest.mark.parametrize("call,match", [
    (lambda: E.pass_at_k(4, 5, 1), r"0 <= c <= n"),
    (lambda: E.pass_at_k(4, -1, 1), r"0 <= c <= n"),
    (lambda: E.pass_at_k(4, 1, 5), r"k=5 exceeds .* n=4"),
    (lambda: E.pass_at_k(4, 1, 0), r"k must be an int >= 1, got 0"),
    (lambda: E.pass_at_k(4.0, 1, 1), r"n and c must be integers"),
    (lambda: E.avg_at_k(np.ones((2, 3), bool), k=4), r"k=4 must be in \[1, n=3\]"),
    (lambda: E.avg_at_k(np.ones(3, bool)), r"shape \[P, n\].*\(3,\)"),
    (lambda: E.pass_rate_histogram(np.ones((2, 3)) * 0.5), r"boolean"),
])
def test_errors_name_the_bad_value(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_eval_imports_nothing_else_of_the_project():
  code = ("import sys, rft_jax.eval; "
          "print(sorted(m for m in sys.modules if m.startswith('rft_jax') or m in ('jax', 'matplotlib')))")
  mods = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
  assert all(m == "rft_jax" or m.startswith("rft_jax.eval") for m in mods), mods
