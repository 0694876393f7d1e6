"""The names metrics are logged under: one namespaced scheme for ``metrics.jsonl`` and TensorBoard.

The learner and the loop compute metrics under short names (``Learner.step`` and ``train`` return
them); the run's logs carry them as ``namespace/name``, the same string in the JSONL and in
TensorBoard (tags are written as they are, ``@`` included). :data:`NAMES` is the table, and
:func:`logged_name` maps any short name, or a name already namespaced (idempotent), so that files
written before the scheme read back under the new names (:func:`rft_jax.train.metrics_log.read_metrics`).

==============  =========================================================================
``train/``      the step's rollouts: rewards, accuracy, lengths, refills, reward timeouts and errors
``actor/``      the policy update: loss, gradient norm, learning rate, entropy, PPO clip
                fractions, KL, non-finite steps
``entropy/``    the paper's statistics: S_*, S_* - E_p[S], Corollary 4's forecast of the
                entropy change (and Corollary 3's, summed over the updates of a batch, when a
                step takes several), the exact first-order change of the update applied and
                the measured change
``mask/``       the shares of tokens the entropy mask (Clip_B / Clip_V) or method removes
``rollout_corr/``  the sampler-learner mismatch and its correction (``learner.rollout_correction``):
                importance weights, rejected shares, KL / perplexity / chi-squared; verl's keys
``router/``     a mixture-of-experts policy's router: the load-balancing and z losses, the
                expert load, the share of tokens routed unlike the sampler (names as computed)
``critic/``     PPO's value model: value loss, clip fraction, explained variance
``eval/``       ``eval/<set>/avg@k``, ``pass@k``, ``entropy``
``agent/``      multi-turn rollouts: model turns per trajectory, tool calls, tool errors and
                timeouts, trajectories cut by a limit, environment failures, the share of
                tokens the environments fed, and the policy's entropy by turn
                (``entropy_turn_k``) and by token role (``entropy_role_decision``: a tool
                call's opening token, ``_arguments``, ``_answer``: a final turn's,
                ``_reasoning``: the rest)
``timing/``     seconds per phase and rollout tokens per second
``data/``       the training data's row counts (first step only)
==============  =========================================================================
"""

from __future__ import annotations

import re

NAMES = {
    # train/: the step's rollouts
    "reward_mean": "train/reward_mean", "reward_std": "train/reward_std", "accuracy": "train/accuracy",
    "response_length_mean": "train/response_length_mean", "response_length_max": "train/response_length_max",
    "truncated_frac": "train/truncated_frac", "zero_variance_group_frac": "train/zero_variance_group_frac",
    "refills": "train/refills", "reward_timeouts": "train/reward_timeouts", "reward_errors": "train/reward_errors",
    "reward_over_budget": "train/reward_over_budget",
    # actor/: the update
    "loss": "actor/loss", "grad_norm": "actor/grad_norm", "lr": "actor/lr", "entropy": "actor/entropy",
    "clip_frac_low": "actor/pg_clipfrac_low", "clip_frac_high": "actor/pg_clipfrac_high",
    "clip_frac_dual": "actor/pg_clipfrac_dual", "ratio_dev_max": "actor/ratio_dev_max",
    "logp_mismatch": "actor/logp_mismatch", "logp_mismatch_max": "actor/logp_mismatch_max", "kl": "actor/kl", "response_tokens": "actor/response_tokens",
    "nonfinite_skipped": "actor/nonfinite_skipped", "nonfinite_skipped_total": "actor/nonfinite_skipped_total",
    # entropy/: the paper's statistics
    "s_star_mean": "entropy/s_star_mean", "s_centered_mean": "entropy/s_centered_mean",
    "entropy_change_forecast": "entropy/forecast", "entropy_change_measured": "entropy/measured",
    "entropy_change_first_order": "entropy/first_order",
    "entropy_change_forecast_off_policy": "entropy/forecast_off_policy",
    # mask/: what the entropy mask or method takes out
    "mask_frac": "mask/frac", "mask_frac_positive": "mask/frac_pos", "mask_frac_negative": "mask/frac_neg",
    "method_frac": "mask/method_frac", "target_mu": "mask/target_mu", "target_share": "mask/target_share",
    # rollout_corr/: the rollout correction (verl 0.9.1's rollout_corr/ keys)
    **{f"rollout_is_{k}": f"rollout_corr/rollout_is_{k}" for k in (
        "mean", "max", "min", "std", "eff_sample_size", "ratio_fraction_high", "ratio_fraction_low",
        "oob_ratio", "batch_norm_factor")},
    "rollout_rs_masked_fraction": "rollout_corr/rollout_rs_masked_fraction",
    "rollout_rs_seq_masked_fraction": "rollout_corr/rollout_rs_seq_masked_fraction",
    "mismatch_kl": "rollout_corr/kl", "mismatch_k3_kl": "rollout_corr/k3_kl",
    "learner_ppl": "rollout_corr/training_ppl", "sampler_ppl": "rollout_corr/rollout_ppl",
    "log_ppl_diff": "rollout_corr/log_ppl_diff", "log_ppl_abs_diff": "rollout_corr/log_ppl_abs_diff",
    "ppl_ratio": "rollout_corr/ppl_ratio", "chi2_token": "rollout_corr/chi2_token", "chi2_seq": "rollout_corr/chi2_seq",
    # critic/: PPO's value model (learner.advantage: gae)
    "value_loss": "critic/value_loss", "value_clipfrac": "critic/value_clipfrac",
    "value_mean": "critic/value_mean", "explained_variance": "critic/explained_variance",
    "critic_grad_norm": "critic/grad_norm", "critic_lr": "critic/lr",
    "critic_nonfinite_skipped": "critic/nonfinite_skipped",
    # timing/
    "time_critic": "timing/critic_s", "time_sample": "timing/sample_s", "time_reward": "timing/reward_s", "time_learner": "timing/learner_s",
    "time_eval": "timing/eval_s", "sample_tokens_per_s": "timing/sample_tokens_per_s",
}
NOT_METRICS = ("step", "time")  # every record's own fields, unchanged
_EVAL = re.compile(r"^eval_(.+)_(avg@\d+|pass@\d+|entropy)$")


def logged_name(name: str) -> str:
  """The namespaced name of a metric (unchanged if it is namespaced already)."""
  if name in NOT_METRICS or "/" in name:
    return name
  if name in NAMES:
    return NAMES[name]
  match = _EVAL.match(name)
  if match:
    return f"eval/{match[1]}/{match[2]}"
  for prefix in ("data", "agent"):  # agent/: multi-turn rollouts' (rft_jax.rollout.trajectory)
    if name.startswith(prefix + "_"):
      return f"{prefix}/{name[len(prefix) + 1:]}"
  return "other/" + name


def logged_names(metrics: dict) -> dict:
  """``metrics`` under their logged names."""
  return {logged_name(k): v for k, v in metrics.items()}

