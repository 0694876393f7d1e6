r"""The GRPO learner: one compiled train step over a batch of rollouts (:class:`Learner`).

The package, by concern: ``batch.py`` (:class:`LearnerBatch`, built from the sampler's typed
rollouts by :func:`learner_batch`, and the layout of its per-token arrays), ``plan.py`` (the
step plan: micro-batches, forward passes, token choices and the micro-batch loss), ``forward.py``
(the forward passes and their statistics), ``routing.py`` (a mixture-of-experts policy's router
terms, expert load, routing mismatch and routing replay), ``metrics.py`` (metrics and the
entropy-change forecasts), ``placement.py`` (shardings and compilation) and ``learner.py``
(:class:`Learner`, composing them).

A step, all inside one ``jax.jit`` with explicit shardings:

1. **Pre-update pass** (no gradient), micro-batch by micro-batch: per-token
   :math:`\log p`, :math:`H`, :math:`S_*`, :math:`\mathbb{E}_p[S]` under
   :math:`\mathrm{softmax}(z/T)` (``token_stats`` on hidden states, chunked over
   positions). They give the old log-probs of the ratio, the metrics, the Corollary 4
   forecast and the entropy mask.
2. **Token methods** (``rft_jax.rl.token_methods``) on the *whole batch*: the entropy mask
   (Clip_B / Clip_V / sign / the entropy target) is multiplied into the loss mask, so masked
   tokens leave numerator and denominator; the entropy method (Clip-Cov / KL-Cov / forking
   tokens) weights or penalises tokens of the loss numerator, or gives its own loss. Before
   them, the rollout correction (``learner.rollout_correction``, ``rft_jax.rl.rollout_correction``)
   compares the pre-update log-probs with the sampler's: its rejection multiplies the loss mask
   the entropy mask and method then choose from (verl rejects before its loss), its importance
   weights multiply each token's policy loss.
3. **Updates**: ``ppo_epochs`` x ``mini_batches`` optimizer steps; each accumulates the
   gradients of its micro-batches (normalised by the mini-batch's global token /
   sequence counts, so accumulation is exact), clips the global norm and applies AdamW.
   On the very first update the parameters are those of the pre-update pass, and the
   old log-probs are taken from the same forward pass (stop-gradient): the ratio is
   exactly 1.
4. **Non-finite guard**: if a loss, a gradient norm or an updated parameter is not finite (a
   NaN in a weight, an absurd learning rate), the step returns its input state unchanged
   (parameters, optimizer state and step counter) and reports ``nonfinite_skipped = 1``.

On a mixture-of-experts policy every forward pass also returns its routers' logits: the
load-balancing loss (``learner.router_aux_loss_coef``) and the router z-loss
(``learner.router_z_loss_coef``) join each micro-batch's loss, and the step reports them, the
expert load and, when the batch carries the sampler's expert ids, the share of completion tokens
the learner routes differently (``router/*``). With ``learner.routing_replay`` every forward pass
routes by the sampler's ids (the gate's weights still the live router's). A dense policy's step
is the same program as before.

With ``kl_coef > 0``, the step also runs a no-gradient forward pass of
the frozen reference parameters (``rft_jax.rl.reference``; an argument of the compiled step
beside the state, never donated) for the reference log-probs of the KL term.

When the step is a single update on a single micro-batch (``mini_batches = ppo_epochs = 1``
and ``micro_batch_size`` = the batch), steps 1-3 share one forward pass: the statistics of
step 1 are the stop-gradient of the forward the gradient is taken through. A single update on
several micro-batches shares them too when nothing is chosen over the whole batch (no entropy
mask, no entropy method): each micro-batch's statistics come from its gradient's forward
(:meth:`Learner.shares_forward_pass`).

Batches are split into micro-batches by striding rows (micro-batch ``i`` holds rows
``i, i + n, ...``) so that each micro-batch stays spread over the data-parallel devices.

With ``learner.micro_batch_tokens`` set, micro-batches are made of tokens instead
(``rft_jax.rl.token_batches``): each mini-batch's rows are packed, several sequences per row
(segment ids, each sequence's own RoPE positions), into micro-batches of ``r`` rows of the batch's
width, and scanned like row micro-batches; a plan of ``[M, n, r, L]`` token indices, made on the
host by :meth:`Learner.token_plan`, is an argument of the compiled step. The statistics are
scattered back to the batch's ``[B, L-1-p]`` layout, where the entropy mask, the loss normaliser
(as per-token aggregation weights, ``rft_jax.rl.losses.aggregation_weights``), the metrics and
the per-row statistics are computed exactly as with row micro-batches; only the padding the rows
carried is not computed. Padding is what long-tailed rollouts are mostly made of.

Statistics and log-probs are computed only from the batch's first completion column on
(:func:`first_response_column`, a static argument of the compiled step found on the host): the
prompt positions still run through the decoder (the completion attends to them), but not through
the unembedding and ``token_stats``. Every ``[B, L-1]`` per-token array of the step is then
``[B, L-1-p]`` with ``p = max(column - 1, 0)`` (position ``t`` predicts token ``t + 1``).
"""

from rft_jax.rl.learner.batch import LearnerBatch, SampledRollouts, learner_batch
from rft_jax.rl.learner.learner import Learner
from rft_jax.rl.model_trainer import TrainState

__all__ = ["Learner", "LearnerBatch", "SampledRollouts", "TrainState", "learner_batch"]
