r"""Entropy-discriminator clipping: token masks that control entropy (arXiv 2602.03392, Sec. 4).

Theorem 2 says a GRPO step on token :math:`k` moves the entropy by
:math:`-\alpha (S_* - \mathbb{E}_p[S])` with :math:`\alpha \propto A`. A negative sample
(:math:`A < 0`) whose token has a very negative :math:`S_*` (a rare token being pushed
down) lowers the entropy; removing such outliers from the loss slows entropy collapse.

* **Clip_B** (Algorithm 1, Eq. 15) thresholds the batch-standardised :math:`S_*`:
  keep a token when :math:`-\mu^- \sigma \le S_* - \bar S_* \le \mu^+ \sigma`, with
  :math:`\bar S_*, \sigma` the mean and population standard deviation of :math:`S_*`
  over every valid response token of the training batch.
* **Clip_V** (Algorithm 2, Eq. 16) thresholds the centred score
  :math:`S^c = S_* - \mathbb{E}_p[S]`: keep a token when
  :math:`-\mu^- \sigma_c \le S^c \le \mu^+ \sigma_c`. :math:`S^c` is not re-centred
  by its batch mean, whose expectation is 0 (Corollary 2); :math:`\sigma_c` is its
  batch standard deviation.

The paper states both cuts two-sided on all tokens. The authors' released configs,
whose values are the defaults here, cut one side only (``mu_high=None``: no upper
cut) and only on negative samples (``samples="negative"``): Clip_B ``mu_low=2.5``;
Clip_V ``mu_low=8.5`` with at most ``max_frac=1e-4`` of the valid tokens masked (the
most extreme ones). ``mu_high`` and ``samples`` give the paper's two-sided, all-token
form.

**Against the authors' released code** (Trinity-RFT 0.6.0,
``trinity/algorithm/advantage_fn/clipb_advantage.py`` and ``clipv_advantage.py``, run
side by side on identical tensors): Clip_B agrees token for token, and so does Clip_V on
tokens with a non-zero advantage; Clip_V's cap is theirs,
:math:`\max(\lfloor \text{max\_frac} \cdot n_{valid} \rfloor, 1)` tokens, so a batch of
fewer than :math:`1 / \text{max\_frac}` tokens still loses its most extreme one. Two
differences remain, both documented choices:

* *Which log-probs form* :math:`S_*`. Here the learner recomputes :math:`\log p_k`, like
  :math:`H` and :math:`\mathbb{E}_p[S]`, under the parameters being trained
  (``learner.entropy_mask.logp_source=learner``, the default). The authors' Clip_B takes
  :math:`S_* = e^{\ell}(H + \ell)` with :math:`\ell` the *rollout's* log-prob and
  :math:`H` the trainer's recomputed entropy; ``logp_source=sampler`` reproduces it. Their
  Clip_V forms :math:`S_*` from ``old_log_probs``, the trainer's recomputed ones (i.e.
  ``learner``), and reads :math:`\mathbb{E}_p[S]` from a batch field ``necs`` that no code
  of the 0.6.0 release fills.
* *Zero-advantage tokens.* The authors' Clip_V docstring says it clips negative samples
  only, but its code keeps positive-advantage tokens and applies the cut to every other
  one (``torch.where(A > 0, True, keep_neg)``): tokens with :math:`A = 0` beyond the bound
  are masked too, and are not limited by the ``max_frac`` cap, which selects among
  :math:`A < 0` tokens only. With :math:`A = 0` they carry no policy gradient, but leave the token-mean
  denominator. ``samples="negative"`` here masks :math:`A < 0` tokens only; compare
  ``mask_frac`` with theirs on negative samples.

Every mask here is a *keep* mask: multiply it into the loss mask, so that a masked
token leaves both the loss numerator and the token-mean denominator. Statistics are
float32 (or wider), stop-gradient, and taken over the arrays as given: pass the whole
training batch (under ``jit`` a sharded global array), never a micro-batch or one
device's shard.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from rft_jax.entropy.discriminator import stats_dtype
from rft_jax.entropy.dynamics import masked_mean

Samples = Literal["negative", "positive", "all"]
SAMPLES = ("negative", "positive", "all")
# Whose log-prob of the sampled token forms S_* for the masks (see the module docstring):
# the learner's recomputed one (default) or the sampler's (the authors' Clip_B).
LOGP_SOURCES = ("learner", "sampler")

# Defaults of the authors' released configs.
CLIP_B_MU_LOW = 2.5
CLIP_V_MU_LOW = 8.5
CLIP_V_MAX_FRAC = 1e-4


def eligible_samples(advantages: Float[Array, "..."], samples: Samples) -> Bool[Array, "..."]:
  """Tokens a mask may remove: of negative (A < 0), positive (A > 0) or all samples."""
  if samples == "negative":
    return advantages < 0
  if samples == "positive":
    return advantages > 0
  if samples == "all":
    return jnp.ones(advantages.shape, bool)
  raise ValueError(f"samples must be one of {SAMPLES}, got {samples!r}")


def masked_mean_std(x: Float[Array, "..."], mask: Array) -> tuple[Float[Array, ""], Float[Array, ""]]:
  """Mean and population standard deviation of ``x`` over ``mask`` (sum / count).

  Both are computed about one of the masked values (shifted data), so equal values give a mean
  equal to them and a standard deviation of exactly 0 in any summation order: a sum of 32
  copies of 0.3 in float32 is not 32 x 0.3, and the rounding would otherwise leave a sigma of
  about 1e-8 that makes ``mu = 0`` mask half of a batch whose values are all the same."""
  flat_mask = jnp.broadcast_to(mask, x.shape).reshape(-1).astype(bool)
  pivot = jax.lax.stop_gradient(x.reshape(-1)[jnp.argmax(flat_mask)])
  offset = masked_mean(x - pivot, mask)
  return pivot + offset, jnp.sqrt(masked_mean(jnp.square(x - pivot - offset), mask))


def _outlier_keep_mask(deviation, sigma, advantages, mask, mu_low, mu_high, samples, max_frac):
  """Keep-mask removing eligible tokens with deviation outside [-mu_low s, mu_high s]."""
  if mu_low is None and mu_high is None:
    raise ValueError("at least one of mu_low / mu_high must be set")
  for name, mu in (("mu_low", mu_low), ("mu_high", mu_high)):
    if mu is not None and mu < 0:
      raise ValueError(f"{name} must be >= 0, got {mu}")
  if max_frac is not None and not 0.0 <= max_frac <= 1.0:
    raise ValueError(f"max_frac must be in [0, 1], got {max_frac}")
  valid = mask.astype(bool)
  # How far beyond its bound each token lies, in units of sigma (<= 0: inside).
  safe_sigma = jnp.where(sigma > 0, sigma, 1.0)
  excess = jnp.full(deviation.shape, -jnp.inf, deviation.dtype)
  if mu_low is not None:
    excess = jnp.maximum(excess, -deviation / safe_sigma - mu_low)
  if mu_high is not None:
    excess = jnp.maximum(excess, deviation / safe_sigma - mu_high)
  masked = valid & eligible_samples(advantages, samples) & (excess > 0) & (sigma > 0)
  if max_frac is not None:
    # Keep only the max(floor(max_frac * n_valid), 1) most extreme candidates masked: the
    # authors' budget, so that a batch of fewer than 1 / max_frac tokens still loses its
    # most extreme one.
    budget = jnp.maximum(jnp.floor(max_frac * jnp.sum(valid)), 1).astype(jnp.int32)
    score = jnp.where(masked, excess, -jnp.inf).reshape(-1)
    rank = jnp.empty_like(score, dtype=jnp.int32).at[jnp.argsort(-score, stable=True)].set(
        jnp.arange(score.size, dtype=jnp.int32)
    )
    masked = masked & (rank.reshape(masked.shape) < budget)
  return jax.lax.stop_gradient(~masked)


def clip_b_mask(
    s_star: Float[Array, "..."],
    advantages: Float[Array, "..."],
    mask: Array,
    *,
    mu_low: float | None = CLIP_B_MU_LOW,
    mu_high: float | None = None,
    samples: Samples = "negative",
) -> Bool[Array, "..."]:
  r"""Clip_B keep-mask (Algorithm 1, Eq. 15): batch-standardised :math:`S_*` outliers.

  .. math::  \text{keep}_t = \Big[-\mu^- \sigma \le S_{*,t} - \bar S_* \le \mu^+ \sigma\Big]
             \ \lor\ t \notin \text{samples},

  with :math:`\bar S_*` and :math:`\sigma` the mean and population standard deviation
  of :math:`S_*` over the valid tokens. ``mu_high=None`` (default) has no upper cut;
  if :math:`\sigma = 0` nothing is masked.

  Args:
    s_star: ``[...]`` :math:`S_*` of every token of the training batch.
    advantages: ``[...]`` per-token advantages (their sign selects ``samples``).
    mask: ``[...]`` valid response tokens.
    mu_low: lower cut :math:`\mu^-` in standard deviations (default 2.5).
    mu_high: upper cut :math:`\mu^+`, or ``None``.
    samples: ``"negative"`` (A < 0, default), ``"positive"`` (A > 0) or ``"all"``.

  Returns:
    ``[...]`` bool keep-mask (True on every invalid token).
  """
  s = jax.lax.stop_gradient(s_star).astype(stats_dtype(s_star.dtype))
  mean, sigma = masked_mean_std(s, mask)
  return _outlier_keep_mask(s - mean, sigma, advantages, mask, mu_low, mu_high, samples, None)


def clip_v_mask(
    s_centered: Float[Array, "..."],
    advantages: Float[Array, "..."],
    mask: Array,
    *,
    mu_low: float | None = CLIP_V_MU_LOW,
    mu_high: float | None = None,
    samples: Samples = "negative",
    max_frac: float | None = CLIP_V_MAX_FRAC,
) -> Bool[Array, "..."]:
  r"""Clip_V keep-mask (Algorithm 2, Eq. 16): outliers of :math:`S^c = S_* - \mathbb{E}_p[S]`.

  .. math::  \text{keep}_t = \Big[-\mu^- \sigma_c \le S^c_t \le \mu^+ \sigma_c\Big]
             \ \lor\ t \notin \text{samples},

  with :math:`\sigma_c` the population standard deviation of :math:`S^c` over the
  valid tokens; :math:`S^c` is compared with 0, its expectation under the policy
  (Corollary 2), not re-centred. ``max_frac`` caps the masked share of valid tokens,
  keeping the most extreme ones (furthest beyond the bound) masked.

  Args:
    s_centered: ``[...]`` :math:`S_* - \mathbb{E}_p[S]` of every token.
    advantages: ``[...]`` per-token advantages.
    mask: ``[...]`` valid response tokens.
    mu_low: lower cut :math:`\mu^-` (default 8.5).
    mu_high: upper cut :math:`\mu^+`, or ``None``.
    samples: ``"negative"`` (default), ``"positive"`` or ``"all"``.
    max_frac: cap on the masked tokens, :math:`\max(\lfloor \text{max\_frac} \cdot
      n_{valid} \rfloor, 1)` of them (the authors' budget; default 1e-4), or ``None``.

  Returns:
    ``[...]`` bool keep-mask.
  """
  s = jax.lax.stop_gradient(s_centered).astype(stats_dtype(s_centered.dtype))
  _, sigma = masked_mean_std(s, mask)
  return _outlier_keep_mask(s, sigma, advantages, mask, mu_low, mu_high, samples, max_frac)


def discriminator_sign_mask(
    s_star: Float[Array, "..."],
    advantages: Float[Array, "..."],
    *,
    sign: Literal["positive", "negative"],
    action: Literal["keep", "drop", "only"],
    samples: Samples,
) -> Bool[Array, "..."]:
  r"""The token masks of the paper's Figure 1 experiments.

  On the chosen ``samples``, ``action="drop"`` removes the tokens whose :math:`S_*`
  has the given ``sign`` and ``action="keep"`` keeps only them; tokens of other
  samples are untouched. ``action="only"`` keeps those tokens and nothing else of the
  batch: the update is the chosen samples' tokens of that sign alone, so that their
  effect is seen in isolation. By Theorem 1, on positive samples the
  :math:`S_* > 0` tokens drive entropy down and the :math:`S_* < 0` tokens drive it up;
  on negative samples (a penalty) the other way round.

  Returns:
    ``[...]`` bool keep-mask.
  """
  if sign not in ("positive", "negative"):
    raise ValueError(f"sign must be 'positive' or 'negative', got {sign!r}")
  if action not in ("keep", "drop", "only"):
    raise ValueError(f"action must be 'keep', 'drop' or 'only', got {action!r}")
  s = jax.lax.stop_gradient(s_star)
  has_sign = s > 0 if sign == "positive" else s < 0
  chosen = eligible_samples(advantages, samples)
  if action == "only":
    return chosen & has_sign
  selected = has_sign if action == "drop" else ~has_sign
  return ~(chosen & selected)
