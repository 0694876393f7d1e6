"""Clip-Cov and KL-Cov against verl 0.9.1 on identical tensors.

``verl_clip_cov`` and ``verl_kl_cov`` transcribe ``compute_policy_loss_clip_cov`` and
``compute_policy_loss_kl_cov`` of verl 0.9.1 (Apache-2.0; ``pip download --no-deps verl==0.9.1``,
``verl/trainer/ppo/core_algos.py``) line for line in torch, with the config fields as arguments,
``verl_F.masked_mean`` and ``agg_loss``'s ``token-mean`` branch (``tests/verl_reference.py``), and
without the metrics. Besides the loss they return intermediates the
tests compare (the candidate set, ``clip_num``, ``corr``; the top-k indices).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from verl_reference import verl_agg_loss_token_mean, verl_masked_mean

from rft_jax.rl.token_methods import cov_methods as C


def verl_clip_cov(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high,
                  clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0):
  """compute_policy_loss_clip_cov; returns (pg_loss, pg_losses, corr, candidates, clip_num)."""
  assert clip_cov_ratio > 0, "clip_ratio should be larger than 0."

  negative_approx_kl = log_prob - old_log_prob
  ratio = torch.exp(negative_approx_kl)

  pg_losses1 = -advantages * ratio

  corr = torch.ones_like(advantages)
  pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
  clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)

  cov_all = (advantages - verl_masked_mean(advantages, response_mask)) * (
      log_prob - verl_masked_mean(log_prob.detach(), response_mask)
  )
  cov_all[response_mask == 0] = -torch.inf
  cov_all[clip_by_origin] = -torch.inf

  clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
  top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
  candidates = top_k_idx.clone()  # (test hook)
  top_k_idx = torch.nonzero(top_k_idx)

  if len(top_k_idx) > 0:
    perm = torch.randperm(len(top_k_idx))
    top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
  else:
    top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)

  corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0

  pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr

  pg_loss = verl_agg_loss_token_mean(pg_losses, response_mask)
  return pg_loss, pg_losses, corr, candidates, clip_num


def verl_kl_cov(old_log_prob, log_prob, advantages, response_mask, kl_cov_ratio=0.0002, ppo_kl_coef=0.1):
  """compute_policy_loss_kl_cov; returns (pg_loss, pg_losses, flat indices of the penalised tokens)."""
  assert kl_cov_ratio > 0, "kl_cov_ratio should be larger than 0."

  negative_approx_kl = log_prob - old_log_prob
  abs_kl = negative_approx_kl.abs()
  ratio = torch.exp(negative_approx_kl)
  pg_losses1 = -advantages * ratio
  pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
  pg_losses = pg_losses1

  all_valid = response_mask > 0
  all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
  all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
  all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()

  k = min(kl_cov_ratio, len(all_valid_adv))
  penalised = torch.empty(0, dtype=torch.long)  # (test hook)

  if k != 0:
    cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
    k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
    large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices

    if len(large_cov_idxs) != 0:
      large_cov_idxs = all_valid_idx[large_cov_idxs]
      penalised = large_cov_idxs  # (test hook)
      pg_losses[large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]] = pg_losses_kl[
          large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
      ]

  pg_loss = verl_agg_loss_token_mean(pg_losses, response_mask)
  return pg_loss, pg_losses, penalised


def _batch(seed, shape, *, min_len=1):
  """GRPO-like data: per-sequence advantages, log-probs in [-6, 0), stale old log-probs, padding."""
  rng = np.random.default_rng(seed)
  b, t = shape
  adv = np.repeat(rng.normal(0.0, 1.5, (b, 1)), t, axis=1) + rng.normal(0.0, 0.3, shape)
  logp = -rng.exponential(1.5, shape)
  old = logp + rng.normal(0.0, 0.25, shape)
  lengths = rng.integers(min_len, t + 1, size=b)
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
  return tuple(x.astype(np.float32) for x in (logp, old, adv)) + (mask,)


def _torch(*xs):
  return [torch.from_numpy(np.array(x)) for x in xs]


def _jax(*xs):
  return [jnp.asarray(x) for x in xs]


SHAPES = [(2, 5), (8, 40), (16, 64), (32, 96)]
# (shape, ratio) pairs: every shape and every ratio; the other tests reuse these compilations.
CASES = [((2, 5), 0.3), ((8, 40), 2e-4), ((16, 64), 0.05), ((32, 96), 0.01)]
EPS = dict(eps_low=0.2, eps_high=0.28)
KEEP = jax.jit(C.clip_cov_keep, static_argnames=("eps_low", "eps_high", "ratio", "log_ratio_clamp"))
CANDIDATES = jax.jit(C.clip_cov_candidates, static_argnames=("eps_low", "eps_high", "log_ratio_clamp"))
CLIP_LOSS = jax.jit(C.clip_cov_loss, static_argnames=("eps_low", "eps_high", "log_ratio_clamp"))
PENALISED = jax.jit(C.kl_cov_penalty_mask, static_argnames=("ratio",))
KL_LOSS = jax.jit(C.kl_cov_loss, static_argnames=("log_ratio_clamp",))
COVARIANCE = jax.jit(C.token_covariance)
VMAPPED_KEEP = jax.jit(  # one key per row
    jax.vmap(functools.partial(C.clip_cov_keep, ratio=0.02, **EPS), in_axes=(None,) * 4 + (0,)))


def _token_mean(per_token, mask):
  """Token-mean over the unchanged mask (rft_jax.rl.losses.aggregate_loss's "token-mean")."""
  return float(np.sum(np.float64(per_token) * mask) / max(mask.sum(), 1.0))


@pytest.mark.parametrize("shape", SHAPES)
def test_token_covariance_matches_verl(shape):
  logp, old, adv, mask = _batch(0, shape)
  cov = np.asarray(COVARIANCE(*_jax(logp, adv, mask)))
  lp, a, m = _torch(logp, adv, mask)
  theirs = ((a - verl_masked_mean(a, m)) * (lp - verl_masked_mean(lp, m))).numpy()
  np.testing.assert_allclose(cov[mask > 0], theirs[mask > 0], rtol=1e-5, atol=1e-6)
  assert np.all(cov[mask == 0] == 0)


@pytest.mark.parametrize("shape,ratio", CASES)
def test_clip_cov_deterministic_parts_match_verl(shape, ratio):
  keep_fn = functools.partial(KEEP, ratio=ratio, **EPS)
  cand_fn = functools.partial(CANDIDATES, **EPS)
  loss_fn = functools.partial(CLIP_LOSS, **EPS)
  seen_candidates = 0
  for seed in range(3):
    logp, old, adv, mask = _batch(seed, shape)
    torch.manual_seed(seed)
    pg_loss, pg_losses, corr, cand_v, clip_num = verl_clip_cov(
        *_torch(old, logp, adv, mask), EPS["eps_low"], EPS["eps_high"], clip_cov_ratio=ratio)
    cand_v = cand_v.numpy()
    seen_candidates += cand_v.sum()
    cand = np.asarray(cand_fn(*_jax(logp, old, adv, mask)))
    np.testing.assert_array_equal(cand, cand_v)
    keep = np.asarray(keep_fn(*_jax(logp, old, adv, mask), jax.random.key(seed)))
    chosen = ~keep
    # Same count as verl, every chosen token a candidate (hence valid and unclipped).
    assert chosen.sum() == min(clip_num, cand_v.sum()) == (corr.numpy() == 0).sum()
    assert np.all(cand_v[chosen])
    # Per-token loss: equal to verl's on the tokens neither detaches, 0 on detached ones.
    ours = np.asarray(loss_fn(*_jax(logp, old, adv, mask), jnp.asarray(keep)))
    both = (mask > 0) & keep & (corr.numpy() == 1)
    np.testing.assert_allclose(ours[both], pg_losses.numpy()[both], rtol=1e-6, atol=1e-6)
    assert np.all(ours[chosen] == 0) and np.all(ours[mask == 0] == 0)
    # With verl's own choice as `keep`, the token-mean over the unchanged mask is verl's pg_loss.
    keep_v = jnp.asarray(corr.numpy() == 1)
    ours_v = np.asarray(loss_fn(*_jax(logp, old, adv, mask), keep_v))
    np.testing.assert_allclose(_token_mean(ours_v, mask), float(pg_loss), rtol=1e-5, atol=1e-7)
  if shape[0] * shape[1] >= 100:
    assert seen_candidates > 0  # the data exercise the (lb, ub) window


def test_clip_cov_excludes_ppo_clipped_and_out_of_window_tokens():
  logp, old, adv, mask = _batch(4, (16, 64))
  cand = np.asarray(CANDIDATES(*_jax(logp, old, adv, mask), **EPS))
  cov = np.asarray(COVARIANCE(*_jax(logp, adv, mask)))
  r = np.exp(logp.astype(np.float64) - old)
  clipped = ((adv > 0) & (r > 1 + EPS["eps_high"])) | ((adv < 0) & (r < 1 - EPS["eps_low"]))
  window = (cov > 1.0) & (cov < 5.0) & (mask > 0)
  assert (window & clipped).any() and (window & ~clipped).any()
  np.testing.assert_array_equal(cand, window & ~clipped)


def test_clip_cov_random_choice_is_uniform_like_verl():
  """Over many keys each candidate is chosen with probability count / n_candidates, as with randperm."""
  logp, old, adv, mask = _batch(1, (8, 40))
  ratio = 0.02  # VMAPPED_KEEP's
  n_valid = int(mask.sum())
  cand = np.asarray(CANDIDATES(*_jax(logp, old, adv, mask), **EPS))
  n_cand = int(cand.sum())
  count = min(max(int(ratio * n_valid), 1), n_cand)
  assert 2 <= count < n_cand
  draws = 2000
  keys = jax.random.split(jax.random.key(0), draws)
  chosen = ~np.asarray(VMAPPED_KEEP(*_jax(logp, old, adv, mask), keys))
  assert np.all(chosen.sum(axis=(1, 2)) == count)
  assert not chosen[:, ~cand].any()
  p = count / n_cand
  tol = 5 * np.sqrt(p * (1 - p) / draws)
  np.testing.assert_allclose(chosen.mean(axis=0)[cand], p, atol=tol)
  # Pairs are chosen together as often as in a uniform subset: p (count - 1) / (n_cand - 1).
  flat = chosen.reshape(draws, -1)[:, cand.reshape(-1)].astype(np.float64)
  pair = (flat.T @ flat / draws)[np.triu_indices(n_cand, 1)]
  assert abs(pair.mean() - p * (count - 1) / (n_cand - 1)) < 0.015
  # verl's randperm gives the same frequencies.
  verl_freq = np.zeros(cand.shape)
  args = _torch(old, logp, adv, mask)
  for seed in range(100):
    torch.manual_seed(seed)
    verl_freq += verl_clip_cov(*args, EPS["eps_low"], EPS["eps_high"], clip_cov_ratio=ratio)[2].numpy() == 0
  np.testing.assert_allclose(verl_freq[cand] / 100, p, atol=5 * np.sqrt(p * (1 - p) / 100))


def test_clip_cov_same_key_same_choice_under_jit():
  """A key fixes the choice: across calls, and between one jitted call and a vmap over keys."""
  logp, old, adv, mask = _batch(1, (8, 40))
  args = _jax(logp, old, adv, mask)
  keys = jax.random.split(jax.random.key(0), 2000)
  keep = functools.partial(KEEP, ratio=0.02, **EPS)
  single = [np.asarray(keep(*args, keys[i])) for i in (0, 1, 7, 1999)]
  np.testing.assert_array_equal(np.asarray(keep(*args, keys[7])), single[2])
  batched = np.asarray(VMAPPED_KEEP(*args, keys))
  for s, i in zip(single, (0, 1, 7, 1999)):
    np.testing.assert_array_equal(batched[i], s)
  assert (~single[0]).any() and any((x != single[0]).any() for x in single[1:])


def test_clip_cov_padding_never_matters():
  logp, old, adv, mask = _batch(5, (16, 64))
  pad = mask == 0
  assert pad.any()
  keep_fn = functools.partial(KEEP, ratio=0.05, **EPS)
  loss_fn = functools.partial(CLIP_LOSS, **EPS)
  key = jax.random.key(0)
  ref = np.asarray(keep_fn(*_jax(logp, old, adv, mask), key))
  ref_loss = np.asarray(loss_fn(*_jax(logp, old, adv, mask), jnp.asarray(ref)))
  rng = np.random.default_rng(0)
  for fill in (1e4, -1e4, np.nan):
    noise = [np.where(pad, np.float32(fill) * rng.uniform(0.5, 1.0, mask.shape), x).astype(np.float32)
             for x in (logp, old, adv)]
    keep = np.asarray(keep_fn(*_jax(*noise, mask), key))
    np.testing.assert_array_equal(keep, ref)
    np.testing.assert_array_equal(np.asarray(loss_fn(*_jax(*noise, mask), jnp.asarray(keep))), ref_loss)
  assert np.all(ref[pad])


def test_clip_cov_edge_cases():
  logp, old, adv, mask = _batch(6, (8, 40))
  args = _jax(logp, old, adv, mask)
  assert not bool(jnp.all(KEEP(*args, jax.random.key(0), ratio=0.02, **EPS)))  # something is detached
  # Empty window (every |Cov| < 1): nothing detached.
  small = _jax(logp, old, adv * 1e-3, mask)
  assert float(jnp.max(jnp.abs(COVARIANCE(small[0], small[2], small[3])))) < 1.0
  keep = KEEP(*small, jax.random.key(0), ratio=0.02, **EPS)
  assert bool(jnp.all(keep))
  # No valid token.
  keep = KEEP(*args[:3], jnp.zeros_like(args[3]), jax.random.key(0), ratio=0.02, **EPS)
  assert bool(jnp.all(keep))
  with pytest.raises(ValueError):
    C.clip_cov_keep(*args, jax.random.key(0), ratio=0.0, **EPS)


@pytest.mark.parametrize("shape,ratio", CASES + [((16, 64), 0.5)])
def test_kl_cov_matches_verl(shape, ratio):
  mask_fn = functools.partial(PENALISED, ratio=ratio)
  loss_fn = functools.partial(KL_LOSS, kl_coef=0.1)
  for seed in range(3):
    logp, old, adv, mask = _batch(seed, shape)
    pg_loss, pg_losses, idx = verl_kl_cov(*_torch(old, logp, adv, mask), kl_cov_ratio=ratio, ppo_kl_coef=0.1)
    theirs = np.zeros(mask.size, bool)
    theirs[idx.numpy()] = True
    theirs = theirs.reshape(mask.shape)
    penalised = np.asarray(mask_fn(*_jax(logp, adv, mask)))
    # No ties in the data: the top-k set is well defined.
    cov = np.asarray(COVARIANCE(*_jax(logp, adv, mask)))[mask > 0]
    assert np.unique(cov).size == cov.size
    np.testing.assert_array_equal(penalised, theirs)
    assert penalised.sum() == max(1, int(int(mask.sum()) * ratio))
    ours = np.asarray(loss_fn(*_jax(logp, old, adv, mask), jnp.asarray(penalised)))
    valid = mask > 0
    np.testing.assert_allclose(ours[valid], pg_losses.numpy()[valid], rtol=1e-6, atol=1e-6)
    assert np.all(ours[~valid] == 0)
    np.testing.assert_allclose(_token_mean(ours, mask), float(pg_loss), rtol=1e-5, atol=1e-7)


def test_kl_cov_loss_has_no_clip_and_penalises_only_selected():
  logp, old, adv, mask = _batch(8, (8, 40))
  penalised = np.zeros(mask.shape, bool)
  penalised[0, :3] = True
  loss = np.asarray(KL_LOSS(*_jax(logp, old, adv, mask), jnp.asarray(penalised), kl_coef=2.0))
  r = np.exp(logp.astype(np.float64) - old)
  expected = -adv * r + 2.0 * np.abs(logp.astype(np.float64) - old) * penalised
  valid = mask > 0
  assert np.any((r > 1.3) & valid) and np.any((r < 0.7) & valid)  # far outside any clip range
  np.testing.assert_allclose(loss[valid], expected[valid], rtol=1e-5, atol=1e-6)


def test_kl_cov_gradient_matches_verl_also_on_policy():
  """d(token-mean loss)/d(log p) equals torch autograd through verl's loss, with half the tokens
  exactly on-policy (log p = log p_old, where torch's |x| has gradient 0 and jnp.abs's has 1)."""
  logp, old, adv, mask = _batch(11, (8, 40))
  old = np.where(np.arange(40)[None, :] % 2 == 0, logp, old).astype(np.float32)
  ratio = 0.2
  penalised = np.asarray(PENALISED(*_jax(logp, adv, mask), ratio=ratio))
  assert np.any(penalised & (logp == old)) and np.any(penalised & (logp != old))
  lp, o, a, m = _torch(logp, old, adv, mask)
  lp.requires_grad_(True)
  verl_kl_cov(o, lp, a, m, kl_cov_ratio=ratio, ppo_kl_coef=0.5)[0].backward()
  ours = jax.grad(lambda x: jnp.sum(KL_LOSS(x, *_jax(old, adv, mask), jnp.asarray(penalised), kl_coef=0.5))
                  / mask.sum())(jnp.asarray(logp))
  np.testing.assert_allclose(np.asarray(ours), lp.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_kl_cov_count_is_exact_under_jit():
  """max(1, int(N * ratio)) in float64, for every N of one compiled function (N traced)."""
  b, t = 16, 64
  n_max = b * t
  for ratio in (2e-4, 0.1, 0.3, 0.7):
    counts = jax.jit(jax.vmap(lambda n, ratio=ratio: C._verl_count(ratio, n, n_max)))(jnp.arange(n_max + 1))
    expected = [max(int(ratio * n), 1) for n in range(n_max + 1)]
    np.testing.assert_array_equal(np.asarray(counts), expected, err_msg=str(ratio))
  # Through the public function (one compilation, n_valid traced).
  logp, _, adv, _ = _batch(9, (b, t))
  args = _jax(logp, adv)
  fn = functools.partial(PENALISED, ratio=0.5)
  for n in (0, 1, 2, 3, 4, 5, 63, 64, 65, 1023, 1024):
    mask = jnp.asarray((np.arange(n_max) < n).reshape(b, t).astype(np.float32))
    assert int(jnp.sum(fn(*args, mask))) == (max(1, int(n * 0.5)) if n else 0), n


def test_kl_cov_ties_go_to_first_token():
  logp = np.array([[-1.0, -3.0, -1.0, -3.0]], np.float32)
  adv = np.array([[1.0, -1.0, 1.0, -1.0]], np.float32)
  mask = np.ones_like(logp)
  # All four covariances equal 1; ratio 0.5 -> k = 2: the first two in row-major order.
  pen = np.asarray(PENALISED(*_jax(logp, adv, mask), ratio=0.5))
  np.testing.assert_array_equal(pen, [[True, True, False, False]])


def test_kl_cov_padding_never_matters():
  logp, old, adv, mask = _batch(10, (16, 64))
  pad = mask == 0
  assert pad.any()
  mask_fn = functools.partial(PENALISED, ratio=0.05)
  loss_fn = functools.partial(KL_LOSS, kl_coef=0.1)
  ref = np.asarray(mask_fn(*_jax(logp, adv, mask)))
  ref_loss = np.asarray(loss_fn(*_jax(logp, old, adv, mask), jnp.asarray(ref)))
  for fill in (1e4, -1e4, np.nan):
    noise = [np.where(pad, np.float32(fill), x) for x in (logp, old, adv)]
    pen = np.asarray(mask_fn(*_jax(noise[0], noise[2], mask)))
    np.testing.assert_array_equal(pen, ref)
    np.testing.assert_array_equal(np.asarray(loss_fn(*_jax(*noise, mask), jnp.asarray(pen))), ref_loss)
  assert not ref[pad].any()
