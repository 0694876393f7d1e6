r"""Clip-Cov and KL-Cov: covariance-targeted entropy control (Cui et al. 2025).

Source: G. Cui et al., *The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models*, arXiv:2505.22617 (2025). The entropy change of a policy-gradient
step is driven by the covariance between a token's log-prob and its advantage; both
methods act on the few tokens with the largest centred covariance

.. math::  \mathrm{Cov}_t = \big(A_t - \bar A\big)\big(\log \pi_\theta(y_t) - \overline{\log \pi_\theta}\big),

with the means :math:`\bar A, \overline{\log\pi_\theta}` over the valid tokens of the batch.

* **Clip-Cov** removes the gradient of a random :math:`\max(\lfloor r N \rfloor, 1)` of the
  tokens (:math:`N` valid tokens, :math:`r` = ``ratio``) with
  :math:`\omega_{low} < \mathrm{Cov}_t < \omega_{high}` (``lb``, ``ub``) that the PPO clip
  has not already clipped.
* **KL-Cov** adds :math:`\beta\,|\log\pi_\theta - \log\pi_{old}|` to the loss of the top
  :math:`\max(\lfloor r N \rfloor, 1)` tokens by covariance; the rest get the *unclipped*
  surrogate :math:`-A_t r_t`.

Peer implementation: verl 0.9.1 (Apache-2.0), ``verl/trainer/ppo/core_algos.py``,
``compute_policy_loss_clip_cov`` and ``compute_policy_loss_kl_cov`` (adapted there from
PRIME-RL/Entropy-Mechanism-of-RL). Every function here is checked against verl 0.9.1
core_algos.py on identical tensors (``tests/test_cov_methods.py``, torch transcription).
Defaults are verl's config defaults, ``verl/trainer/config/actor/actor.yaml`` lines 64-76
(= ``verl/workers/config/actor.py`` lines 95-99, ``PolicyLossConfig``): ``clip_cov_ratio:
0.0002``, ``clip_cov_lb: 1.0``, ``clip_cov_ub: 5.0``, ``kl_cov_ratio: 0.0002``,
``ppo_kl_coef: 0.1``. (The loss functions fall back to 1.0 for ``ppo_kl_coef`` only when the
config value is ``None``; the shipped default is 0.1.)

**As token methods** (:class:`ClipCov`, :class:`KLCov`, at the end of this module). The
token sets are chosen once per train step, over the whole batch's valid loss tokens, from the
pre-update pass (as Clip_B's statistics are): the covariance uses the pre-update log-probs, and
Clip-Cov's "not already clipped by PPO" holds for every token there (the ratio is 1). verl
chooses per micro-batch and, over several mini-batches, with the ratio of each update; with one
update per batch on one micro-batch the two agree. Clip-Cov's random choice is drawn from a key
folded with the train step, so a resumed run draws the same tokens. Both replace the clipped
surrogate by verl's loss, which has no dual clip.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from rft_jax.rl.checks import positive
from rft_jax.rl.token_methods.covariance import _ratio, _verl_count, token_covariance
from rft_jax.rl.token_methods.registry import TokenChoice, TokenInputs, TokenMethod, register_token_method

# verl 0.9.1 defaults: verl/trainer/config/actor/actor.yaml:64-76 (verl/workers/config/actor.py:95-99).
CLIP_COV_RATIO = 2e-4
CLIP_COV_LB = 1.0
CLIP_COV_UB = 5.0
KL_COV_RATIO = 2e-4
KL_COV_COEF = 0.1


@dataclasses.dataclass
class ClipCovSettings:
  """Clip-Cov's settings, verl 0.9.1's names and defaults (part of ``learner.entropy_method``).

  Attributes:
    clip_cov_ratio: the share of the batch's valid tokens whose gradient Clip-Cov removes (verl
      0.9.1: 2e-4).
    clip_cov_lb / clip_cov_ub: Clip-Cov's open covariance bounds, between which its candidates
      lie (verl 0.9.1: 1, 5).
  """

  clip_cov_ratio: float = CLIP_COV_RATIO
  clip_cov_lb: float = CLIP_COV_LB
  clip_cov_ub: float = CLIP_COV_UB

  def check_clip_cov(self, section: str) -> None:
    """``ValueError`` naming ``section.<key>`` for a ratio outside (0, 1] or bounds out of order."""
    share(f"{section}.clip_cov_ratio", self.clip_cov_ratio)
    if self.clip_cov_lb >= self.clip_cov_ub:
      raise ValueError(f"{section}.clip_cov_lb={self.clip_cov_lb} must be below "
                       f"clip_cov_ub={self.clip_cov_ub}")


@dataclasses.dataclass
class KLCovSettings:
  """KL-Cov's settings, verl 0.9.1's names and defaults (part of ``learner.entropy_method``).

  Attributes:
    kl_cov_ratio / kl_cov_coef: KL-Cov's share of tokens and its coefficient (verl 0.9.1: 2e-4,
      0.1).
  """

  kl_cov_ratio: float = KL_COV_RATIO
  kl_cov_coef: float = KL_COV_COEF

  def check_kl_cov(self, section: str) -> None:
    """``ValueError`` naming ``section.<key>`` for a ratio outside (0, 1] or a negative coefficient."""
    share(f"{section}.kl_cov_ratio", self.kl_cov_ratio)
    positive(f"{section}.kl_cov_coef", self.kl_cov_coef, allow_zero=True)


def share(key: str, value: float) -> None:
  """``ValueError`` naming ``key`` unless ``0 < value <= 1`` (a share of the batch's tokens)."""
  if not 0 < value <= 1:
    raise ValueError(f"{key} must be in (0, 1], got {value!r}")


def clip_cov_candidates(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Array,
    *,
    eps_low: float,
    eps_high: float,
    lb: float = CLIP_COV_LB,
    ub: float = CLIP_COV_UB,
    log_ratio_clamp: float = 20.0,
) -> Bool[Array, "B T"]:
  r"""Tokens Clip-Cov may detach: valid, not PPO-clipped, and :math:`lb < \mathrm{Cov}_t < ub`.

  With :math:`\ell^1_t = -A_t r_t`, :math:`\ell^2_t = -A_t\,\mathrm{clip}(r_t, 1-\epsilon_{low},
  1+\epsilon_{high})`, verl's ``clip_by_origin`` is :math:`\ell^2_t > \ell^1_t` (the clip is
  active); those tokens are excluded. Bounds are strict on both sides, as in verl.
  """
  valid = mask > 0
  _, ratio = _ratio(logp, old_logp, log_ratio_clamp)
  adv = jax.lax.stop_gradient(advantages).astype(jnp.float32)
  ratio = jax.lax.stop_gradient(ratio)
  loss1 = -adv * ratio
  loss2 = -adv * jnp.clip(ratio, 1 - eps_low, 1 + eps_high)
  clipped = loss2 > loss1
  cov = token_covariance(logp, advantages, mask)
  return valid & ~clipped & (cov > lb) & (cov < ub)


def clip_cov_keep(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Array,
    key: Array,
    *,
    eps_low: float,
    eps_high: float,
    ratio: float = CLIP_COV_RATIO,
    lb: float = CLIP_COV_LB,
    ub: float = CLIP_COV_UB,
    log_ratio_clamp: float = 20.0,
) -> Bool[Array, "B T"]:
  r"""Clip-Cov (Cui et al. 2025): False on the tokens whose gradient is removed.

  Candidates (:func:`clip_cov_candidates`) are the valid tokens with
  :math:`lb < \mathrm{Cov}_t < ub` that the PPO clip has not clipped
  (:math:`\ell^2_t \le \ell^1_t`). Of them a uniformly random subset of

  .. math::  k = \min\big(\max(\lfloor r N \rfloor, 1),\ |\text{candidates}|\big)

  tokens is chosen (:math:`N` valid tokens, :math:`r` = ``ratio``; verl:
  ``clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)`` and
  ``torch.randperm`` over the candidates, first ``min(clip_num, len)``). Here the subset is
  the :math:`k` candidates of lowest i.i.d. uniform 32-bit priority drawn from ``key`` (one
  sort, static shapes under ``jit``; the same key gives the same choice): every
  :math:`k`-subset is equally likely, up to equal priorities (probability about
  :math:`n_{cand}^2 / 2^{33}` per call), which go to the token first in row-major order.

  **How verl applies it.** verl sets ``corr = 0`` on the chosen tokens and uses the
  per-token loss

  .. math::  \ell_t = \max\big(-A_t r_t,\ -A_t\,\mathrm{clip}(r_t, 1-\epsilon_{low}, 1+\epsilon_{high})\big)\cdot \mathrm{corr}_t

  (the plain clipped surrogate, *no dual clip*; :func:`clip_cov_loss`), then aggregates
  it with the unchanged ``response_mask`` (``agg_loss``; token-mean:
  ``masked_sum(pg_losses, response_mask) / batch_num_tokens``): the chosen tokens
  contribute 0 to the numerator but **stay in the denominator**. Do the same:
  ``loss * keep`` with the loss mask and normaliser unchanged (not ``mask & keep``).

  Checked against verl 0.9.1 core_algos.py on identical tensors (candidate set, count,
  chosen tokens among the candidates, uniformity over keys).

  Args:
    logp, old_logp: ``[B, T]`` current and behaviour-policy log-probs of the sampled tokens.
    advantages: ``[B, T]`` per-token advantages.
    mask: ``[B, T]`` valid response tokens (``> 0``).
    key: PRNG key for the random choice.
    eps_low, eps_high: PPO clip range (verl's ``clip_ratio_low`` / ``clip_ratio_high``).
    ratio: share of the valid tokens to detach (verl ``clip_cov_ratio``, default 2e-4).
    lb, ub: open covariance bounds (verl ``clip_cov_lb`` 1.0, ``clip_cov_ub`` 5.0).
    log_ratio_clamp: the log-ratio is clamped to this before ``exp``, like
      :func:`rft_jax.rl.losses.ppo_clipped_loss` (verl does not clamp; identical below it).

  Returns:
    ``[B, T]`` bool, False exactly on the chosen tokens (all valid), True elsewhere.
  """
  if ratio <= 0:
    raise ValueError(f"ratio must be > 0 (verl asserts it), got {ratio}")
  candidates = clip_cov_candidates(
      logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high, lb=lb, ub=ub,
      log_ratio_clamp=log_ratio_clamp,
  )
  size = candidates.size
  n_valid = jnp.sum(mask > 0).astype(jnp.int32)
  n_candidates = jnp.sum(candidates).astype(jnp.int32)
  count = jnp.minimum(_verl_count(ratio, n_valid, size), n_candidates)
  # Candidates first, in the order of i.i.d. 32-bit random priorities; the first `count` are chosen.
  flat = candidates.reshape(-1)
  priority = jax.random.bits(key, (size,), jnp.uint32)
  index = jnp.arange(size, dtype=jnp.int32)
  _, _, order = jax.lax.sort((~flat, priority, index), num_keys=3)
  chosen = jnp.zeros((size,), bool).at[order].set(index < count).reshape(candidates.shape)
  return jax.lax.stop_gradient(~chosen)


def clip_cov_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Array,
    keep: Bool[Array, "B T"],
    *,
    eps_low: float,
    eps_high: float,
    log_ratio_clamp: float = 20.0,
) -> Float[Array, "B T"]:
  r"""verl's per-token Clip-Cov loss, 0 off the mask.

  .. math::  \ell_t = \max\big(-A_t r_t,\ -A_t\,\mathrm{clip}(r_t, 1-\epsilon_{low}, 1+\epsilon_{high})\big)\cdot \mathrm{keep}_t,
             \quad r_t = e^{\log\pi_\theta - \log\pi_{old}},

  the clipped surrogate of :func:`rft_jax.rl.losses.ppo_clipped_loss` without dual clip,
  times :func:`clip_cov_keep`. Aggregate with the *unchanged* mask (the detached tokens
  stay in the denominator, as in verl). Checked against verl 0.9.1 core_algos.py
  (``compute_policy_loss_clip_cov``, ``pg_losses``) on identical tensors.
  """
  _, ratio = _ratio(logp, old_logp, log_ratio_clamp)
  adv = advantages.astype(jnp.float32)
  loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - eps_low, 1 + eps_high))
  return jnp.where((mask > 0) & keep, loss, 0.0)


def kl_cov_penalty_mask(
    logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Array,
    *,
    ratio: float = KL_COV_RATIO,
) -> Bool[Array, "B T"]:
  r"""KL-Cov (Cui et al. 2025): the tokens that receive the KL penalty.

  The top

  .. math::  k = \max\big(1, \lfloor N r \rfloor\big)

  valid tokens by :func:`token_covariance` (:math:`N` valid tokens, :math:`r` = ``ratio``;
  none when :math:`N = 0`). verl: ``k_percent_nums = max(1, int(len(cov_lst_all) *
  kl_cov_ratio))``, ``torch.topk(cov_lst_all, k_percent_nums, largest=True)`` over the valid
  tokens' covariance in row-major order (a token with exactly the k-th largest value may
  or may not be picked: ``torch.topk``'s order among ties is unspecified). Here ties at
  the boundary go to the token that comes first in row-major order (stable sort), so
  exactly :math:`k` tokens are always selected. :math:`N` is traced under ``jit``: the
  selection is a rank (stable ``argsort``) compared with :math:`k`.

  Checked against verl 0.9.1 core_algos.py on identical tensors (tie-free covariances).

  Args:
    logp: ``[B, T]`` current log-probs of the sampled tokens.
    advantages: ``[B, T]`` per-token advantages.
    mask: ``[B, T]`` valid response tokens.
    ratio: share of the valid tokens penalised (verl ``kl_cov_ratio``, default 2e-4).

  Returns:
    ``[B, T]`` bool, True on the penalised tokens (all valid).
  """
  if ratio <= 0:
    raise ValueError(f"ratio must be > 0 (verl asserts it), got {ratio}")
  valid = mask > 0
  cov = token_covariance(logp, advantages, mask)
  size = cov.size
  n_valid = jnp.sum(valid).astype(jnp.int32)
  k = jnp.where(n_valid > 0, _verl_count(ratio, n_valid, size), 0)
  # Descending covariance over the valid tokens, padding last; ties by row-major index.
  score = jnp.where(valid, -cov, jnp.inf).reshape(-1)
  order = jnp.argsort(score, stable=True)
  rank = jnp.empty((size,), jnp.int32).at[order].set(jnp.arange(size, dtype=jnp.int32))
  return jax.lax.stop_gradient(valid & (rank.reshape(cov.shape) < k))


def kl_cov_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Array,
    penalised: Bool[Array, "B T"],
    *,
    kl_coef: float = KL_COV_COEF,
    log_ratio_clamp: float = 20.0,
) -> Float[Array, "B T"]:
  r"""verl's per-token KL-Cov loss, 0 off the mask.

  .. math::  \ell_t = -A_t r_t + \beta\,\big|\log\pi_\theta(y_t) - \log\pi_{old}(y_t)\big|\cdot[t \in \text{penalised}],
             \quad r_t = e^{\log\pi_\theta - \log\pi_{old}},

  with :math:`\beta` = ``kl_coef`` (verl ``ppo_kl_coef``; config default 0.1,
  ``actor.yaml:76``). There is **no PPO clip** anywhere in verl's KL-Cov loss: the
  unpenalised tokens get the plain importance-weighted surrogate :math:`-A_t r_t`.
  ``penalised`` comes from :func:`kl_cov_penalty_mask`. Aggregate with the mask (verl's
  ``agg_loss`` with ``response_mask``). The log-ratio is clamped to ``log_ratio_clamp``
  inside ``exp`` only (verl does not clamp; identical below it). The gradient of
  :math:`|x|` at :math:`x = 0` is 0, as torch's (``jnp.abs`` would give 1): on the first,
  on-policy update the penalty adds nothing, as in verl.

  Checked against verl 0.9.1 core_algos.py (``compute_policy_loss_kl_cov``, ``pg_losses``)
  on identical tensors, values and gradients.
  """
  log_ratio, ratio = _ratio(logp, old_logp, log_ratio_clamp)
  loss = -advantages.astype(jnp.float32) * ratio
  # |x| as sign(x) x: its gradient at x = 0 is 0, as torch's abs (jnp.abs's is 1). On-policy, the
  # first update has log p = log p_old exactly: the penalty must then add no gradient, as in verl.
  abs_log_ratio = jax.lax.stop_gradient(jnp.sign(log_ratio)) * log_ratio
  loss = jnp.where(penalised, loss + kl_coef * abs_log_ratio, loss)
  return jnp.where(mask > 0, loss, 0.0)


# The token methods: the choice over the whole batch, then verl's loss on each micro-batch.

CLIP_COV_KEY = 0x0C0F  # the base key of Clip-Cov's choice, folded with the step


@register_token_method("clip_cov")
class ClipCov(TokenMethod):
  """Clip-Cov: the gradient of a random ``clip_cov_ratio`` share of the tokens with covariance in
  ``(clip_cov_lb, clip_cov_ub)`` is removed (:func:`clip_cov_keep`)."""

  replaces_loss = True

  def choose(self, inputs: TokenInputs) -> TokenChoice:
    c, m = self.config, self.config.entropy_method
    key = jax.random.fold_in(jax.random.key(CLIP_COV_KEY), inputs.step)
    logp = inputs.stats.logp
    keep = clip_cov_keep(logp, logp, inputs.advantages, inputs.loss_mask, key, eps_low=c.resolved_eps_low,
                         eps_high=c.resolved_eps_high, ratio=m.clip_cov_ratio, lb=m.clip_cov_lb, ub=m.clip_cov_ub)
    return TokenChoice.everything(keep.shape)._replace(weight=keep.astype(jnp.float32))

  def policy_loss(self, ppo_loss, logp, old_logp, advantages, loss_mask, weight, penalised) -> jax.Array:
    c = self.config
    return clip_cov_loss(logp, old_logp, advantages, loss_mask, weight > 0, eps_low=c.resolved_eps_low,
                         eps_high=c.resolved_eps_high)


@register_token_method("kl_cov")
class KLCov(TokenMethod):
  """KL-Cov: the top ``kl_cov_ratio`` share of tokens by covariance gets ``kl_cov_coef * |log p -
  log p_old|`` (:func:`kl_cov_penalty_mask`)."""

  replaces_loss = True

  def choose(self, inputs: TokenInputs) -> TokenChoice:
    m = self.config.entropy_method
    penalised = kl_cov_penalty_mask(inputs.stats.logp, inputs.advantages, inputs.loss_mask, ratio=m.kl_cov_ratio)
    return TokenChoice.everything(penalised.shape)._replace(penalised=penalised)

  def policy_loss(self, ppo_loss, logp, old_logp, advantages, loss_mask, weight, penalised) -> jax.Array:
    return kl_cov_loss(logp, old_logp, advantages, loss_mask, penalised, kl_coef=self.config.entropy_method.kl_cov_coef)

  def touched(self, choice: TokenChoice) -> jax.Array:
    return choice.penalised
