r"""Whether each of the paper's empirical claims held in the demo-scale runs: held, not held or unclear.

Each function reads finished runs (:class:`rft_jax.figures.results.RunResult`) and returns a
:class:`Verdict`: the status and one sentence with the figures it rests on. Differences of
held-out entropy count only beyond ``noise``, twice the standard deviation of a run's final
held-out entropy across seeds (pooled over GRPO, Clip_B and Clip_V:
:func:`entropy_noise`); smaller ones are "unclear", not evidence either way.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np
from scipy import stats as scipy_stats

from rft_jax.figures.results import RunResult

HELD, NOT_HELD, UNCLEAR = "held", "not held", "unclear"


@dataclasses.dataclass(frozen=True)
class Verdict:
  status: str  # HELD, NOT_HELD or UNCLEAR
  sentence: str


def _combine(statuses: Sequence[str]) -> str:
  """Held if every part held, not held if any part did not, else unclear."""
  if statuses and all(s == HELD for s in statuses):
    return HELD
  return NOT_HELD if NOT_HELD in statuses else UNCLEAR


def _direction(change: float, expected: int, noise: float) -> str:
  """A change of the expected sign beyond ``noise`` held; of the other sign beyond it, not."""
  if expected * change > noise:
    return HELD
  return NOT_HELD if -expected * change > noise else UNCLEAR


def entropy_noise(groups: Mapping[str, Sequence[RunResult]]) -> float:
  """Twice the pooled standard deviation across seeds of the final held-out entropy, over the
  ``groups`` (one per method, its runs of different seeds); NaN with one seed."""
  squares, dof = 0.0, 0
  for runs in groups.values():
    values = np.array([r.final["entropy"] for r in runs])
    if len(values) > 1:
      squares += float(np.sum((values - values.mean()) ** 2))
      dof += len(values) - 1
  return 2 * float(np.sqrt(squares / dof)) if dof else float("nan")


# Figure 1: (action, samples) -> the expected sign of H(run on the S_* > 0 tokens) - H(run on the
# S_* < 0 tokens), final held-out entropies. On positive samples the S_* > 0 tokens lower the
# entropy and the S_* < 0 tokens raise it (Theorem 1); on negative samples (a penalty) the other
# way round. "only": trained on those tokens alone; "drop": GRPO without them (the sign flips).
SIGN_EXPECTED = {("only", "pos"): -1, ("only", "neg"): +1, ("drop", "pos"): +1, ("drop", "neg"): -1}


def sign_masks(runs: Mapping[tuple[str, str, str], RunResult], grpo: RunResult, start_entropy: float,
               noise: float) -> tuple[Verdict, dict]:
  """Figure 1's claim, panel by panel: the S_* > 0 run ends on the expected side of the S_* < 0
  run (by more than ``noise``). Each run's change from its reference (the start for ``only``,
  GRPO for ``drop``) is reported beside it. Also returns each panel's status, keyed
  ``(action, samples)``."""
  panels, parts = {}, []
  for (action, samples), expected in SIGN_EXPECTED.items():
    positive, negative = (runs[(action, samples, sign)].final["entropy"] for sign in ("pos", "neg"))
    panels[(action, samples)] = _direction(positive - negative, expected, noise)
    reference = start_entropy if action == "only" else grpo.final["entropy"]
    against = "the start" if action == "only" else "GRPO"
    parts.append(f"{action} {'positive' if samples == 'pos' else 'negative'} samples: S*>0 {positive - negative:+.4f} "
                 f"against S*<0 ({panels[(action, samples)]}; against {against}: S*>0 {positive - reference:+.4f}, "
                 f"S*<0 {negative - reference:+.4f})")
  status = _combine(list(panels.values()))
  return Verdict(status, f"Final held-out entropy, noise {noise:.4f}: " + "; ".join(parts) + "."), panels


def cut_sizes(method_runs: Mapping[str, Mapping[float, RunResult]], noise: float) -> Verdict:
  """Figure 2: a larger cut mu masks fewer tokens and lets the entropy fall further."""
  statuses, parts = [], []
  for method, by_mu in method_runs.items():
    mus = sorted(by_mu)
    fracs = [by_mu[m].mean("mask/frac") for m in mus]
    entropies = [by_mu[m].final["entropy"] for m in mus]
    fewer = all(a > b for a, b in zip(fracs, fracs[1:]))
    spread = entropies[0] - entropies[-1]  # smallest cut minus largest: > 0 if larger cuts fall further
    order = _direction(spread, +1, noise)
    statuses.append(NOT_HELD if not fewer else order)
    parts.append(f"{method} mu {', '.join(f'{m:g}' for m in mus)}: masked "
                 f"{', '.join(f'{100 * f:.2f}%' for f in fracs)}, final entropy "
                 f"{', '.join(f'{e:.4f}' for e in entropies)}")
  return Verdict(_combine(statuses), "; ".join(parts) + f" (noise {noise:.4f}).")


def centered_scale(grpo_runs: Sequence[RunResult]) -> Verdict:
  r"""Figure 3 (Corollary 2): the batch mean of :math:`S_* - \mathbb{E}_p[S]` is orders of
  magnitude smaller than that of :math:`S_*` (held below 1/100, not held above 1/10)."""
  ratios = np.concatenate([np.abs(r.series("entropy/s_centered_mean")[1]) / np.abs(r.series("entropy/s_star_mean")[1])
                           for r in grpo_runs])
  ratio = float(np.median(ratios))
  status = HELD if ratio < 1e-2 else NOT_HELD if ratio > 1e-1 else UNCLEAR
  return Verdict(status, f"Median over {len(ratios)} GRPO steps of |mean(S* - E_p[S])| / |mean(S*)|: {ratio:.1e}.")


def extreme_problems(correct: np.ndarray) -> np.ndarray:
  """``[P]`` bool: problems whose answers are all right or all wrong."""
  rate = correct.mean(axis=1)
  return (rate == 0) | (rate == 1)


def pass_rate_spread(grpo_runs: Sequence[RunResult], clip_b_runs: Sequence[RunResult]) -> Verdict:
  """Figure 4: Clip_B leaves fewer held-out problems all solved or all failed than GRPO. Problems
  are paired (the same held-out set, seed with seed): of those extreme under one method only, a
  sign test (z = (b - c) / sqrt(b + c), held above 2, not held below -2)."""
  b = c = 0
  counts = {"GRPO": [0, 0], "Clip_B": [0, 0]}
  for g, k in zip(grpo_runs, clip_b_runs):
    eg, ek = extreme_problems(g.correct), extreme_problems(k.correct)
    b, c = b + int(np.sum(eg & ~ek)), c + int(np.sum(ek & ~eg))
    for name, run in (("GRPO", g), ("Clip_B", k)):
      counts[name][0] += int(np.sum(run.correct.all(axis=1)))
      counts[name][1] += int(np.sum(~run.correct.any(axis=1)))
  z = (b - c) / np.sqrt(b + c) if b + c else 0.0
  status = HELD if z > 2 else NOT_HELD if z < -2 else UNCLEAR
  return Verdict(status, f"All solved / all failed, summed over {len(grpo_runs)} seed(s): GRPO "
                         f"{counts['GRPO'][0]} / {counts['GRPO'][1]}, Clip_B {counts['Clip_B'][0]} / "
                         f"{counts['Clip_B'][1]}; extreme under GRPO only {b}, under Clip_B only {c} (z = {z:+.1f}).")


def negative_covariance(grpo_runs: Sequence[RunResult]) -> Verdict:
  r"""Figure 5: :math:`-\mathrm{Cov}_B(A, S_* - \mathbb{E}_p[S])` is mostly negative, and larger in
  magnitude when negative."""
  values = np.concatenate([minus_covariance(r)[1] for r in grpo_runs])
  negative = values[values < 0]
  positive = values[values > 0]
  share = len(negative) / len(values)
  mag_neg = float(np.mean(-negative)) if len(negative) else 0.0
  mag_pos = float(np.mean(positive)) if len(positive) else 0.0
  parts = [HELD if share > 0.5 else NOT_HELD, HELD if mag_neg > mag_pos else NOT_HELD]
  status = parts[0] if parts[0] == parts[1] else UNCLEAR
  return Verdict(status, f"Negative on {100 * share:.0f}% of {len(values)} GRPO steps; mean magnitude "
                         f"{mag_neg:.2e} when negative, {mag_pos:.2e} when positive.")


def minus_covariance(run: RunResult) -> tuple[np.ndarray, np.ndarray]:
  r"""``(steps, -Cov_B(A, S_* - E_p[S]))`` of a run: Corollary 4's forecast divided by the step's
  learning rate."""
  steps, forecast = run.series("entropy/forecast")
  lr = dict(zip(*run.series("actor/lr")))
  return steps, forecast / np.array([lr[s] for s in steps])


def confidence_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
  """Mean and half-width of the Student t interval over seeds (NaN half-width for one value)."""
  values = np.asarray(values, np.float64)
  if len(values) < 2:
    return float(values.mean()), float("nan")
  half = scipy_stats.t.ppf(0.5 + level / 2, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
  return float(values.mean()), float(half)


def table1(groups: Mapping[str, Sequence[RunResult]]) -> tuple[Verdict, list[dict]]:
  """Table 1: Avg@K and Pass@K per method (mean and 95% interval over seeds), and each method's
  difference from GRPO paired by seed. The paper's claim, that Clip_B and Clip_V do better than
  GRPO, holds where a difference's interval is above 0, is not held where it is below 0."""
  rows, statuses, parts = [], [], []
  grpo = groups["grpo"]
  for method, runs in groups.items():
    row = {"method": method, "seeds": len(runs)}
    for metric in ("avg", "pass"):
      row[metric] = confidence_interval([r.final[metric] for r in runs])
      if method != "grpo":
        diff = confidence_interval([r.final[metric] - g.final[metric] for r, g in zip(runs, grpo)])
        row[f"{metric}_diff"] = diff
        mean, half = diff
        status = UNCLEAR if not np.isfinite(half) else HELD if mean - half > 0 else NOT_HELD if mean + half < 0 else UNCLEAR
        statuses.append(status)
        parts.append(f"{method} {metric} {mean:+.3f} +/- {half:.3f}")
    rows.append(row)
  return Verdict(_combine(statuses), "Difference from GRPO (95% interval over seeds): " + ", ".join(parts) + "."), rows
