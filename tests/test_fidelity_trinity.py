"""The entropy masks against the authors' released code, Trinity-RFT 0.6.0, on identical tensors.

``trinity_clip_b_keep`` and ``trinity_clip_v_keep`` transcribe the token-filtering part of
``trinity/algorithm/advantage_fn/clipb_advantage.py`` and ``clipv_advantage.py`` (Apache-2.0;
``pip download --no-deps trinity-rft==0.6.0``) line for line in torch, with the batch fields as
arguments: ``advantages`` is their GRPO advantage times the response mask (0 on padding).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rft_jax import entropy as E
from rft_jax.rl.config import EntropyMaskConfig, LearnerConfig
from rft_jax.rl.token_methods import entropy_keep_mask


def trinity_clip_b_keep(rollout_log_probs, entropys, response_mask, advantages, mu=2.5):
  """ClipBAdvantageFn.__call__, from '# --- BEGIN: token filtering logic ---'."""
  LP = rollout_log_probs
  H = entropys
  M = response_mask
  p = LP.exp()
  S = p * (H + LP)
  xS = S.detach().to(torch.float32)
  m = M.to(torch.float32)
  n = m.sum().clamp_min(1.0)
  ES = (xS * m).sum() / n
  varS = ((xS - ES) ** 2 * m).sum() / n
  stdS = varS.sqrt()
  z = xS - ES
  if stdS.item() < 1e-12:
    keep = torch.ones_like(M, dtype=M.dtype)
  else:
    A = advantages.detach().to(torch.float32)
    pos_mask = A > 0
    neg_mask = A < 0
    keep_pos = torch.ones_like(pos_mask, dtype=torch.bool)
    keep_neg = z >= -(mu * stdS)
    keep_zero = torch.ones_like(pos_mask, dtype=torch.bool)
    keep_bool = torch.where(pos_mask, keep_pos, torch.where(neg_mask, keep_neg, keep_zero))
    keep = keep_bool.to(M.dtype)
  return M * keep


def trinity_clip_v_keep(old_log_probs, entropys, necs, response_mask, advantages, mu=8.5, max_frac=1e-4):
  """ClipVAdvantageFn.__call__, from 'LP = new_log_probs' (necs: E_p[S] per token)."""
  LP = old_log_probs
  H = entropys
  N = necs
  M = response_mask
  p = LP.exp()
  S = p * (H + LP)
  xD = (N - S).detach().to(torch.float32)
  A = advantages.detach().to(torch.float32)
  m = M.to(torch.float32)
  n = m.sum().clamp_min(1.0)
  mean_d = (xD * m).sum() / n
  var_d = ((xD - mean_d) ** 2 * m).sum() / n
  std_d = var_d.sqrt()
  if std_d.item() < 1e-12:
    keep = torch.ones_like(M, dtype=M.dtype)
  else:
    pos_mask = A > 0
    neg_mask = A < 0
    keep_neg = xD <= (mu * std_d)
    keep_bool = torch.where(pos_mask, torch.ones_like(pos_mask), keep_neg)
    total_tokens = m.sum().clamp_min(1.0)
    clipped_mask = (M > 0) & (~keep_bool)
    frac_clipped = (clipped_mask.to(torch.float32).sum() / total_tokens).item()
    if frac_clipped <= max_frac:
      keep = keep_bool.to(M.dtype)
    else:
      max_clipped_tokens = max(int(max_frac * total_tokens.item()), 1)
      neg_to_clip = neg_mask & (M > 0) & (~keep_neg)
      neg_to_clip_count = int(neg_to_clip.to(torch.int32).sum().item())
      if neg_to_clip_count <= max_clipped_tokens:
        keep = keep_bool.to(M.dtype)
      else:
        candidate_scores = xD.masked_fill(~neg_to_clip, float("-inf")).view(-1)
        k = min(max_clipped_tokens, neg_to_clip_count)
        _, indices = torch.topk(candidate_scores, k, largest=True)
        limited_clip_mask = torch.zeros_like(candidate_scores, dtype=torch.bool)
        limited_clip_mask[indices] = True
        limited_clip_mask = limited_clip_mask.view_as(xD)
        final_keep = keep_bool.clone()
        final_keep[neg_to_clip] = True
        final_keep[limited_clip_mask] = False
        keep = final_keep.to(M.dtype)
  return M * keep


def rollout_batch(seed, b=32, t=40, v=50, zero_groups=0):
  """Learner statistics of random logits, a sampler whose log-probs differ from the learner's
  (another engine, rounding), GRPO-like advantages in groups of 4 (the first ``zero_groups``
  groups all-equal: A = 0) and right-padded responses."""
  rng = np.random.default_rng(seed)
  logits = (3.0 * rng.standard_t(df=3, size=(b, t, v))).astype(np.float32)
  tokens = rng.integers(0, v, (b, t)).astype(np.int32)
  stats = E.token_stats(jnp.asarray(logits), jnp.asarray(tokens), chunk_size=None)
  sampler_logp = np.asarray(stats.logp) + rng.normal(0, 0.3, (b, t)).astype(np.float32)
  sampler_logp = np.minimum(sampler_logp, 0.0)
  adv = np.repeat(rng.normal(size=(b, 1)), t, axis=1).astype(np.float32)
  adv[:4 * zero_groups] = 0.0
  lengths = rng.integers(t // 2, t + 1, b)
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
  return stats, sampler_logp, adv * mask, mask


def ours(kind, stats, sampler_logp, adv, mask, **mask_kw):
  config = LearnerConfig(entropy_mask=EntropyMaskConfig(kind=kind, **mask_kw))
  keep = entropy_keep_mask(config, stats, jnp.asarray(sampler_logp), jnp.asarray(adv), jnp.asarray(mask))
  return np.asarray(keep) & (mask > 0)


def t(x):
  return torch.from_numpy(np.array(x, np.float32))  # a writable copy


@pytest.mark.parametrize("seed", [0, 1])
def test_clip_b_with_sampler_log_probs_equals_trinity(seed):
  """logp_source=sampler: S_* = exp(l) (H + l) with l the rollout's log-prob and H the learner's
  entropy, as Trinity's Clip_B; the learner's own log-probs (the default) give another mask."""
  stats, sampler_logp, adv, mask = rollout_batch(seed)
  want = trinity_clip_b_keep(t(sampler_logp), t(stats.entropy), t(mask), t(adv), mu=1.0).numpy() > 0
  got = ours("clip_b", stats, sampler_logp, adv, mask, mu_low=1.0, logp_source="sampler")
  np.testing.assert_array_equal(got, want)
  assert (mask > 0).sum() - want.sum() > 0  # the case masks tokens
  learner = ours("clip_b", stats, sampler_logp, adv, mask, mu_low=1.0)
  assert (learner != want).sum() > 0


@pytest.mark.parametrize("max_frac", [1e-4, 0.01, 1.0])
def test_clip_v_equals_trinity_except_on_zero_advantage_tokens(max_frac):
  """Learner log-probs (Trinity's Clip_V uses the trainer's recomputed old_log_probs). The masks
  agree on every token with A != 0, the cap included; Trinity's also masks A = 0 outliers."""
  stats, sampler_logp, adv, mask = rollout_batch(2, zero_groups=2)
  want = trinity_clip_v_keep(t(stats.logp), t(stats.entropy), t(stats.expected_s), t(mask), t(adv),
                             mu=1.0, max_frac=max_frac).numpy() > 0
  got = ours("clip_v", stats, sampler_logp, adv, mask, mu_low=1.0, max_frac=max_frac)
  nonzero = adv != 0
  np.testing.assert_array_equal(got[nonzero], want[nonzero])
  assert (got[nonzero] != (mask > 0)[nonzero]).sum() >= 1  # something masked on A < 0
  zero_valid = (adv == 0) & (mask > 0)
  assert np.all(got[zero_valid]) and not np.all(want[zero_valid])  # the documented quirk


def test_clip_v_budget_on_a_5000_token_batch_equals_trinity():
  """Released defaults (mu 8.5, max_frac 1e-4): both mask the one extreme negative-sample token."""
  rng = np.random.default_rng(0)
  centered = rng.normal(0.0, 1e-3, (50, 100)).astype(np.float32)
  adv = np.repeat(rng.choice([-1.0, 1.0], (50, 1)), 100, axis=1).astype(np.float32)
  row = int(np.flatnonzero(adv[:, 0] < 0)[0])
  centered[row, 7] = -1.0
  mask = np.ones_like(adv)
  # Trinity forms S - N from log-probs; any split with S - N = centered gives the same mask.
  log_p = np.full_like(adv, -1.0)
  entropy = np.full_like(adv, 2.0)
  s_star = np.exp(log_p) * (entropy + log_p)
  want = trinity_clip_v_keep(t(log_p), t(entropy), t(s_star - centered), t(mask), t(adv)).numpy() > 0
  got = np.asarray(E.clip_v_mask(jnp.asarray(centered), jnp.asarray(adv), jnp.asarray(mask)))
  assert np.argwhere(~want).tolist() == [[row, 7]]
  np.testing.assert_array_equal(got, want)
