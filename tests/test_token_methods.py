"""The registry of token methods (``rft_jax.rl.token_methods``): config keys are validated against
it, the learner asks the configured methods, and the worked example of ``docs/extending.md`` adds a
method."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax.entropy import TokenStats, clip_b_mask
from rft_jax.rl.config import EntropyMaskConfig, EntropyMethodConfig, LearnerConfig
from rft_jax.rl.learner import Learner
from rft_jax.rl.token_methods import TOKEN_METHODS, TokenInputs, configured_method, method_names
from rft_jax.rl.token_methods.entropy_target import EntropyTarget
from test_learner import config, synthetic_batch, tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def robust_clip_b():
  """The worked example of ``docs/extending.md``, executed from the page, registered for one test."""
  page = (ROOT / "docs" / "extending.md").read_text()
  block = re.search(r"^## Adding a token method\n.*?```python\n(.*?)```", page, re.S | re.M).group(1)
  namespace: dict = {}
  exec(compile(block, "docs/extending.md", "exec"), namespace)
  yield namespace["RobustClipB"]
  TOKEN_METHODS.pop("clip_b_robust")


def test_the_shipped_methods_are_registered_under_their_config_keys():
  assert set(method_names(removes_tokens=True)) == {"none", "clip_b", "clip_v", "sign"}
  assert set(method_names(removes_tokens=False)) == {"none", "clip_cov", "kl_cov", "forking"}
  for kind in ("clip_cov", "kl_cov", "forking"):
    method = configured_method(LearnerConfig(entropy_method=EntropyMethodConfig(kind=kind)), removes_tokens=False)
    assert method.name == kind and not method.removes_tokens
  target = LearnerConfig(entropy_mask=EntropyMaskConfig(kind="clip_v", target_entropy=0.5))
  assert isinstance(configured_method(target, removes_tokens=True), EntropyTarget)


@pytest.mark.parametrize("section,kind,message", [
    ("entropy_mask", "clip_cov", r"entropy_mask.kind='clip_cov' is not one of .*clip_cov is set by learner.entropy_method.kind"),
    ("entropy_method", "clip_b", r"entropy_method.kind='clip_b' is not one of .*clip_b is set by learner.entropy_mask.kind"),
    ("entropy_mask", "entropy_target", r"entropy_mask.kind='entropy_target' is not one of \['clip_b', 'clip_v', 'none', 'sign'\]"),
])
def test_a_kind_is_validated_against_the_registry(section, kind, message):
  cls = EntropyMaskConfig if section == "entropy_mask" else EntropyMethodConfig
  with pytest.raises(ValueError, match=message):
    cls(kind=kind)


def test_a_method_with_its_own_loss_refuses_the_dual_clip():
  for kind in ("clip_cov", "kl_cov"):
    with pytest.raises(ValueError, match=f"dual_clip=3.0 with {kind}"):
      LearnerConfig(dual_clip=3.0, entropy_method=EntropyMethodConfig(kind=kind))
  LearnerConfig(dual_clip=3.0, entropy_method=EntropyMethodConfig(kind="forking"))  # weights only


def test_no_string_tests_of_a_method_kind_outside_the_config():
  """The learner and the loop ask the configured method; only ``rl/config.py`` reads ``kind``."""
  pattern = re.compile(r"entropy_(mask|method)\.kind\s*(==|!=|in\b|not in\b)")
  offenders = [f"{path.relative_to(ROOT)}:{i}" for path in (ROOT / "rft_jax").rglob("*.py")
               for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
  assert not offenders, offenders


def _batch():
  rng = np.random.default_rng(0)
  s_star = rng.standard_t(2, size=(8, 16)).astype(np.float32)
  adv = np.repeat(np.where(np.arange(8) % 2 == 0, 1.0, -1.0), 16).reshape(8, 16).astype(np.float32)
  stats = TokenStats(logp=jnp.asarray(-np.abs(s_star)), entropy=jnp.full((8, 16), 0.5, jnp.float32),
                     s_star=jnp.asarray(s_star), expected_s=jnp.zeros((8, 16)))
  mask = jnp.asarray((np.arange(16)[None, :] < rng.integers(8, 17, (8, 1))).astype(np.float32))
  return stats, jnp.asarray(adv) * mask, mask


def test_the_readme_example_registers_a_mask_that_the_config_and_the_learner_use(robust_clip_b):
  stats, adv, mask = _batch()
  cfg = LearnerConfig(entropy_mask=EntropyMaskConfig(kind="clip_b_robust", mu_low=1.0, samples="all"))
  assert cfg.entropy_mask.resolved_mu_low == 1.0 and EntropyMaskConfig(kind="clip_b_robust").resolved_mu_low == 3.0
  keep = configured_method(cfg, removes_tokens=True).choose(TokenInputs(stats, stats.logp, adv, mask, mask, 0)).keep
  s, valid = np.asarray(stats.s_star), np.asarray(mask) > 0
  median = np.median(s[valid])
  scale = 1.4826 * np.median(np.abs(s[valid] - median))
  np.testing.assert_array_equal(np.asarray(keep), ~(valid & (s - median < -scale)))
  assert 0 < (~np.asarray(keep)).sum() < valid.sum()
  # Not Clip_B: the same cut in standard deviations around the mean masks other tokens.
  assert not np.array_equal(np.asarray(keep), np.asarray(clip_b_mask(stats.s_star, adv, mask, mu_low=1.0, samples="all")))
  # The entropy target accepts it as a mask with a cut.
  EntropyMaskConfig(kind="clip_b_robust", target_entropy=1.0)

  model = tiny_model()
  data, _ = synthetic_batch(model)
  learner = Learner(model, config(micro_batch_size=16, entropy_mask=EntropyMaskConfig(kind="clip_b_robust", mu_low=0.5,
                                                                                      samples="all")))
  _, metrics = learner.step(learner.init(model), data)
  assert 0 < metrics["mask_frac"] < 1 and np.isfinite(metrics["loss"])
