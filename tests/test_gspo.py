"""GSPO (``rft_jax.rl.objectives.gspo``, ``learner.objective=gspo``) against verl 0.9.1's and TRL 1.16.0's
own sequence-level losses on identical tensors: values and gradients, rows and packed rows.

``verl_gspo_losses`` transcribes ``compute_policy_loss_gspo`` of verl 0.9.1 (Apache-2.0; ``pip
download --no-deps verl==0.9.1``: ``verl/trainer/ppo/core_algos.py``) and ``trl_sequence_loss``
the ``importance_sampling_level == "sequence"`` branch of ``GRPOTrainer._compute_loss`` of TRL
1.16.0 (Apache-2.0; ``trl/trainer/grpo_trainer.py``) with its ``grpo`` and ``bnpo`` aggregations,
line for line in torch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rft_jax.rl.config import LearnerConfig
from rft_jax.rl.objectives.gspo import GSPO_EPS_HIGH, GSPO_EPS_LOW, gspo_loss, sequence_mean
from rft_jax.rl.losses import aggregate_loss, loss_normaliser
from rft_jax.rl.objectives import OBJECTIVES, objective
from verl_reference import verl_masked_mean, verl_masked_sum


def verl_gspo_losses(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
  """verl's per-token ``pg_losses`` and ``pg_clipfrac`` (before ``agg_loss``)."""
  negative_approx_kl = log_prob - old_log_prob
  seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
  negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
  log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
  log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
  seq_importance_ratio = torch.exp(log_seq_importance_ratio)
  pg_losses1 = -advantages * seq_importance_ratio
  pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
  pg_losses = torch.maximum(pg_losses1, pg_losses2)
  pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
  return pg_losses, pg_clipfrac


def verl_agg_seq_mean_token_mean(loss_mat, loss_mask):
  """``agg_loss(loss_agg_mode="seq-mean-token-mean")`` on one rank."""
  seq_mask = torch.sum(loss_mask, dim=-1)
  seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
  seq_mask = (seq_mask > 0).float()
  global_batch_size = seq_mask.sum()
  return verl_masked_sum(seq_losses, seq_mask) / global_batch_size


def trl_sequence_loss(per_token_logps, old_per_token_logps, advantages, mask, epsilon_low, epsilon_high,
                      loss_type):
  """TRL's loss with ``importance_sampling_level="sequence"`` (advantages ``[B]``, beta 0)."""
  log_ratio = per_token_logps - old_per_token_logps
  log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
  log_importance_weights = log_importance_weights.unsqueeze(-1)
  coef_1 = torch.exp(log_importance_weights)
  coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
  per_token_loss1 = coef_1 * advantages.unsqueeze(1)
  per_token_loss2 = coef_2 * advantages.unsqueeze(1)
  per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
  if loss_type == "grpo":
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
  if loss_type == "bnpo":
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
  raise ValueError(loss_type)


def case(seed=0, rows=12, width=12, spread=3e-3):
  """Log-probs, old log-probs a little apart (some sequences past the clip), advantages per row,
  and right-padded masks of different lengths (none empty)."""
  rng = np.random.default_rng(seed)
  logp = -rng.exponential(1.5, (rows, width)).astype(np.float32)
  old = (logp + rng.normal(0, spread, (rows, width))).astype(np.float32)
  adv = rng.normal(size=rows).astype(np.float32)
  lengths = rng.integers(2, width + 1, rows)
  mask = (np.arange(width)[None] < lengths[:, None]).astype(np.float32)
  return logp, old, adv, mask


AGGREGATIONS = {"seq-mean-token-mean": "grpo", "token-mean": "bnpo"}  # ours -> TRL's loss_type


@pytest.mark.parametrize("agg", list(AGGREGATIONS))
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_equals_verl_and_trl_values_and_gradients(agg, seed):
  logp, old, adv, mask = case(seed)

  def ours(lp):
    terms = gspo_loss(lp, jnp.asarray(old), jnp.asarray(adv)[:, None] * jnp.ones_like(lp),
                      jnp.asarray(mask))
    return aggregate_loss(terms.loss, jnp.asarray(mask), agg, loss_normaliser(jnp.asarray(mask))), terms

  (value, terms), grad = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(logp))
  assert 0 < float(jnp.mean((terms.clipped_low | terms.clipped_high)[:, 0])) < 1  # the clip binds on some

  t_logp = torch.tensor(logp, requires_grad=True)
  t_old, t_mask = torch.tensor(old), torch.tensor(mask)
  t_adv = torch.tensor(adv)[:, None].expand_as(t_logp)
  pg_losses, clipfrac = verl_gspo_losses(t_old, t_logp, t_adv, t_mask, GSPO_EPS_LOW, GSPO_EPS_HIGH)
  verl_value = (verl_agg_seq_mean_token_mean(pg_losses, t_mask) if agg == "seq-mean-token-mean"
                else verl_masked_sum(pg_losses, t_mask) / t_mask.sum())
  verl_value.backward()
  np.testing.assert_allclose(np.asarray(terms.loss) * mask, pg_losses.detach().numpy() * mask, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(float(value), verl_value.item(), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), t_logp.grad.numpy(), rtol=1e-5, atol=1e-8)
  clipped = np.asarray(terms.clipped_low | terms.clipped_high, np.float32)
  np.testing.assert_allclose((clipped * mask).sum() / mask.sum(), clipfrac.item(), rtol=1e-6)

  t_logp = torch.tensor(logp, requires_grad=True)
  trl_value = trl_sequence_loss(t_logp, t_old, torch.tensor(adv), t_mask, GSPO_EPS_LOW, GSPO_EPS_HIGH,
                                AGGREGATIONS[agg])
  trl_value.backward()
  np.testing.assert_allclose(float(value), trl_value.item(), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), t_logp.grad.numpy(), rtol=1e-5, atol=1e-8)


def test_sequence_ratio_is_the_geometric_mean_and_one_on_policy():
  logp, old, adv, mask = case(2, spread=0.1)
  terms = gspo_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv)[:, None] * np.ones_like(logp),
                    jnp.asarray(mask))
  token_ratios = np.exp(logp.astype(np.float64) - old)
  geometric = np.exp((np.log(token_ratios) * mask).sum(1) / mask.sum(1))
  np.testing.assert_allclose(np.asarray(terms.ratio)[:, 0], geometric, rtol=1e-5)
  assert np.all(np.asarray(terms.ratio) == np.asarray(terms.ratio)[:, :1])  # one ratio a sequence
  on_policy = gspo_loss(jnp.asarray(logp), jnp.asarray(logp), jnp.asarray(adv)[:, None] * np.ones_like(logp),
                        jnp.asarray(mask))
  assert np.all(np.asarray(on_policy.ratio) == 1.0)


def test_sequence_mean_of_packed_segments_equals_the_rows():
  """Two rows packed into one row of slots with segment ids 1 and 2 (0: an empty slot)."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(2, 5)).astype(np.float32)
  mask = np.array([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], np.float32)
  rows = np.asarray(sequence_mean(jnp.asarray(x), jnp.asarray(mask)))
  packed_x = np.concatenate([x[0, :3], x[1, :2], [7.0]])[None]
  packed_mask = np.array([[1, 1, 1, 1, 1, 0]], np.float32)
  ids = np.array([[1, 1, 1, 2, 2, 0]], np.int32)
  packed = np.asarray(sequence_mean(jnp.asarray(packed_x), jnp.asarray(packed_mask), jnp.asarray(ids)))
  np.testing.assert_allclose(packed[0, :5], np.concatenate([rows[0, :3], rows[1, :2]]), rtol=1e-6)


def test_objective_registry_and_config():
  assert set(OBJECTIVES) >= {"ppo", "gspo"}
  cfg = LearnerConfig(objective="gspo")
  assert (cfg.resolved_eps_low, cfg.resolved_eps_high) == (GSPO_EPS_LOW, GSPO_EPS_HIGH)  # its own clip
  assert (LearnerConfig().resolved_eps_low, LearnerConfig().resolved_eps_high) == (0.2, 0.2)
  assert LearnerConfig(objective="gspo", eps_low=0.01).resolved_eps_low == 0.01
  assert objective("gspo").trl == 'importance_sampling_level="sequence"'
  with pytest.raises(ValueError, match=r"learner.objective='gpso' is not one of \['gspo', 'ppo'\]"):
    LearnerConfig(objective="gpso")
  with pytest.raises(ValueError, match="objective=gspo: that objective has no dual clip"):
    LearnerConfig(objective="gspo", dual_clip=3.0)
  with pytest.raises(ValueError, match="objective=gspo with kl_cov: that method replaces"):
    LearnerConfig(objective="gspo", entropy_method={"kind": "kl_cov"})
