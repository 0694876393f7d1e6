"""The entropy target (``learner.entropy_mask.target_entropy``): a Clip_B / Clip_V cut chosen per
batch from Corollary 4's forecasts, so the policy's entropy is held near a set value."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax.entropy import TokenStats, batch_entropy_change, clip_b_mask
from rft_jax.rl.config import EntropyMaskConfig
from rft_jax.rl.token_methods import TARGET_MU_GRID, TokenInputs
from rft_jax.rl.token_methods.entropy_target import EntropyTarget
from rft_jax.rl.learner import Learner
from test_learner import config, synthetic_batch, tiny_model


def batch(entropy_level: float, seed: int = 0):
  """``[8, 16]`` statistics in which low-S_* tokens of negative samples lower the entropy."""
  rng = np.random.default_rng(seed)
  s_star = rng.normal(size=(8, 16)).astype(np.float32)
  advantages = np.repeat(np.where(np.arange(8) % 2 == 0, 1.0, -1.0), 16).reshape(8, 16).astype(np.float32)
  stats = TokenStats(logp=jnp.asarray(-np.abs(s_star)), entropy=jnp.full((8, 16), entropy_level, jnp.float32),
                     s_star=jnp.asarray(s_star), expected_s=jnp.zeros((8, 16)))
  return stats, jnp.asarray(advantages), jnp.ones((8, 16), jnp.float32)


@pytest.mark.parametrize("entropy,share", [(1.2, 0.0), (1.0, 0.0), (0.95, 0.5), (0.9, 1.0), (0.5, 1.0)])
def test_the_cut_asks_for_more_entropy_the_further_below_the_target(entropy, share):
  cfg = config(entropy_mask=EntropyMaskConfig(kind="clip_b", target_entropy=1.0, target_band=0.1))
  stats, advantages, mask = batch(entropy)
  choice = EntropyTarget(cfg).choose(TokenInputs(stats, stats.logp, advantages, mask, mask, jnp.asarray(0)))
  keep, mu, got_share = choice.keep, choice.metrics["target_mu"], choice.metrics["target_share"]
  assert float(got_share) == pytest.approx(share, abs=1e-4)  # float32 entropies
  forecasts = {m: float(batch_entropy_change(advantages, stats.centered, mask * clip_b_mask(
      stats.s_star, advantages, mask, mu_low=m), 1.0)) for m in TARGET_MU_GRID[1:]}
  forecasts[0.0] = float(batch_entropy_change(advantages, stats.centered, mask, 1.0))  # no cut
  wanted = forecasts[0.0] + float(got_share) * (max(forecasts.values()) - forecasts[0.0])
  # The largest cut (0: none) whose forecast reaches the asked one.
  expected = next(m for m in (0.0, *TARGET_MU_GRID[1:]) if forecasts[m] >= wanted - 1e-6 * abs(wanted))
  assert float(mu) == expected
  if share == 0.0:
    assert float(mu) == 0.0 and bool(keep.all())  # at or above the target: plain GRPO
  if share == 1.0:
    assert forecasts[float(mu)] == pytest.approx(max(forecasts.values())) and not bool(keep.all())


def test_a_learner_step_logs_the_cut_and_masks_only_below_the_target():
  model = tiny_model()
  data, _ = synthetic_batch(model)
  masked = {}
  for target in (100.0, 1e-3):  # far above the policy's entropy, far below
    model = tiny_model()
    learner = Learner(model, config(micro_batch_size=16, entropy_mask=EntropyMaskConfig(  # one pass
        kind="clip_v", target_entropy=target, max_frac=1.0)))
    _, metrics = learner.step(learner.init(model), data)
    masked[target] = metrics
  assert masked[100.0]["target_share"] == 1.0 and masked[100.0]["target_mu"] > 0 and masked[100.0]["mask_frac"] > 0
  assert masked[1e-3]["target_share"] == 0.0 and masked[1e-3]["target_mu"] == 0.0 and masked[1e-3]["mask_frac"] == 0.0


def test_a_target_needs_a_clip_mask():
  with pytest.raises(ValueError, match="target_entropy chooses a Clip_B / Clip_V cut"):
    EntropyMaskConfig(kind="sign", target_entropy=0.5)
