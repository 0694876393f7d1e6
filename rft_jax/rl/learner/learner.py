"""The :class:`Learner`: the GRPO train step (see the package's docstring for what a step does),
composed of its step plan (``plan.py``), metrics (``metrics.py``) and placement (``placement.py``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rft_jax.entropy import masked_mean
from rft_jax.parallel import host_array
from rft_jax.rl import reference as ref_lib
from rft_jax.rl.batching import first_response_column, first_stats_position, merge_counts, merge_rows, split_rows
from rft_jax.rl.config import LearnerConfig
from rft_jax.rl.learner import metrics as metrics_lib
from rft_jax.rl.learner import placement
from rft_jax.rl.learner import plan
from rft_jax.rl.learner import routing
from rft_jax.rl.learner.batch import LearnerBatch, response_tokens, step_tokens
from rft_jax.rl.learner.forward import ForwardPasses
from rft_jax.rl.model_trainer import ModelTrainer, TrainState
from rft_jax.rl.nonfinite import keep_if_finite
from rft_jax.rl.rollout_correction import importance_weights
from rft_jax.rl.token_batches import PackedRows, scatter_tokens


class Learner(ForwardPasses, ModelTrainer):
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
    self.plan = plan.StepPlan(config)  # what the step computes: micro-batches, token choices, loss
    self.entropy_mask = self.plan.entropy_mask  # Clip_B, Clip_V, ...
    self.entropy_method = self.plan.entropy_method  # Clip-Cov, KL-Cov, ...
    self.objective = self.plan.objective  # PPO's or GSPO's surrogate
    self.router = routing.router_terms(model, config)  # an MoE policy's router terms, else None
    self._reference_source = reference
    self.reference = None  # frozen reference parameters, set by init() when kl_coef > 0
    self._train_step = None  # compiled on the first step, with the state's shardings
    self._mean_entropy = jax.jit(self._mean_entropy_fn, static_argnums=2)
    self._entropy_change = jax.jit(self._entropy_change_fn, static_argnums=3)

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

  def _micro_loss(self, params, micro, normaliser, first_update, first_position, router_scale=1.0):
    """The micro-batch's loss; aux: its clip and router counts and (stop-gradient) statistics. A
    packed micro-batch (``micro`` holds ``segment_ids``; ``normaliser`` None) runs its packed rows.
    ``router_scale``: the router terms' weight (1 / the mini-batch's micro-batches)."""
    routed = routing.routed_inputs(micro)
    if "segment_ids" in micro:
      packed = PackedRows(*(micro[k] for k in PackedRows._fields))
      stats, router = self._packed_token_stats(params, packed, self.config.entropy_coef > 0, routed)
    else:
      stats, router = self._token_stats(params, micro["input_ids"], micro["attention_mask"],
                                        entropy_grad=self.config.entropy_coef > 0, first_position=first_position,
                                        routed=routed)
    old_logp = jax.lax.stop_gradient(stats.logp) if first_update else micro["old_logp"]
    if "sampler_logp" in micro:  # a shared forward pass: the token weights from its own log-probs
      correction = self.config.rollout_correction
      weight, _ = importance_weights(old_logp - micro["sampler_logp"], micro["loss_mask"] > 0, "token",
                                     correction.importance_weight_cap, correction.importance_weight_floor)
      micro = dict(micro, rollout_is_weight=weight)
    loss, counts = self.plan.loss_terms(stats, micro, normaliser, old_logp)
    loss, counts = routing.with_router_terms(self.router, loss, counts, router, router_scale)
    return loss, (counts, jax.lax.stop_gradient(stats))

  def _single_pass_loss(self, params, per_token, response, sampler_logp, first_position, step):
    """The loss of a step that is one update on one micro-batch: the pre-update statistics
    (old log-probs, entropy mask) are the stop-gradient of the same forward pass, so the step
    costs one forward and one backward instead of two forwards and a backward."""
    stats, router = self._token_stats(params, per_token["input_ids"], per_token["attention_mask"],
                                      entropy_grad=self.config.entropy_coef > 0, first_position=first_position,
                                      routed=routing.routed_inputs(per_token))
    fixed = jax.lax.stop_gradient(stats)
    correction = self.plan.rollout_correction(fixed.logp, sampler_logp, response)
    micro, masked, chosen = self.plan.token_choices(fixed, per_token, response, sampler_logp, step, correction)
    normaliser = self.plan.loss_normaliser(micro["loss_mask"], per_token["input_ids"])
    loss, counts = self.plan.loss_terms(stats, micro, normaliser, fixed.logp)
    loss, counts = routing.with_router_terms(self.router, loss, counts, router)
    return loss, (counts, fixed, masked, chosen, micro["loss_mask"], correction)

  def _update(self, state: TrainState, mini: dict, first_update: bool, first_position: int,
              with_stats: bool = False, token_index=None, row_stride: int = 1):
    """One optimizer step on a mini-batch, accumulating over its micro-batches: ``(state, loss,
    grad_norm, counts)``, and with ``with_stats`` the mini-batch's ``[b, T]`` statistics of the
    forward passes the gradients were taken through. ``token_index``: the mini-batch's ``[n, r,
    L]`` part of :meth:`token_plan` (packed micro-batches; ``row_stride``: ``mini_batches``)."""
    if token_index is None:
      n = self.plan.micro_batches(mini["input_ids"].shape[0])
      normaliser = self.plan.loss_normaliser(mini["loss_mask"], mini["input_ids"])
      micros = {k: self.constrain_micro_batches(split_rows(v, n)) for k, v in mini.items()}
    else:
      normaliser = None
      micros = plan.packed_micro_batches(self.config, mini, token_index, first_position, row_stride,
                                         self.constrain_micro_batches)
    grad_fn = self.value_and_grad(self._micro_loss, has_aux=True)
    router_scale = 1.0 / micros["input_ids"].shape[0]  # the router terms: the mean over micro-batches

    def accumulate(carry, micro):
      grads, loss, counts = carry
      (micro_loss, (micro_counts, stats)), micro_grads = grad_fn(
          state.params, micro, normaliser, first_update, first_position, router_scale)
      counts = merge_counts(counts, micro_counts)
      return (self.add_grads(grads, micro_grads), loss + micro_loss, counts), (stats if with_stats else None)

    init = (self.zero_grads(state.params), jnp.zeros((), jnp.float32),
            routing.zero_counts(self.router, plan.zero_counts(), compared="expert_ids" in mini))
    (grads, loss, counts), stats = jax.lax.scan(accumulate, init, micros)
    state, grad_norm = self.apply_gradients(state, grads)
    if with_stats and token_index is not None:
      shape = (mini["input_ids"].shape[0], mini["loss_mask"].shape[1])
      return state, loss, grad_norm, counts, jax.tree.map(
          lambda x: scatter_tokens(x, micros["stat_index"], shape), stats)
    if with_stats:
      return state, loss, grad_norm, counts, jax.tree.map(merge_rows, stats)
    return state, loss, grad_norm, counts

  def is_single_pass(self, batch_size: int) -> bool:
    """Whether a step on ``batch_size`` rows takes one forward pass (one update, one micro-batch of
    rows; with ``micro_batch_tokens`` never: packed micro-batches share a forward pass only as
    :meth:`shares_forward_pass` says)."""
    return self.plan.is_single_pass(batch_size)

  def shares_forward_pass(self, batch_size: int) -> bool:
    """Whether the step's statistics come from the forward passes of its gradients (no separate
    pre-update pass): one update, and either one micro-batch or nothing chosen over the whole
    batch (no entropy mask, no entropy method, no rollout correction but token importance
    weights), so each micro-batch's loss needs only its own statistics. Otherwise a pre-update
    pass runs first (one more forward of the batch)."""
    return self.plan.shares_forward_pass(batch_size)

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
    response, advantages, sampler_logp = step_tokens(batch, first_position)
    per_token = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "advantages": advantages,
                 **routing.routed_inputs(batch)}
    ref_logp = self._reference_logp(batch, reference, stats_from_column, token_index)
    if c.kl_coef > 0:
      per_token["ref_logp"] = ref_logp
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
      correction = self.plan.rollout_correction(stats.logp, sampler_logp, response)  # its metrics
      _, masked, chosen = self.plan.token_choices(stats, per_token, response, sampler_logp, state.step)
      loss_mask, losses, grad_norms, updates_done = response, [loss], [grad_norm], 1
    else:
      stats, pre_update_router = self.batch_stats_and_router(state.params, batch, stats_from_column,
                                                             token_index=token_index)
      correction = self.plan.rollout_correction(stats.logp, sampler_logp, response)
      per_token, masked, chosen = self.plan.token_choices(stats, per_token, response, sampler_logp, state.step,
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
            forecasts.append(metrics_lib.update_entropy_forecast(self.plan.policy_loss, mini, mini_stats[0],
                                                                 update_lr, batch_tokens))
          losses.append(loss)
          grad_norms.append(grad_norm)
          counts = mini_counts if counts is None else merge_counts(counts, mini_counts)
          updates_done += 1
      counts = {**counts, **pre_update_router}  # the router's metrics: of the pre-update pass

    metrics, removed = metrics_lib.step_metrics(
        config=c, entropy_method=self.entropy_method, stats=stats, advantages=advantages, response=response,
        sampler_logp=sampler_logp, loss_mask=loss_mask, masked=masked, chosen=chosen, correction=correction,
        counts=counts, losses=losses, grad_norms=grad_norms, updates_done=updates_done, lr=lr, forecasts=forecasts,
        ref_logp=ref_logp)
    state, metrics["nonfinite_skipped"] = keep_if_finite(state, start, losses + grad_norms)
    return state, metrics, metrics_lib.row_stats(stats, response > 0, removed)

  def _mean_entropy_fn(self, params, batch: LearnerBatch, stats_from_column: int = 0, entropy_grad: bool = False,
                       token_index=None):
    stats = self.batch_stats(params, batch, stats_from_column, entropy_grad, token_index)
    return masked_mean(stats.entropy, response_tokens(batch, first_stats_position(stats_from_column)))

  def _entropy_change_fn(self, before, after, batch: LearnerBatch, stats_from_column: int = 0, token_index=None):
    """``(H(after), dH)`` on ``batch``: ``metrics.entropy_change`` (``before``: the trainable
    parameters only)."""
    mean_entropy = lambda params, grad: self._mean_entropy_fn(params, batch, stats_from_column, entropy_grad=grad,
                                                              token_index=token_index)
    return metrics_lib.entropy_change(mean_entropy, self.trainable, self.with_trainable, before, after)

  def _compile(self, state: TrainState, batch: LearnerBatch, reference=None):
    """``placement.compile_step`` of the step: batch rows over the data axis, the token plan
    (with ``micro_batch_tokens``) with its packed rows over it."""
    tokens = self.config.micro_batch_tokens is not None
    plan_sharding = placement.plan_sharding(self.mesh, self.data_axis) if tokens else None
    rows = None if self.mesh is None else self.rows_sharding()
    return placement.compile_step(self._train_step_fn, self.mesh, state, batch, reference, rows, plan_sharding)

  def token_plan(self, batch: LearnerBatch) -> jax.Array | None:
    """The ``[M, n, r, L]`` int32 token plan of ``batch``, placed on the mesh
    (``placement.token_plan``); None without ``micro_batch_tokens``."""
    return placement.token_plan(self.config, batch.attention_mask, self.mesh, self.data_axis)

  def abstract_token_plan(self, batch: LearnerBatch) -> jax.ShapeDtypeStruct | None:
    """A token plan's shape for ``batch``'s shape, as if every row were full (the most micro-batches
    a step of this shape takes; the memory of the step does not depend on their number)."""
    if self.config.micro_batch_tokens is None:
      return None
    shape = plan.token_plan_shape(self.config, *batch.input_ids.shape,
                                  placement.data_devices(self.mesh, self.data_axis))
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=placement.plan_sharding(self.mesh, self.data_axis))

  def _step_reference(self, reference=None, state: TrainState | None = None):
    """The reference parameters a step takes: None unless ``kl_coef > 0``; else ``reference``,
    :attr:`reference`, or (``state`` given) the abstract one of :meth:`abstract_reference`."""
    abstract = None if state is None else lambda: self.abstract_reference(state.params)
    return placement.step_reference(self.config.kl_coef, reference, self.reference, abstract)

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
    the entropy mask removed) and ``token_entropy``, ``[B, L]``: the entropy of the prediction of
    each completion token, aligned with ``batch.input_ids`` (0 off the response). ``state`` is donated: use the returned state afterwards.

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
    routing.check_batch(self.config, batch)
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
      row_stats = {k: np.asarray(host_array(v)) for k, v in row_stats.items()}
      entropy = row_stats["token_entropy"]  # [B, L - 1 - p]: position t predicts column t + 1 + p
      row_stats["token_entropy"] = np.zeros(batch.input_ids.shape, np.float32)
      row_stats["token_entropy"][:, batch.input_ids.shape[1] - entropy.shape[1]:] = entropy
      return new_state, metrics, row_stats
    return new_state, metrics

  def mean_entropy(self, state: TrainState, batch: LearnerBatch) -> float:
    """Token-mean entropy of the policy on ``batch``'s response tokens."""
    column = first_response_column(batch.response_mask)
    token_index = self.token_plan(batch)
    return float(host_array(self._mean_entropy(state.params, self.place_batch(batch), column,
                                               token_index=token_index)))
