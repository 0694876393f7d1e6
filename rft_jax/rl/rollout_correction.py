r"""Rollout correction: importance weights and rejection for the sampler-learner mismatch.

The sampler's log-probs :math:`\log\mu(y_t)` of the sampled tokens differ from the learner's
pre-update log-probs :math:`\log\pi_{old}(y_t)` of the same tokens (kernels, dtypes, a stale
policy). With the token log-ratio :math:`\ell_t = \log\pi_{old}(y_t) - \log\mu(y_t)` (learner
over sampler, as verl's ``old_log_prob - rollout_log_prob``):

* **Truncated importance sampling** (TIS) multiplies each token's PPO surrogate by a detached
  weight: per token :math:`w_t = \min(e^{\ell_t}, C)`; per sequence
  :math:`w = \min(\exp\sum_t \ell_t, C)`, the same for every token of the sequence. Exponents
  are clamped to :math:`[-20, 20]` (the per-sequence sum after summing). With a floor
  :math:`c` (IcePop) weights outside :math:`[c, C]` are set to 0 instead of truncated; the token
  stays in the loss's denominator. Optionally the weights are divided by their batch mean
  (per token, or per sequence of the sequence weights).
* **Rejection** removes tokens or whole sequences from the loss mask (numerator *and*
  denominator) when a divergence estimate leaves its bounds. With :math:`k_1 = -\ell_t`,
  :math:`k_2 = \ell_t^2 / 2`, :math:`k_3 = e^{\ell_t} - 1 - \ell_t` (:math:`\ell_t` clamped to
  :math:`[-20, 20]`), an option ``token_k*`` tests each token, ``seq_sum_k*`` / ``seq_mean_k*``
  / ``seq_max_k*`` the sum / mean / max over a sequence's tokens and rejects all of its
  tokens. ``k1`` options keep :math:`\log c \le k_1 \le \log C` (ratio bounds of
  :math:`\mu/\pi_{old}`; ``seq_mean_k1`` is the geometric-mean ratio test), the others keep
  :math:`k \le C`. Several options reject what any of them rejects.
* **Metrics**: the weights' mean / max / min / spread / effective sample size and the shares
  beyond the bounds, the rejected shares of tokens and sequences, and the mismatch itself:
  :math:`\mathrm{KL}(\mu\,\|\,\pi_{old})` by :math:`k_1` and :math:`k_3`, both perplexities,
  their log-ratio and ratio, and :math:`\chi^2` per token and per sequence.

Everything is verl 0.9.1's ``algorithm.rollout_correction`` in its decoupled mode (Apache-2.0;
``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_correction_weights``,
``compute_rollout_rejection_mask``, ``compute_is_metrics``, ``compute_offpolicy_metrics``;
``docs/algo/rollout_corr.md``), checked against a line-for-line torch transcription on identical
tensors (``tests/test_rollout_correction.py``). One difference: verl's per-sequence metrics
average over every row of the batch, a row with no token counting as a perfect match; here rows
with no valid token are left out (the same numbers when every row has a token).

References: F. Yao et al., *Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training* (2025, https://fengyao.notion.site/off-policy-rl; TIS); J. Liu, Y. Li et al., *When
Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch* (2025,
https://richardli.xyz/rl-collapse; sequence IS, rejection / MIS, the metrics); Ling Team,
*Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model* (2025,
arXiv:2510.18855; IcePop).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rft_jax.entropy import masked_mean
from rft_jax.rl.losses import KL_ESTIMATORS

SAFETY_BOUND = 20.0  # verl's clamp of log-ratios before exponentiating
IMPORTANCE_LEVELS = ("token", "sequence")
REJECTION_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                     "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


class RejectionBound(NamedTuple):
  """One rejection option and its bounds: ``lower`` / ``upper`` ratio bounds for ``*_k1``
  (``lower`` None otherwise), ``upper`` the divergence bound for k2 / k3."""
  option: str
  lower: float | None
  upper: float


class RolloutCorrection(NamedTuple):
  """``weight``: ``[B, T]`` detached importance weights (0 off the valid tokens; None without
  importance sampling); ``keep``: ``[B, T]`` float, 0 on rejected tokens (multiplies the loss
  mask); ``metrics``: scalars."""
  weight: jax.Array | None
  keep: jax.Array
  metrics: dict


def rejection_bounds(options: str, bounds) -> tuple[RejectionBound, ...]:
  """verl's ``rollout_rs`` / ``rollout_rs_threshold``: comma-separated options (duplicates
  dropped) and one bound for all or one per option; a ``k1`` bound is ``"lower_upper"`` or an
  upper ratio bound (lower: its reciprocal). Raises ``ValueError`` saying what is wrong."""
  names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
  if not names or any(n not in REJECTION_OPTIONS for n in names):
    raise ValueError(f"options must be among {list(REJECTION_OPTIONS)}")
  specs = [s.strip() for s in str(bounds).split(",") if s.strip()] if bounds is not None else []
  if not specs:
    raise ValueError("the rejection needs bounds")
  if len(specs) not in (1, len(names)):
    raise ValueError(f"needs one bound or {len(names)}, one per option")
  table = []
  for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs):
    try:
      parts = [float(p) for p in spec.split("_", 1)]
    except ValueError:
      raise ValueError(f"bound {spec!r} of {name} is not a number") from None
    if not name.endswith("k1"):
      if len(parts) == 2:
        raise ValueError(f"{name} takes one upper bound, not {spec!r}")
      if parts[0] <= 0:
        raise ValueError(f"the bound of {name} must be positive, got {spec!r}")
      table.append(RejectionBound(name, None, parts[0]))
      continue
    lower, upper = parts if len(parts) == 2 else (1.0 / parts[0] if parts[0] > 0 else 0.0, parts[0])
    if min(lower, upper) <= 0 or lower > upper:
      raise ValueError(f"bounds of {name} must be positive with lower <= upper, got {spec!r}")
    table.append(RejectionBound(name, lower, upper))
  return tuple(table)


def _share(condition, where):
  """The share of the ``where`` entries where the bool ``condition`` holds."""
  return masked_mean(condition.astype(jnp.float32), where)


def _row_sum(x, valid):
  return jnp.sum(jnp.where(valid, x, 0.0), axis=-1)


def _row_mean(x, valid):
  return _row_sum(x, valid) / jnp.maximum(jnp.sum(valid, axis=-1), 1).astype(x.dtype)


def importance_weights(log_ratio, valid, level: str, cap: float, floor: float | None = None,
                       batch_normalize: bool = False) -> tuple[jax.Array, dict]:
  """Detached ``[B, T]`` importance weights of ``log_ratio`` (``[B, T]``, learner minus sampler)
  on the ``valid`` tokens (bool ``[B, T]``) and their metrics; verl's
  ``compute_rollout_correction_weights`` with ``compute_is_metrics``."""
  log_ratio = jax.lax.stop_gradient(log_ratio)
  rows = jnp.any(valid, axis=-1)
  seq_log_ratio = _row_sum(log_ratio, valid)
  exponent = log_ratio if level == "token" else seq_log_ratio[:, None]
  raw = jnp.where(valid, jnp.exp(jnp.clip(exponent, -SAFETY_BOUND, SAFETY_BOUND)), 0.0)
  if floor is None:
    weight = jnp.minimum(raw, cap)
  else:  # IcePop: zero outside [floor, cap]
    weight = jnp.where((raw >= floor) & (raw <= cap), raw, 0.0)
  low = 1.0 / cap if floor is None else floor
  m = {"rollout_is_mean": masked_mean(weight, valid)}
  if level == "token":
    m["rollout_is_max"] = jnp.max(jnp.where(valid, weight, -jnp.inf))
    m["rollout_is_min"] = jnp.min(jnp.where(valid, weight, jnp.inf))
    m["rollout_is_ratio_fraction_high"] = _share(raw > cap, valid)
    m["rollout_is_ratio_fraction_low"] = _share(raw < low, valid)
  else:  # from the unclamped log of the sequence ratio
    m["rollout_is_max"] = jnp.exp(jnp.minimum(jnp.max(jnp.where(rows, seq_log_ratio, -jnp.inf)), SAFETY_BOUND))
    m["rollout_is_min"] = jnp.exp(jnp.min(jnp.where(rows, seq_log_ratio, jnp.inf)))
    m["rollout_is_ratio_fraction_high"] = _share(seq_log_ratio > jnp.log(jnp.float32(cap)), rows)
    m["rollout_is_ratio_fraction_low"] = _share(seq_log_ratio < jnp.log(jnp.float32(low)), rows)
  clipped = jnp.clip(weight, 0.0, cap)
  mean = masked_mean(clipped, valid)
  variance = masked_mean(jnp.square(clipped), valid) - jnp.square(mean)
  m["rollout_is_std"] = jnp.where(jnp.sum(valid) > 1, jnp.sqrt(jnp.maximum(variance, 0.0)), 0.0)
  m["rollout_is_eff_sample_size"] = 1.0 / masked_mean(jnp.square(clipped / (mean + 1e-8)), valid)
  if floor is not None:
    m["rollout_is_oob_ratio"] = _share((raw < floor) | (raw > cap), valid)
  if batch_normalize:
    norm = masked_mean(weight, valid) if level == "token" else masked_mean(_row_mean(weight, valid), rows)
    weight = jnp.where(norm > 1e-8, weight / norm, weight)
    m["rollout_is_batch_norm_factor"] = jnp.where(norm > 1e-8, norm, 1.0)
  return weight, m


def rejection_keep(log_ratio, valid, bounds: tuple[RejectionBound, ...]) -> tuple[jax.Array, dict]:
  """``[B, T]`` float keep mask (0 where any option in ``bounds`` rejects) and the rejected
  shares of valid tokens and of sequences; verl's ``compute_rollout_rejection_mask``."""
  safe = jnp.clip(jax.lax.stop_gradient(log_ratio), -SAFETY_BOUND, SAFETY_BOUND)
  divergence = {name: estimate(safe) for name, estimate in KL_ESTIMATORS.items()}  # of log(pi_old / mu)
  reduce = {"seq_sum": _row_sum, "seq_mean": _row_mean,
            "seq_max": lambda x, v: jnp.where(jnp.any(v, -1), jnp.max(jnp.where(v, x, -jnp.inf), -1), 0.0)}
  keep = jnp.ones(log_ratio.shape, jnp.float32)
  for option, lower, upper in bounds:
    level, estimator = option.rsplit("_", 1)
    stat = divergence[estimator] if level == "token" else reduce[level](divergence[estimator], valid)[:, None]
    if estimator == "k1":
      passes = (stat >= math.log(lower)) & (stat <= math.log(upper))
    else:
      passes = stat <= upper
    keep = keep * jnp.broadcast_to(passes, keep.shape)
  rows = jnp.any(valid, axis=-1)
  metrics = {"rollout_rs_masked_fraction": masked_mean(1.0 - keep, valid),
             "rollout_rs_seq_masked_fraction": _share(jnp.any(valid & (keep < 0.5), axis=-1), rows)}
  return keep, metrics


def mismatch_metrics(learner_logp, sampler_logp, valid) -> dict:
  """verl's ``compute_offpolicy_metrics``: KL(sampler || learner) by k1 and k3, per-sequence
  perplexities of both, their log-ratio (sampler minus learner mean log-prob) and ratio, and
  the chi-squared divergence of the token and sequence ratios."""
  learner_logp, sampler_logp = jax.lax.stop_gradient((learner_logp, sampler_logp))
  rows = jnp.any(valid, axis=-1)
  log_ratio = learner_logp - sampler_logp
  learner_mean, sampler_mean = _row_mean(learner_logp, valid), _row_mean(sampler_logp, valid)
  log_ppl_diff = sampler_mean - learner_mean
  seq_log_ratio = jnp.clip(_row_sum(log_ratio, valid), -SAFETY_BOUND, SAFETY_BOUND)
  return {
      "mismatch_kl": masked_mean(KL_ESTIMATORS["k1"](log_ratio), valid),
      "mismatch_k3_kl": masked_mean(KL_ESTIMATORS["k3"](log_ratio), valid),
      "learner_ppl": masked_mean(jnp.exp(-learner_mean), rows),
      "sampler_ppl": masked_mean(jnp.exp(-sampler_mean), rows),
      "log_ppl_diff": masked_mean(log_ppl_diff, rows),
      "log_ppl_abs_diff": masked_mean(jnp.abs(log_ppl_diff), rows),
      "ppl_ratio": masked_mean(jnp.exp(log_ppl_diff), rows),
      "chi2_token": masked_mean(jnp.exp(2.0 * jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)), valid) - 1.0,
      "chi2_seq": masked_mean(jnp.exp(2.0 * seq_log_ratio), rows) - 1.0,
  }


def rollout_correction(learner_logp, sampler_logp, response, config) -> RolloutCorrection:
  """The correction of a batch: ``learner_logp`` / ``sampler_logp`` ``[B, T]`` log-probs of the
  sampled tokens (pre-update learner, sampler), ``response`` ``[B, T]`` the valid-token mask,
  ``config`` a ``rft_jax.rl.config.RolloutCorrectionConfig``. Every reduction is over the whole
  arrays given (pass the whole batch)."""
  valid = response > 0
  log_ratio = jax.lax.stop_gradient(learner_logp - sampler_logp)
  weight, keep, metrics = None, jnp.ones(response.shape, jnp.float32), {}
  if config.importance_sampling is not None:
    weight, m = importance_weights(log_ratio, valid, config.importance_sampling, config.importance_weight_cap,
                                   config.importance_weight_floor, config.normalize_importance_weights)
    metrics.update(m)
  if config.rejection is not None:
    keep, m = rejection_keep(log_ratio, valid, config.rejection_table)
    metrics.update(m)
  metrics.update(mismatch_metrics(learner_logp, sampler_logp, valid))
  return RolloutCorrection(weight, keep, metrics)
