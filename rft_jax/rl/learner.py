r"""The GRPO learner: one compiled train step over a batch of rollouts.

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

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rft_jax.entropy import batch_entropy_change, masked_mean, token_stats
from rft_jax.parallel import global_array, host_array
from rft_jax.rl import reference as ref_lib
from rft_jax.rl.batching import (
    first_response_column,
    first_stats_position,
    merge_counts,
    merge_rows,
    split_rows,
)
from rft_jax.rl.config import LearnerConfig
from rft_jax.rl.losses import aggregate_loss, aggregation_weights, kl_penalty, loss_normaliser
from rft_jax.rl.model_trainer import ModelTrainer, TrainState
from rft_jax.rl.nonfinite import keep_if_finite
from rft_jax.rl.rollout_correction import RolloutCorrection, importance_weights, rollout_correction
from rft_jax.rl.token_batches import (
    PackedRows,
    gather_tokens,
    packed_row_count,
    packed_rows,
    scatter_tokens,
    token_plan,
)
from rft_jax.rl.token_methods import TokenInputs, configured_method


@flax.struct.dataclass
class LearnerBatch:
  """Rollouts as the learner sees them; token arrays are aligned with ``input_ids``.

  Attributes:
    input_ids: ``[B, L]`` prompt (left-padded) followed by completion (right-padded).
    attention_mask: ``[B, L]`` 1 on real tokens.
    response_mask: ``[B, L]`` 1 on completion tokens that count in the loss.
    advantages: ``[B]`` one advantage per completion (GRPO), or ``[B, L]`` one per token, aligned
      with ``input_ids`` (PPO's GAE advantages; read on the completion tokens only).
    sampler_logp: ``[B, L]`` the sampler's log-prob of each completion token (the
      ``logp_mismatch`` metric; the rollout correction's pi_rollout; the entropy mask's S_* with
      ``entropy_mask.logp_source=sampler``).
  """

  input_ids: jax.Array
  attention_mask: jax.Array
  response_mask: jax.Array
  advantages: jax.Array
  sampler_logp: jax.Array


class Learner(ModelTrainer):
  """Compiles and runs the GRPO train step for one model architecture and config.

  The learner holds no training state: :meth:`init` returns a :class:`TrainState` and
  :meth:`step` maps a state and a batch to the next state and the step's metrics. With
  ``kl_coef > 0`` it holds the frozen reference parameters (:attr:`reference`), made by
  :meth:`init`.

  Args:
    model: the policy (its architecture; :meth:`init` takes its parameters).
    config: the learner's config.
    mesh: device mesh (None: one device).
    data_axis: the mesh axis batch rows are split over.
    reference: the reference policy of the KL term, an ``nnx.Module`` or its ``nnx.Param``
      state, of the policy's architecture (e.g. another checkpoint); None: the policy's starting
      parameters, those of the model given to :meth:`init`. Used only when ``kl_coef > 0``.
  """

  def __init__(self, model: nnx.Module, config: LearnerConfig, *, mesh: Mesh | None = None,
               data_axis: str = "data", reference: Any = None):
    super().__init__(model, config.optim, mesh=mesh, data_axis=data_axis)
    self.config = config
    self.entropy_mask = configured_method(config, removes_tokens=True)  # Clip_B, Clip_V, ...
    self.entropy_method = configured_method(config, removes_tokens=False)  # Clip-Cov, KL-Cov, ...
    self.objective = config.policy_objective  # PPO's or GSPO's surrogate
    self._reference_source = reference
    self.reference = None  # frozen reference parameters, set by init() when kl_coef > 0
    self._train_step = None  # compiled on the first step, with the state's shardings
    self._mean_entropy = jax.jit(self._mean_entropy_fn, static_argnums=2)
    self._entropy_change = jax.jit(self._entropy_change_fn, static_argnums=3)

  # ---------------------------------------------------------------------------------------
  # State.

  def init(self, model: nnx.Module) -> TrainState:
    """A fresh train state holding ``model``'s parameter arrays (in place, with their shardings).

    The state owns those arrays from now on: :meth:`step` donates them, so use
    :meth:`model` (not the ``model`` passed here) after the first step. With a mesh, the
    optimizer state is created directly in the layout of :meth:`state_shardings`.

    With ``kl_coef > 0`` it also sets :attr:`reference`: :meth:`reference_params` of the
    constructor's ``reference``, or else of ``model``, copied before any step donates it.
    """
    if self.config.kl_coef > 0 and self.reference is None:
      source = model if self._reference_source is None else self._reference_source
      self.reference = self.reference_params(source, like=nnx.state(model, nnx.Param))
      self._reference_source = None  # the learner keeps only the frozen copy
    return super().init(model)

  def _param_shardings(self, params):
    """The parameters' layout on the mesh (None without a mesh)."""
    return None if self.mesh is None else self.state_shardings(params).params

  def reference_params(self, source: Any, *, like: Any = None) -> Any:
    """Frozen reference parameters from ``source`` (an ``nnx.Module`` or its ``nnx.Param``
    state, of the policy's architecture): a copy in ``learner.ref_dtype``, laid out like the
    policy parameters ``like`` (default: ``source``'s own), sharing no buffer with ``source``.
    One more copy of the model in memory (half of it in bfloat16)."""
    params = ref_lib.reference_source_params(source)
    like = params if like is None else ref_lib.reference_source_params(like)
    ref_lib.check_matches_policy(params, like)
    return ref_lib.frozen_copy(params, self._param_shardings(like), self.config.ref_dtype)

  def abstract_reference(self, params) -> Any:
    """The reference parameters the step takes for policy ``params`` (abstract or concrete, laid
    out on the mesh), as ``jax.ShapeDtypeStruct`` with shardings; None when ``kl_coef == 0``.
    Its bytes are the reference's memory (``rft-jax plan``)."""
    if self.config.kl_coef <= 0:
      return None
    return ref_lib.abstract_reference(params, self._param_shardings(params), self.config.ref_dtype)

  # ---------------------------------------------------------------------------------------
  # Pieces of the step.

  def _token_stats(self, params, input_ids, attention_mask, entropy_grad=False, first_position=0):
    """Stats of the next-token positions ``first_position .. L-2``, ``[b, L-1-first_position]``
    (position t predicts token t+1). The decoder runs over all ``L`` tokens; only the hidden
    states of those positions go through the unembedding."""
    model = self.merge(params)
    hidden = model(input_ids, attention_mask, return_hidden=True, mesh=self.mesh)
    return token_stats(hidden[:, first_position:-1], input_ids[:, first_position + 1:],
                       unembedding=model.unembedding(),
                       temperature=self.config.sampling_temperature, chunk_size=self.config.stats_chunk_size,
                       entropy_grad=entropy_grad)

  def _packed_token_stats(self, params, packed: PackedRows, entropy_grad=False):
    """``token_stats`` ``[r, W]`` of packed rows (``rft_jax.rl.token_batches``): every slot, the
    statistic of predicting ``packed.targets`` (meaningful where ``packed.stat_index`` maps)."""
    model = self.merge(params)
    hidden = model(packed.input_ids, positions=packed.positions, segment_ids=packed.segment_ids,
                   return_hidden=True, mesh=self.mesh)
    return token_stats(hidden, packed.targets, unembedding=model.unembedding(),
                       temperature=self.config.sampling_temperature, chunk_size=self.config.stats_chunk_size,
                       entropy_grad=entropy_grad)

  def _micro_batches(self, batch_size: int) -> int:
    if batch_size % self.config.micro_batch_size:
      raise ValueError(f"batch of {batch_size} sequences does not split into micro-batches of "
                       f"learner.micro_batch_size={self.config.micro_batch_size}")
    return batch_size // self.config.micro_batch_size

  def batch_stats(self, params, batch: LearnerBatch, stats_from_column: int = 0, entropy_grad: bool = False,
                  token_index: jax.Array | None = None):
    """``token_stats`` of ``batch``'s next-token positions predicting the tokens of columns
    ``max(stats_from_column, 1) ..`` (``[B, L-1-p]``, ``p = first_stats_position(stats_from_column)``;
    ``[B, L-1]`` by default), micro-batch by micro-batch; ``entropy_grad``: the entropy carries
    derivatives (``token_stats``). ``token_index``: the ``[M, n, r, L]`` plan of
    :meth:`token_plan`: packed micro-batches (0 where a position predicts no real token)."""
    if token_index is not None:
      rows, width = batch.input_ids.shape
      first_position = first_stats_position(stats_from_column)
      parts = token_index.reshape(-1, *token_index.shape[2:])  # [M * n, r, L]
      packed = PackedRows(*(self.constrain_micro_batches(x) for x in packed_rows(
          parts, batch.input_ids, batch.attention_mask, first_position)))
      stats = jax.lax.map(lambda p: self._packed_token_stats(params, p, entropy_grad), packed)
      shape = (rows, width - 1 - first_position)
      return jax.tree.map(lambda x: scatter_tokens(x, packed.stat_index, shape), stats)
    n = self._micro_batches(batch.input_ids.shape[0])
    ids, attn = (self.constrain_micro_batches(split_rows(x, n)) for x in (batch.input_ids, batch.attention_mask))
    first_position = first_stats_position(stats_from_column)
    stats = jax.lax.map(lambda xs: self._token_stats(params, *xs, entropy_grad=entropy_grad,
                                                     first_position=first_position), (ids, attn))
    return jax.tree.map(merge_rows, stats)

  def _loss_normaliser(self, loss_mask, input_ids):
    """``loss_normaliser`` of a (mini-)batch's ``[b, L-1-p]`` loss mask. Dr.GRPO's constant length
    defaults to the full next-token width ``L - 1`` of ``input_ids`` (``[b, L]``), whichever
    first position the statistics start from."""
    return loss_normaliser(loss_mask, self.config.max_len or input_ids.shape[1] - 1)

  def _loss_terms(self, stats, micro, normaliser, old_logp):
    """The micro-batch's loss (policy term, KL, entropy bonus) and its clip counts. ``normaliser``:
    the mini-batch's ``LossNormaliser``, or None for packed rows, whose ``micro["loss_weight"]``
    (``aggregation_weights``) holds it."""
    c = self.config
    mask = micro["loss_mask"]
    if normaliser is None:
      weight = micro["loss_weight"]
      aggregate = lambda x, mask, mode, normaliser: jnp.sum(jnp.where(weight != 0, x * weight, 0.0))
    else:
      aggregate = aggregate_loss
    terms, policy_loss = self._policy_loss(stats.logp, old_logp, micro)
    loss = aggregate(policy_loss, mask, c.loss_agg, normaliser)
    if c.kl_coef > 0:
      loss += c.kl_coef * aggregate(kl_penalty(stats.logp, micro["ref_logp"], c.kl_estimator),
                                    mask, c.loss_agg, normaliser)
    if c.entropy_coef > 0:
      loss -= c.entropy_coef * aggregate(stats.entropy, mask, c.loss_agg, normaliser)
    valid = mask > 0
    counts = {
        "clipped_low": jnp.sum(terms.clipped_low & valid),
        "clipped_high": jnp.sum(terms.clipped_high & valid),
        "clipped_dual": jnp.sum(terms.clipped_dual & valid),
        "ratio_dev_max": jnp.max(jnp.where(valid, jnp.abs(terms.ratio - 1.0), 0.0)),
    }
    return loss, counts

  def _policy_loss(self, logp, old_logp, micro):
    """``(terms, [..] per-token policy loss)``: the objective's surrogate
    (``rft_jax.rl.objectives``), then the entropy method's loss where it chooses tokens, times
    the rollout correction's importance weights where it has them."""
    c = self.config
    terms = self.objective.per_token_loss(logp, old_logp, micro["advantages"], micro["loss_mask"],
                                          eps_low=c.resolved_eps_low, eps_high=c.resolved_eps_high,
                                          dual_clip=c.dual_clip, sequence_ids=micro.get("segment_ids"))
    policy_loss = terms.loss
    if self.entropy_method.chooses_tokens:
      policy_loss = self.entropy_method.policy_loss(terms.loss, logp, old_logp, micro["advantages"],
                                                    micro["loss_mask"], micro["method_weight"],
                                                    micro["method_penalised"])
    if "rollout_is_weight" in micro:  # rollout correction: verl's pg_losses * rollout_is_weights
      policy_loss = policy_loss * micro["rollout_is_weight"]
    return terms, policy_loss

  def _update_entropy_forecast(self, mini: dict, stats, lr, batch_tokens):
    r"""Corollary 3's first-order change of the batch's mean entropy by one update on a
    mini-batch, from its statistics at the parameters :math:`\theta_u` the update starts from:
    each of its tokens takes the step :math:`\alpha_t = \eta\, g_t` with :math:`g_t = -\partial
    \ell_t / \partial \log p_t` (:math:`r_t A_t` where the clip lets the gradient through, 0 where
    it does not; GSPO's sequence ratio; an entropy method's weights), so the batch's entropy moves
    by :math:`-\eta\, (n_u / N)\, \mathrm{Cov}_u(g, S_* - \mathbb{E}_p[S])` (``n_u`` of the
    batch's ``N`` loss tokens). On-policy and unclipped, :math:`g = A`: Corollary 4."""
    valid = mini["loss_mask"] > 0  # [b, T] rows: one sequence each

    def summed_loss(logp):
      return jnp.sum(jnp.where(valid, self._policy_loss(logp, mini["old_logp"], mini)[1], 0.0))

    step_size = -jax.grad(summed_loss)(stats.logp)
    share = jnp.sum(valid) / jnp.maximum(batch_tokens, 1.0)
    return batch_entropy_change(step_size, stats.centered, valid, lr * share)

  def _micro_loss(self, params, micro, normaliser, first_update, first_position):
    """The micro-batch's loss; aux: its clip counts and (stop-gradient) statistics. A packed
    micro-batch (``micro`` holds ``segment_ids``; ``normaliser`` None) runs its packed rows."""
    if "segment_ids" in micro:
      packed = PackedRows(*(micro[k] for k in PackedRows._fields))
      stats = self._packed_token_stats(params, packed, entropy_grad=self.config.entropy_coef > 0)
    else:
      stats = self._token_stats(params, micro["input_ids"], micro["attention_mask"],
                                entropy_grad=self.config.entropy_coef > 0, first_position=first_position)
    old_logp = jax.lax.stop_gradient(stats.logp) if first_update else micro["old_logp"]
    if "sampler_logp" in micro:  # a shared forward pass: the token weights from its own log-probs
      correction = self.config.rollout_correction
      weight, _ = importance_weights(old_logp - micro["sampler_logp"], micro["loss_mask"] > 0, "token",
                                     correction.importance_weight_cap, correction.importance_weight_floor)
      micro = dict(micro, rollout_is_weight=weight)
    loss, counts = self._loss_terms(stats, micro, normaliser, old_logp)
    return loss, (counts, jax.lax.stop_gradient(stats))

  def _batch_token_choices(self, stats, per_token, response, sampler_logp, step,
                           correction: RolloutCorrection | None = None):
    """The whole batch's entropy-mask and entropy-method choices (``rft_jax.rl.token_methods``)
    from the pre-update statistics; adds the loss mask and the method's arrays to ``per_token``.
    Returns ``(per_token, masked, chosen)``: the two :class:`TokenChoice`.

    With a rollout ``correction``, its rejected tokens leave ``response`` first: the entropy mask's
    batch statistics, the method's choice and the loss normaliser see only the tokens verl would
    keep (verl rejects in the trainer, before the actor's loss); its importance weights go to
    ``per_token["rollout_is_weight"]``."""
    if correction is not None:
      response = response * correction.keep
      if correction.weight is not None:
        per_token = dict(per_token, rollout_is_weight=correction.weight)
    inputs = TokenInputs(stats, sampler_logp, per_token["advantages"], response, response, step)
    masked = self.entropy_mask.choose(inputs)
    per_token = dict(per_token, loss_mask=response * masked.keep)
    chosen = self.entropy_method.choose(inputs._replace(loss_mask=per_token["loss_mask"]))
    if self.entropy_method.chooses_tokens:
      per_token.update(method_weight=chosen.weight, method_penalised=chosen.penalised)
    return per_token, masked, chosen

  def _single_pass_loss(self, params, per_token, response, sampler_logp, first_position, step):
    """The loss of a step that is one update on one micro-batch: the pre-update statistics
    (old log-probs, entropy mask) are the stop-gradient of the same forward pass, so the step
    costs one forward and one backward instead of two forwards and a backward."""
    stats = self._token_stats(params, per_token["input_ids"], per_token["attention_mask"],
                              entropy_grad=self.config.entropy_coef > 0, first_position=first_position)
    fixed = jax.lax.stop_gradient(stats)
    correction = self._rollout_correction(fixed.logp, sampler_logp, response)
    micro, masked, chosen = self._batch_token_choices(fixed, per_token, response, sampler_logp, step, correction)
    normaliser = self._loss_normaliser(micro["loss_mask"], per_token["input_ids"])
    loss, counts = self._loss_terms(stats, micro, normaliser, fixed.logp)
    return loss, (counts, fixed, masked, chosen, micro["loss_mask"], correction)

  def _rollout_correction(self, learner_logp, sampler_logp, response) -> RolloutCorrection | None:
    """``rft_jax.rl.rollout_correction`` of the whole batch's pre-update (stop-gradient) log-probs;
    None when ``learner.rollout_correction`` is off (the step is then the same program)."""
    if not self.config.rollout_correction.enabled:
      return None
    return rollout_correction(jax.lax.stop_gradient(learner_logp), sampler_logp, response,
                              self.config.rollout_correction)

  def _packed_micro_batches(self, mini: dict, token_index, first_position: int, row_stride: int) -> dict:
    """A mini-batch's per-token arrays (``[b, T]``) as packed micro-batches ``[n, r, L]`` by its
    plan ``token_index`` (``[n, r, L]``; ``row_stride``: see ``packed_rows``), with the packed
    rows' fields and ``loss_weight``, the loss normaliser as per-token weights."""
    normaliser = self._loss_normaliser(mini["loss_mask"], mini["input_ids"])
    per_token = dict(mini, loss_weight=aggregation_weights(mini["loss_mask"], self.config.loss_agg, normaliser))
    packed = packed_rows(token_index, mini["input_ids"], mini["attention_mask"], first_position, row_stride)
    micros = {k: gather_tokens(v, packed.stat_index) for k, v in per_token.items()
              if k not in ("input_ids", "attention_mask")}
    micros.update(packed._asdict())
    return {k: self.constrain_micro_batches(v) for k, v in micros.items()}

  def _update(self, state: TrainState, mini: dict, first_update: bool, first_position: int,
              with_stats: bool = False, token_index=None, row_stride: int = 1):
    """One optimizer step on a mini-batch, accumulating over its micro-batches: ``(state, loss,
    grad_norm, counts)``, and with ``with_stats`` the mini-batch's ``[b, T]`` statistics of the
    forward passes the gradients were taken through. ``token_index``: the mini-batch's ``[n, r,
    L]`` part of :meth:`token_plan` (packed micro-batches; ``row_stride``: ``mini_batches``)."""
    if token_index is None:
      n = self._micro_batches(mini["input_ids"].shape[0])
      normaliser = self._loss_normaliser(mini["loss_mask"], mini["input_ids"])
      micros = {k: self.constrain_micro_batches(split_rows(v, n)) for k, v in mini.items()}
    else:
      normaliser = None
      micros = self._packed_micro_batches(mini, token_index, first_position, row_stride)
    grad_fn = self.value_and_grad(self._micro_loss, has_aux=True)

    def accumulate(carry, micro):
      grads, loss, counts = carry
      (micro_loss, (micro_counts, stats)), micro_grads = grad_fn(
          state.params, micro, normaliser, first_update, first_position)
      counts = merge_counts(counts, micro_counts)
      return (jax.tree.map(jnp.add, grads, micro_grads), loss + micro_loss, counts), (stats if with_stats else None)

    zero_counts = {"clipped_low": 0, "clipped_high": 0, "clipped_dual": 0, "ratio_dev_max": 0.0}
    zero_counts = {k: jnp.asarray(v, jnp.float32 if k == "ratio_dev_max" else jnp.int32)
                   for k, v in zero_counts.items()}
    init = (self.zero_grads(state.params), jnp.zeros((), jnp.float32), zero_counts)
    (grads, loss, counts), stats = jax.lax.scan(accumulate, init, micros)
    state, grad_norm = self.apply_gradients(state, grads)
    if with_stats and token_index is not None:
      shape = (mini["input_ids"].shape[0], mini["loss_mask"].shape[1])
      return state, loss, grad_norm, counts, jax.tree.map(
          lambda x: scatter_tokens(x, micros["stat_index"], shape), stats)
    if with_stats:
      return state, loss, grad_norm, counts, jax.tree.map(merge_rows, stats)
    return state, loss, grad_norm, counts

  # ---------------------------------------------------------------------------------------
  # The compiled step.

  def is_single_pass(self, batch_size: int) -> bool:
    """Whether a step on ``batch_size`` rows takes one forward pass (one update, one micro-batch of
    rows; with ``micro_batch_tokens`` never: packed micro-batches share a forward pass only as
    :meth:`shares_forward_pass` says)."""
    c = self.config
    if c.micro_batch_tokens is not None:
      return False
    return c.mini_batches == 1 and c.ppo_epochs == 1 and self._micro_batches(batch_size) == 1

  def shares_forward_pass(self, batch_size: int) -> bool:
    """Whether the step's statistics come from the forward passes of its gradients (no separate
    pre-update pass): one update, and either one micro-batch or nothing chosen over the whole
    batch (no entropy mask, no entropy method, no rollout correction but token importance
    weights), so each micro-batch's loss needs only its own statistics. Otherwise a pre-update
    pass runs first (one more forward of the batch)."""
    c = self.config
    local = not (self.entropy_mask.chooses_tokens or self.entropy_method.chooses_tokens)
    local = local and self.config.rollout_correction.token_local  # rejection changes the normaliser
    return c.mini_batches == 1 and c.ppo_epochs == 1 and (local or self.is_single_pass(batch_size))

  def _reference_logp(self, batch: LearnerBatch, reference, stats_from_column: int,
                      token_index=None) -> jax.Array | None:
    """``[B, L-1-p]`` reference log-probs of the tokens from column ``stats_from_column`` on (see
    :meth:`batch_stats`) when ``kl_coef > 0`` (else None): a no-gradient pass of the reference
    parameters at the sampling temperature, micro-batch by micro-batch like the pre-update pass."""
    if self.config.kl_coef <= 0:
      return None
    return jax.lax.stop_gradient(self.batch_stats(reference, batch, stats_from_column, token_index=token_index).logp)

  def _train_step_fn(self, state: TrainState, batch: LearnerBatch, reference=None,
                     stats_from_column: int = 0, token_index=None):
    """The step; ``stats_from_column`` (static): no column before it holds a completion token
    (:func:`first_response_column`), so per-token arrays start at the position predicting it.
    ``token_index``: the ``[M, n, r, L]`` plan of :meth:`token_plan` (packed micro-batches) or
    None (row micro-batches)."""
    c = self.config
    start = state
    first_position = first_stats_position(stats_from_column)
    targets = slice(first_position + 1, None)  # the token columns the positions predict
    response = batch.response_mask[:, targets].astype(jnp.float32) * batch.attention_mask[:, targets]
    if batch.advantages.ndim == 2:  # per token, aligned with input_ids
      advantages = batch.advantages[:, targets].astype(jnp.float32)
    else:
      advantages = batch.advantages[:, None].astype(jnp.float32) * jnp.ones_like(response)
    per_token = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "advantages": advantages}
    ref_logp = self._reference_logp(batch, reference, stats_from_column, token_index)
    if c.kl_coef > 0:
      per_token["ref_logp"] = ref_logp
    sampler_logp = batch.sampler_logp[:, targets]
    lr = self.schedule(state.step * c.mini_batches * c.ppo_epochs)  # at the first update
    forecasts = []  # Corollary 3's, of each update of a step that takes several

    if self.is_single_pass(batch.input_ids.shape[0]):
      grad_fn = self.value_and_grad(self._single_pass_loss, has_aux=True)
      (loss, (counts, stats, masked, chosen, loss_mask, correction)), grads = grad_fn(
          state.params, per_token, response, sampler_logp, first_position, state.step)
      state, grad_norm = self.apply_gradients(state, grads)
      losses, grad_norms, updates_done = [loss], [grad_norm], 1
    elif self.shares_forward_pass(batch.input_ids.shape[0]):  # every token in the loss
      per_token = dict(per_token, loss_mask=response)
      if c.rollout_correction.importance_sampling is not None:  # token weights, from each micro-batch's forward
        per_token["sampler_logp"] = sampler_logp
      state, loss, grad_norm, counts, stats = self._update(
          state, per_token, True, first_position, with_stats=True,
          token_index=None if token_index is None else token_index[0])
      correction = self._rollout_correction(stats.logp, sampler_logp, response)  # its metrics
      _, masked, chosen = self._batch_token_choices(stats, per_token, response, sampler_logp, state.step)
      loss_mask, losses, grad_norms, updates_done = response, [loss], [grad_norm], 1
    else:
      stats = self.batch_stats(state.params, batch, stats_from_column, token_index=token_index)
      correction = self._rollout_correction(stats.logp, sampler_logp, response)
      per_token, masked, chosen = self._batch_token_choices(stats, per_token, response, sampler_logp, state.step,
                                                            correction)
      loss_mask = per_token["loss_mask"]
      per_token["old_logp"] = stats.logp
      losses, grad_norms = [], []
      counts = None
      updates_done = 0
      batch_tokens = jnp.sum(loss_mask > 0)
      off_policy = c.mini_batches * c.ppo_epochs > 1  # later updates: Corollary 3's forecast
      for _ in range(c.ppo_epochs):
        minis = {k: split_rows(v, c.mini_batches) for k, v in per_token.items()}
        for i in range(c.mini_batches):
          mini = {k: v[i] for k, v in minis.items()}
          state, loss, grad_norm, mini_counts, *mini_stats = self._update(
              state, mini, updates_done == 0, first_position, with_stats=off_policy,
              token_index=None if token_index is None else token_index[i], row_stride=c.mini_batches)
          if off_policy:
            update_lr = self.schedule(start.step * c.mini_batches * c.ppo_epochs + updates_done)
            forecasts.append(self._update_entropy_forecast(mini, mini_stats[0], update_lr, batch_tokens))
          losses.append(loss)
          grad_norms.append(grad_norm)
          counts = mini_counts if counts is None else merge_counts(counts, mini_counts)
          updates_done += 1

    valid = response > 0
    n_loss_tokens = jnp.maximum(jnp.sum(loss_mask) * updates_done, 1.0)
    positive, negative = valid & (advantages > 0), valid & (advantages < 0)
    removed = valid & ~masked.keep
    logp_gap = jnp.abs(sampler_logp - stats.logp)  # the sampler's against the learner's pre-update
    if correction is not None:  # what the entropy mask removed of the tokens the rejection kept
      removed = removed & (correction.keep > 0)
    metrics = {
        "loss": jnp.mean(jnp.stack(losses)),
        "grad_norm": jnp.mean(jnp.stack(grad_norms)),
        "lr": lr,
        "entropy": masked_mean(stats.entropy, valid),
        "s_star_mean": masked_mean(stats.s_star, valid),
        "s_centered_mean": masked_mean(stats.centered, valid),
        "clip_frac_low": counts["clipped_low"] / n_loss_tokens,
        "clip_frac_high": counts["clipped_high"] / n_loss_tokens,
        "clip_frac_dual": counts["clipped_dual"] / n_loss_tokens,
        "ratio_dev_max": counts["ratio_dev_max"],
        "mask_frac": jnp.sum(removed) / jnp.maximum(jnp.sum(valid), 1),
        "mask_frac_positive": jnp.sum(removed & positive) / jnp.maximum(jnp.sum(positive), 1),
        "mask_frac_negative": jnp.sum(removed & negative) / jnp.maximum(jnp.sum(negative), 1),
        "entropy_change_forecast": batch_entropy_change(advantages, stats.centered, loss_mask, lr),
        "logp_mismatch": masked_mean(logp_gap, valid),
        "logp_mismatch_max": jnp.max(jnp.where(valid, logp_gap, 0.0)),
        "response_tokens": jnp.sum(valid),
    }
    if forecasts:  # Corollary 3: every update at its own parameters, ratios and clips
      metrics["entropy_change_forecast_off_policy"] = jnp.sum(jnp.stack(forecasts))
    if self.entropy_method.chooses_tokens:  # the share of loss tokens the method drops or penalises
      touched = self.entropy_method.touched(chosen)
      metrics["method_frac"] = jnp.sum(touched & (loss_mask > 0)) / jnp.maximum(jnp.sum(loss_mask > 0), 1)
    metrics.update(masked.metrics)  # e.g. the cut the entropy target chose, and why
    metrics.update(chosen.metrics)
    if correction is not None:
      metrics.update(correction.metrics)
    if ref_logp is not None:  # measured with the pre-update parameters
      metrics["kl"] = masked_mean(kl_penalty(stats.logp, ref_logp, c.kl_estimator), valid)
    state, metrics["nonfinite_skipped"] = keep_if_finite(state, start, losses + grad_norms)
    return state, metrics, self._row_stats(stats, valid, removed)

  @staticmethod
  def _row_stats(stats, valid, masked) -> dict[str, jax.Array]:
    """``[B]`` per-completion statistics of the pre-update pass (what ``rollouts.jsonl`` logs)."""
    tokens = jnp.maximum(jnp.sum(valid, axis=1), 1)
    return {"entropy_mean": jnp.sum(jnp.where(valid, stats.entropy, 0.0), axis=1) / tokens,
            "s_star_mean": jnp.sum(jnp.where(valid, stats.s_star, 0.0), axis=1) / tokens,
            "masked_tokens": jnp.sum(masked, axis=1)}

  def _mean_entropy_fn(self, params, batch: LearnerBatch, stats_from_column: int = 0, entropy_grad: bool = False,
                       token_index=None):
    stats = self.batch_stats(params, batch, stats_from_column, entropy_grad, token_index)
    targets = slice(first_stats_position(stats_from_column) + 1, None)
    valid = batch.response_mask[:, targets] * batch.attention_mask[:, targets]
    return masked_mean(stats.entropy, valid)

  def _entropy_change_fn(self, before, after, batch: LearnerBatch, stats_from_column: int = 0, token_index=None):
    r"""``(H(after), dH)``: the token-mean entropy of ``batch``'s responses under parameters
    ``after``, and the exact first-order change of the entropy under the update applied,
    :math:`\nabla_\theta H(\theta_0) \cdot (\theta_1 - \theta_0)` (a ``jax.jvp`` at ``before``
    along ``after - before``; same tokens, same temperature).

    Corollary 4 forecasts the change in logit space, as if each token's logits moved by its own
    step; this is what the shared parameters actually do to first order, so the two forecasts'
    ratio measures how much the coupling through the weights changes the paper's picture.
    ``before``: the trainable parameters only (with LoRA the adapters; the frozen base is
    ``after``'s)."""
    tangent = jax.tree.map(lambda a, b: (a - b).astype(b.dtype), self.trainable(after), before)
    _, first_order = jax.jvp(
        lambda t: self._mean_entropy_fn(self.with_trainable(after, t), batch, stats_from_column,
                                        entropy_grad=True, token_index=token_index),
        (before,), (tangent,))
    return self._mean_entropy_fn(after, batch, stats_from_column, token_index=token_index), first_order

  def _compile(self, state: TrainState, batch: LearnerBatch, reference=None):
    """``jax.jit`` of the step with explicit shardings when a mesh is given: the state keeps
    the layout it has (parameters as placed by ``rft_jax.parallel``), the reference keeps its
    own (the parameters'; never donated), batch rows are split over the data axis and metrics
    are replicated. Its fourth argument, ``stats_from_column``, is static; its fifth, the token
    plan (with ``micro_batch_tokens``), has its packed rows over the data axis."""
    if self.mesh is None:
      return jax.jit(self._train_step_fn, donate_argnums=0, static_argnums=3)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    reference_shardings = jax.tree.map(lambda x: x.sharding, reference)
    rows = self.rows_sharding()
    batch_shardings = jax.tree.map(lambda _: rows, batch)
    replicated = NamedSharding(self.mesh, PartitionSpec())
    plan_sharding = self._plan_sharding() if self.config.micro_batch_tokens is not None else None
    return jax.jit(self._train_step_fn, donate_argnums=0, static_argnums=3,
                   in_shardings=(state_shardings, batch_shardings, reference_shardings, plan_sharding),
                   out_shardings=(state_shardings, replicated, replicated))

  def _plan_sharding(self) -> NamedSharding | None:
    """The layout of a ``[M, n, r, L]`` token plan: packed rows ``r`` over the data axis."""
    if self.mesh is None:
      return None
    return NamedSharding(self.mesh, PartitionSpec(None, None, self.data_axis))

  def token_plan(self, batch: LearnerBatch) -> jax.Array | None:
    """The ``[M, n, r, L]`` int32 token plan of ``batch`` (``rft_jax.rl.token_batches.token_plan``,
    made on the host from its attention mask; ``r`` a multiple of the data-parallel devices),
    placed on the mesh; None without ``micro_batch_tokens``."""
    c = self.config
    if c.micro_batch_tokens is None:
      return None
    mask = batch.attention_mask
    mask = host_array(mask) if isinstance(mask, jax.Array) else np.asarray(mask)
    index = token_plan(mask, micro_batch_tokens=c.micro_batch_tokens, mini_batches=c.mini_batches,
                       row_multiple=self._data_devices())
    return jnp.asarray(index) if self.mesh is None else global_array(index, self._plan_sharding())

  def _data_devices(self) -> int:
    return 1 if self.mesh is None else self.mesh.shape[self.data_axis]

  def abstract_token_plan(self, batch: LearnerBatch) -> jax.ShapeDtypeStruct | None:
    """A token plan's shape for ``batch``'s shape, as if every row were full (the most micro-batches
    a step of this shape takes; the memory of the step does not depend on their number)."""
    c = self.config
    if c.micro_batch_tokens is None:
      return None
    rows, width = batch.input_ids.shape
    per_micro = packed_row_count(c.micro_batch_tokens, width, self._data_devices())
    micro_batches = -(-(rows // c.mini_batches) // per_micro)
    return jax.ShapeDtypeStruct((c.mini_batches, micro_batches, per_micro, width), jnp.int32,
                                sharding=self._plan_sharding())

  def _step_reference(self, reference=None, state: TrainState | None = None):
    """The reference parameters a step takes: None unless ``kl_coef > 0``; else ``reference``,
    :attr:`reference`, or (``state`` given) the abstract one of :meth:`abstract_reference`."""
    if self.config.kl_coef <= 0:
      return None
    if reference is None:
      reference = self.reference
    if reference is None and state is not None:
      reference = self.abstract_reference(state.params)
    if reference is None:
      raise ValueError("learner.kl_coef > 0 needs reference log-probs: call Learner.init (it copies "
                       "the starting parameters, or the constructor's reference)")
    return reference

  def lower_step(self, state: TrainState, batch: LearnerBatch, reference=None,
                 stats_from_column: int = 0) -> jax.stages.Lowered:
    """The step lowered for ``state`` and ``batch`` (arrays or ``jax.ShapeDtypeStruct`` with
    shardings, e.g. :meth:`abstract_state`): ``.compile().memory_analysis()`` gives its bytes
    per device (``rft-jax plan``). With ``kl_coef > 0`` the step also
    takes the reference parameters: ``reference``, else :attr:`reference`, else
    :meth:`abstract_reference` of ``state.params``; they count in the argument bytes.
    ``stats_from_column``: the batch's :func:`first_response_column` (0, the default, gives the
    statistics of every position: an upper bound on the step's memory)."""
    reference = self._step_reference(reference, state)
    return self._compile(state, batch, reference).lower(state, batch, reference, stats_from_column,
                                                        self.abstract_token_plan(batch))

  def place_batch(self, batch: LearnerBatch) -> LearnerBatch:
    """``batch`` as global arrays with rows over the data axis (:meth:`place_rows`)."""
    return self.place_rows(batch)

  def step(self, state: TrainState, batch: LearnerBatch, *, rows: bool = False):
    """One train step: ``(state, metrics)``, and with ``rows`` a third element, ``[B]`` numpy arrays
    per completion (``entropy_mean``, ``s_star_mean`` over its tokens, ``masked_tokens``: how many
    the entropy mask removed). ``state`` is donated: use the returned state afterwards.

    A step whose loss, gradient norm or updated parameters are not finite returns ``state``'s
    values unchanged, step counter included, with ``metrics["nonfinite_skipped"] == 1.0``.
    ``batch`` is placed with :meth:`place_batch`; its :func:`first_response_column` (read on the
    host) is where the step's statistics start (one compiled program per value). Every
    ``forecast_every`` steps the entropy of the updated policy on the same batch is measured
    (``entropy_change_measured``) next to two first-order forecasts: Corollary 4's
    (``entropy_change_forecast``, every step) and the exact one of the update applied
    (``entropy_change_first_order``, :meth:`_entropy_change_fn`); those steps keep a copy of the
    parameters beside the step and run one more forward pass with tangents. The metrics are
    read back on every process.
    """
    every = self.config.forecast_every
    measure = every > 0 and int(host_array(state.step)) % every == 0
    column = first_response_column(batch.response_mask)
    token_index = self.token_plan(batch)
    batch = self.place_batch(batch)
    reference = self._step_reference()
    if self._train_step is None:
      self._train_step = self._compile(state, batch, reference)
    before = jax.tree.map(jnp.copy, self.trainable(state.params)) if measure else None  # donated
    new_state, metrics, row_stats = self._train_step(state, batch, reference, column, token_index)
    metrics = {k: float(host_array(v)) for k, v in metrics.items()}
    if measure:
      after, first_order = self._entropy_change(before, new_state.params, batch, column, token_index)
      metrics["entropy_change_measured"] = float(host_array(after)) - metrics["entropy"]
      metrics["entropy_change_first_order"] = float(host_array(first_order))
    if rows:
      return new_state, metrics, {k: np.asarray(host_array(v)) for k, v in row_stats.items()}
    return new_state, metrics

  def mean_entropy(self, state: TrainState, batch: LearnerBatch) -> float:
    """Token-mean entropy of the policy on ``batch``'s response tokens."""
    column = first_response_column(batch.response_mask)
    token_index = self.token_plan(batch)
    return float(host_array(self._mean_entropy(state.params, self.place_batch(batch), column,
                                               token_index=token_index)))
