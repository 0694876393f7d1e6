"""The theory of arXiv 2602.03392 as pure JAX functions.

Nothing here imports the rest of the project. See ``discriminator`` (H, S, E_p[S]),
``dynamics`` (Theorems 1-2, Lemma 1, Corollary 4), ``token_stats`` (the chunked
per-token pass the learner uses), ``vocab_sum`` (its sums over the vocabulary, whose float32
error does not grow with the vocabulary) and ``clipping`` (the Clip_B / Clip_V masks).
"""

from rft_jax.entropy.clipping import clip_b_mask
from rft_jax.entropy.clipping import clip_v_mask
from rft_jax.entropy.clipping import discriminator_sign_mask
from rft_jax.entropy.discriminator import centered_token_discriminator
from rft_jax.entropy.discriminator import discriminator
from rft_jax.entropy.discriminator import entropy
from rft_jax.entropy.discriminator import expected_discriminator
from rft_jax.entropy.discriminator import token_discriminator
from rft_jax.entropy.discriminator import token_discriminator_from_logp
from rft_jax.entropy.dynamics import batch_entropy_change
from rft_jax.entropy.dynamics import entropy_jvp
from rft_jax.entropy.dynamics import first_order_grpo_update
from rft_jax.entropy.dynamics import first_order_logit_update
from rft_jax.entropy.dynamics import first_order_prob_update
from rft_jax.entropy.dynamics import masked_covariance
from rft_jax.entropy.dynamics import masked_mean
from rft_jax.entropy.token_stats import TokenStats
from rft_jax.entropy.token_stats import token_stats

__all__ = [
    "TokenStats",
    "batch_entropy_change",
    "centered_token_discriminator",
    "clip_b_mask",
    "clip_v_mask",
    "discriminator_sign_mask",
    "discriminator",
    "entropy",
    "entropy_jvp",
    "expected_discriminator",
    "first_order_grpo_update",
    "first_order_logit_update",
    "first_order_prob_update",
    "masked_covariance",
    "masked_mean",
    "token_discriminator",
    "token_discriminator_from_logp",
    "token_stats",
]
