"""High-entropy forking-token mask against TRL 1.16.0 on identical tensors.

``trl_get_high_entropy_mask`` transcribes ``GRPOTrainer.get_high_entropy_mask`` of TRL 1.16.0
(Apache-2.0; ``pip download --no-deps trl==1.16.0``, ``trl/trainer/grpo_trainer.py``) line for
line in torch, for one process: ``accelerator.pad_across_processes`` and ``accelerator.gather``
are the identity there. ``trl_entropy_mask`` transcribes its caller in
``GRPOTrainer._compute_loss`` (``if self.top_entropy_quantile < 1.0: ...``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rft_jax.rl.token_methods.forking import forking_token_mask


def trl_get_high_entropy_mask(entropies, mask, threshold):
  """GRPOTrainer.get_high_entropy_mask (one process)."""
  local = entropies[mask.bool()].float()

  # Use a negative pad_value as a sentinel because entropy values are always >= 0.
  # This guarantees that the sentinel cannot collide with any real entropy value.
  pad_value = -1e9

  # Pad across processes so that every rank has the same tensor length
  padded = local  # self.accelerator.pad_across_processes(local, dim=0, pad_index=pad_value), one process
  gathered = padded  # self.accelerator.gather(padded), one process

  # Drop sentinel values (safe because no entropy can be negative)
  gathered = gathered[gathered != pad_value]

  if gathered.numel() == 0:
    return torch.zeros_like(entropies, dtype=torch.bool)

  entropy_threshold = torch.quantile(gathered, threshold)
  masked_entropies = entropies * mask.float()
  entropy_mask = masked_entropies >= entropy_threshold
  return entropy_mask & mask.bool()  # ensure padding tokens are always masked out


def trl_entropy_mask(entropies, mask, top_entropy_quantile):
  """The caller in GRPOTrainer._compute_loss; None (no mask) means every valid token counts."""
  if top_entropy_quantile < 1.0:
    entropy_mask = trl_get_high_entropy_mask(entropies, mask, 1 - top_entropy_quantile)
  else:
    entropy_mask = None
  return mask.bool() if entropy_mask is None else entropy_mask


def _batch(seed, shape, *, ties=False, min_len=0):
  """Entropies in [0, 6) and a right-padded mask with random lengths."""
  rng = np.random.default_rng(seed)
  b, t = shape
  entropy = rng.uniform(0.0, 6.0, shape).astype(np.float32)
  if ties:
    entropy = np.round(entropy * 2) / 2  # 13 distinct values: many ties, also at the quantile
  lengths = rng.integers(min_len, t + 1, size=b)
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
  return entropy, mask


SHAPES = [(1, 1), (1, 9), (3, 7), (8, 33), (16, 128)]
RHOS = [0.0, 0.2, 0.37, 0.5, 0.8, 1.0]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rho", RHOS)
def test_matches_trl(shape, rho):
  for seed in range(4):
    for ties in (False, True):
      entropy, mask = _batch(seed, shape, ties=ties, min_len=1)
      ours = np.asarray(forking_token_mask(jnp.asarray(entropy), jnp.asarray(mask), rho=rho))
      theirs = trl_entropy_mask(torch.from_numpy(entropy), torch.from_numpy(mask), rho).numpy()
      np.testing.assert_array_equal(ours, theirs, err_msg=f"seed={seed} ties={ties}")


def test_matches_trl_on_many_sizes_under_jit():
  """One compiled function, traced n_valid: every count of valid tokens 0..T of one row."""
  t = 40
  rng = np.random.default_rng(7)
  entropy = rng.uniform(0.0, 6.0, (2, t)).astype(np.float32)
  for rho in (0.2, 0.5, 0.9):
    fn = jax.jit(functools.partial(forking_token_mask, rho=rho))
    for n in range(0, 2 * t + 1, 3):
      mask = (np.arange(2 * t) < n).reshape(2, t).astype(np.float32)
      ours = np.asarray(fn(jnp.asarray(entropy), jnp.asarray(mask)))
      theirs = trl_entropy_mask(torch.from_numpy(entropy), torch.from_numpy(mask), rho).numpy()
      np.testing.assert_array_equal(ours, theirs, err_msg=f"rho={rho} n={n}")


def test_share_kept_is_about_rho():
  """Without ties, the linear (1 - rho) quantile at float32 position i = q (N - 1) keeps N - ceil(i)."""
  entropy, mask = _batch(3, (16, 128), min_len=64)
  n_valid = int(mask.sum())
  for rho in (0.2, 0.37, 0.5):
    kept = int(np.asarray(forking_token_mask(jnp.asarray(entropy), jnp.asarray(mask), rho=rho)).sum())
    position = np.float32(1.0 - rho) * np.float32(n_valid - 1)
    assert kept == n_valid - int(np.ceil(position))
    assert abs(kept - rho * n_valid) <= 1


def test_rho_edge_cases():
  entropy, mask = _batch(1, (4, 16), min_len=2)
  e, m = jnp.asarray(entropy), jnp.asarray(mask)
  np.testing.assert_array_equal(np.asarray(forking_token_mask(e, m, rho=1.0)), mask > 0)
  top = np.asarray(forking_token_mask(e, m, rho=0.0))
  assert top.sum() == 1 and entropy[top][0] == entropy[mask > 0].max()
  # No valid token: nothing kept (TRL returns zeros).
  np.testing.assert_array_equal(np.asarray(forking_token_mask(e, jnp.zeros_like(m), rho=0.2)), False)
  for bad in (-0.1, 1.5):
    with pytest.raises(ValueError):
      forking_token_mask(e, m, rho=bad)


def test_padding_never_matters():
  entropy, mask = _batch(5, (8, 33), min_len=1)
  pad = mask == 0
  assert pad.any()
  fn = jax.jit(functools.partial(forking_token_mask, rho=0.2))
  ref = np.asarray(fn(jnp.asarray(entropy), jnp.asarray(mask)))
  for fill in (1e9, -1e9, np.nan, np.inf, 0.0):
    changed = np.where(pad, np.float32(fill), entropy)
    out = np.asarray(fn(jnp.asarray(changed), jnp.asarray(mask)))
    np.testing.assert_array_equal(out, ref, err_msg=str(fill))
  assert not ref[pad].any()


def test_jit_equals_eager_and_no_gradient():
  entropy, mask = _batch(2, (8, 33), min_len=1)
  e, m = jnp.asarray(entropy), jnp.asarray(mask)
  eager = forking_token_mask(e, m, rho=0.2)
  jitted = jax.jit(functools.partial(forking_token_mask, rho=0.2))(e, m)
  np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
  assert jitted.dtype == jnp.bool_ and jitted.shape == entropy.shape
  grad = jax.grad(lambda x: jnp.sum(forking_token_mask(x, m, rho=0.2) * x))(e)
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(eager, np.float32))
