"""verl 0.9.1's masked reductions and ``agg_loss``'s token-mean branch, transcribed line for line in
torch (Apache-2.0; ``pip download --no-deps verl==0.9.1``: ``verl/utils/torch_functional.py``
``masked_sum``, ``masked_mean``; ``verl/trainer/ppo/core_algos.py`` ``agg_loss``), shared by the
parity tests of the methods taken from verl (test_cov_methods.py, test_gae.py)."""

import torch


def verl_masked_sum(values, mask, axis=None):
  valid_values = torch.where(mask.bool(), values, 0.0)
  return (valid_values * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
  s = verl_masked_sum(values, mask, axis)
  return s / (mask.sum(axis=axis) + 1e-8)


def verl_agg_loss_token_mean(loss_mat, loss_mask, dp_size=1, batch_num_tokens=None):
  """``agg_loss(loss_agg_mode="token-mean")`` on one data-parallel rank."""
  if batch_num_tokens is None:
    batch_num_tokens = loss_mask.sum()
  loss = verl_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
  return loss
