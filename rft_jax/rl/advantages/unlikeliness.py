r"""Unlikeliness reward: down-weight the reward of likely correct samples within a group.

He, Fried, Welleck 2025, "Rewarding the Unlikely: Lifting GRPO Beyond Distribution
Sharpening" (arXiv 2506.02355), applied to the rewards *before* the group advantages
(:func:`rft_jax.rl.advantages.compute_advantages`). For a group of :math:`G` samples
:math:`y_1..y_G` of one prompt with rewards :math:`r_i`,

.. math::

  s_i = \frac{1}{|y_i|} \sum_t \log \pi_{\theta_{old}}(y_{i,t} \mid x, y_{i,<t}), \qquad
  \mathrm{rank}_i = \big|\{j : s_j < s_i\}\big| \in \{0, \dots, G-1\}, \qquad
  \tilde r_i = r_i \Big(1 - \beta_{rank} \frac{\mathrm{rank}_i}{G}\Big),

so the least likely sample of the group (rank 0) keeps its full reward and the most
likely one keeps :math:`1 - \beta_{rank}(G-1)/G` of it.

**Source and confidence.** This is transcribed from the authors' released code
(github.com/AndreHe02/rewarding-unlikely-release, Apache-2.0,
``verl/trainer/ppo/ray_lean_trainer.py``, ``RayPPOTrainer._compute_advantages``)::

    old_log_probs = masked_mean(old_log_probs, eos_mask, axis=-1)     # mean token log-prob
    group_ranks = torch.argsort(torch.argsort(group_old_log_probs))   # ascending: 0 = least likely
    group_ranks = group_ranks / len(group_indices)                    # G = all samples of the group
    group_scores = group_scores * (1 - group_ranks * rank_penalty)

with ``+lean.rank_penalty=0.25`` in the released recipe (``examples/lean/grpo.sh``; the
code default is 0, i.e. off). In that code:

* the likelihood is the **length-normalised mean** of the token log-probs under the
  sampling (old) policy, not the sum (:func:`mean_token_logp` computes it);
* **all** samples of the group are ranked, correct or not, and :math:`G` counts all of
  them; rewards are binary (1 proved / 0 not), so incorrect samples stay at 0. Hence the
  least likely *correct* sample keeps its full reward only when no incorrect sample is
  less likely than it.

The paper's own equation could **not** be read here (only its abstract was reachable), so
the direction/offset of the rank in the paper's notation is unconfirmed; the form above is
the one the authors ran. Departures, both no-ops for the authors' binary rewards:
incorrect samples (``correct == False``) are returned unchanged whatever their reward,
and ties in :math:`s` are broken deterministically by position in the group (the earlier
sample gets the lower rank; ``torch.argsort`` leaves tie order unspecified).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def mean_token_logp(token_logp: Float[Array, "B T"], mask: Array) -> Float[Array, "B"]:
  """Per-sequence mean log-prob over the valid tokens (verl ``masked_mean(..., axis=-1)``)."""
  m = mask.astype(jnp.float32)
  lp = jnp.where(m > 0, token_logp.astype(jnp.float32), 0.0)
  return jnp.sum(lp * m, axis=-1) / (jnp.sum(m, axis=-1) + 1e-8)


def likelihood_ranks(seq_logp: Float[Array, "G n"]) -> Array:
  """Ascending rank of each sample in its group (0 = least likely); ties by position."""
  order = jnp.argsort(seq_logp, axis=-1, stable=True)
  return jnp.argsort(order, axis=-1, stable=True)


def unlikeliness_rewards(
    rewards: Float[Array, "G n"],
    correct: Bool[Array, "G n"],
    seq_logp: Float[Array, "G n"],
    *,
    beta_rank: float,
) -> Float[Array, "G n"]:
  r"""Unlikeliness-adjusted rewards :math:`\tilde r` (module docstring), ``[G, n]`` groups.

  ``seq_logp`` is each sample's mean token log-prob under the sampling policy (see
  :func:`mean_token_logp`); every sample of a group is ranked and :math:`G` = ``n``.
  Incorrect samples are returned unchanged. Pure and ``jit``-compatible.
  """
  r = rewards.astype(jnp.float32)
  n = r.shape[-1]
  ranks = likelihood_ranks(seq_logp.astype(jnp.float32)).astype(jnp.float32)
  scaled = r * (1.0 - ranks / n * beta_rank)
  return jnp.where(correct, scaled, r)
