r"""The learner's router terms and routing metrics on mixture-of-experts models.

An MoE policy's forward also returns its routers' view (:class:`~rft_jax.models.moe.Routing`,
``router_logits [L, b, T, E]``). From it each forward pass of the learner computes
(:meth:`RouterTerms.counts`), over the pass's real tokens (``attention_mask``, or a packed
row's ``segment_ids > 0``):

* the load-balancing loss as transformers' ``load_balancing_loss_func`` computes it
  (:func:`~rft_jax.models.moe.load_balancing_loss`: the live top-k of every layer), and the
  router z-loss (:func:`~rft_jax.models.moe.router_z_loss`); the learner adds
  :math:`c_\mathrm{aux} \mathcal{L}_\mathrm{aux} + c_z \mathcal{L}_z` to each micro-batch's
  loss, divided by the mini-batch's micro-batch count (the mean over micro-batches, as a
  gradient-accumulating trainer of transformers does);
* the expert load: ``[L, E]`` how many real tokens each layer's top-k sends to each expert;
* with the sampler's expert ids (``LearnerBatch.expert_ids``), the routing mismatch: of the
  completion tokens the sampler fed to its decoder (all but each completion's last), how many
  the learner's live top-k sends to another set of experts than the sampler's, in any layer,
  and how many (token, layer) pairs differ. Measured with routing replay on or off (with replay
  the learner's forward uses the sampler's ids; its own top-k is still read off the logits).

Every count is a sum (:func:`rft_jax.rl.batching.merge_counts` adds them over micro-batches);
:func:`router_metrics` turns them into the step's ``router/*`` metrics.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rft_jax.models.moe import Routing, load_balancing_loss, router_z_loss


@dataclasses.dataclass(frozen=True)
class RouterTerms:
  """The router terms of one MoE policy and learner config.

  Attributes:
    layers: L; experts: E; k: experts per token (the model's config).
    aux_coef: the load-balancing loss's weight (``learner.router_aux_loss_coef``, else the
      model config's ``router_aux_loss_coef``; 0: logged, not trained).
    z_coef: the router z-loss's weight (``learner.router_z_loss_coef``; 0: logged, not trained).
    replay: route the learner's forwards by the sampler's expert ids (``learner.routing_replay``).
  """

  layers: int
  experts: int
  k: int
  aux_coef: float
  z_coef: float
  replay: bool

  def zero_counts(self, compared: bool) -> dict[str, jax.Array]:
    """:meth:`counts` before the first micro-batch (``compared``: the batch has sampler ids)."""
    zeros = {"router_lb": jnp.zeros((), jnp.float32), "router_z": jnp.zeros((), jnp.float32),
             "router_forwards": jnp.zeros((), jnp.float32),
             "expert_load": jnp.zeros((self.layers, self.experts), jnp.float32)}
    if compared:
      zeros.update({k: jnp.zeros((), jnp.int32) for k in _MISMATCH_KEYS})
    return zeros

  def counts(self, routing: Routing, token_mask, sampler_ids=None, compared=None) -> dict[str, jax.Array]:
    """The forward's router counts (see the module's docstring).

    Args:
      routing: the forward's :class:`~rft_jax.models.moe.Routing` (``[L, b, T, ...]``).
      token_mask: ``[b, T]`` the real tokens.
      sampler_ids: ``[b, T, L, k]`` the sampler's expert ids (None: no mismatch counts).
      compared: ``[b, T]`` the tokens whose sampler ids count in the mismatch.

    Returns:
      ``router_lb`` and ``router_z`` (differentiable: the loss terms), ``router_forwards`` (1),
      ``expert_load [L, E]``, and with ``sampler_ids`` the ``routing_*`` mismatch counts.
    """
    mask = token_mask.astype(jnp.float32)
    live = live_expert_ids(routing.router_logits, self.k)  # [L, b, T, k]
    load = jnp.zeros((self.layers, self.experts), jnp.float32).at[
        jnp.arange(self.layers)[:, None, None, None], live].add(
            jnp.broadcast_to(mask[None, :, :, None], live.shape))
    counts = {"router_lb": load_balancing_loss(routing.router_logits, self.k, token_mask),
              "router_z": router_z_loss(routing.router_logits, token_mask),
              "router_forwards": jnp.ones((), jnp.float32),
              "expert_load": load}
    if sampler_ids is not None:
      sampler = jnp.moveaxis(sampler_ids.astype(jnp.int32), (2, 3), (0, 3))  # [L, b, T, k]
      differs = jnp.any(jnp.sort(live, axis=-1) != jnp.sort(sampler, axis=-1), axis=-1)  # [L, b, T]
      compared = compared > 0
      counts.update(routing_mismatched=jnp.sum(jnp.any(differs, axis=0) & compared),
                    routing_mismatched_layers=jnp.sum(differs & compared[None]),
                    routing_compared=jnp.sum(compared))
    return counts

  def loss(self, counts: dict[str, jax.Array], scale) -> jax.Array:
    r""":math:`(c_\mathrm{aux} \mathcal{L}_\mathrm{aux} + c_z \mathcal{L}_z) \cdot` ``scale`` (0
    when both weights are 0: nothing is differentiated)."""
    loss = jnp.zeros((), jnp.float32)
    if self.aux_coef > 0:
      loss += self.aux_coef * scale * counts["router_lb"]
    if self.z_coef > 0:
      loss += self.z_coef * scale * counts["router_z"]
    return loss

  def replay_ids(self, sampler_ids):
    """The ``expert_ids [L, b, T, k]`` int32 the model routes by: the sampler's with replay on,
    else None (its own top-k)."""
    if not self.replay or sampler_ids is None:
      return None
    return jnp.moveaxis(sampler_ids.astype(jnp.int32), (2, 3), (0, 3))


_MISMATCH_KEYS = ("routing_mismatched", "routing_mismatched_layers", "routing_compared")


def live_expert_ids(router_logits, k: int):
  r"""``[..., k]`` int32: the top-k of :math:`\mathrm{softmax}(\ell)` (float32), as the MoE block
  chooses them without replay (:func:`~rft_jax.models.moe.route`)."""
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  return jax.lax.top_k(probs, k)[1].astype(jnp.int32)


def fed_completion_tokens(response_mask):
  """``[B, L]`` the completion tokens a sampler fed to its decoder, so recorded the experts of:
  those followed by another completion token (a completion's last token is sampled, never fed)."""
  response = response_mask > 0
  following = jnp.concatenate([response[:, 1:], jnp.zeros_like(response[:, :1])], axis=1)
  return (response & following).astype(jnp.int32)


def router_metrics(counts: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The step's ``router/*`` metrics from summed :meth:`RouterTerms.counts` (empty without them).

  ``router/load_balancing_loss`` and ``router/z_loss``: the mean over the forward passes counted;
  ``router/expert_load_max``: the most of the batch's real tokens one expert of one layer got
  (the counts are of one pass over the batch); ``router/expert_load_mean``: the mean tokens per
  expert (``k`` times the real tokens over ``E``); ``router/expert_load_imbalance``: their ratio (1: balanced); ``router/routing_mismatch``:
  the share of the compared completion tokens whose top-k set differs from the sampler's in
  some layer, ``router/routing_mismatch_layers`` of the (token, layer) pairs.
  """
  if "router_lb" not in counts:
    return {}
  forwards = jnp.maximum(counts["router_forwards"], 1.0)
  load = counts["expert_load"]  # [L, E]
  load_max, load_mean = jnp.max(load), jnp.mean(load)
  metrics = {"router/load_balancing_loss": counts["router_lb"] / forwards,
             "router/z_loss": counts["router_z"] / forwards,
             "router/expert_load_max": load_max,
             "router/expert_load_mean": load_mean,
             "router/expert_load_imbalance": load_max / jnp.maximum(load_mean, 1e-9)}
  if "routing_compared" in counts:
    compared = jnp.maximum(counts["routing_compared"], 1)
    layers = counts["expert_load"].shape[0]
    metrics["router/routing_mismatch"] = counts["routing_mismatched"] / compared
    metrics["router/routing_mismatch_layers"] = counts["routing_mismatched_layers"] / (compared * layers)
  return metrics


def router_terms(model, config) -> RouterTerms | None:
  """The :class:`RouterTerms` of ``model`` (a policy) under the learner ``config``; None for a
  dense model, which ``learner.routing_replay`` is refused on (a ``ValueError`` naming it)."""
  model_config = getattr(model, "config", None)
  if model_config is None or not getattr(model_config, "is_moe", False):
    if config.routing_replay:
      raise ValueError(f"learner.routing_replay=true needs a mixture-of-experts model; model_type "
                       f"{getattr(model_config, 'model_type', None)!r} has no experts")
    return None
  aux = model_config.router_aux_loss_coef if config.router_aux_loss_coef is None else config.router_aux_loss_coef
  return RouterTerms(layers=model_config.num_hidden_layers, experts=model_config.num_experts,
                     k=model_config.num_experts_per_tok, aux_coef=float(aux),
                     z_coef=float(config.router_z_loss_coef), replay=config.routing_replay)


def routed_inputs(source) -> dict[str, jax.Array]:
  """The sampler's routing a forward reads, from a ``LearnerBatch`` or a (micro-)batch dict:
  ``expert_ids [b, T, L, k]`` and ``routed [b, T]`` (:func:`fed_completion_tokens`, the tokens
  the mismatch compares); ``{}`` when the batch has none."""
  if isinstance(source, dict):
    return {k: source[k] for k in ("expert_ids", "routed") if k in source}
  if getattr(source, "expert_ids", None) is None:
    return {}
  return {"expert_ids": source.expert_ids,
          "routed": fed_completion_tokens(source.response_mask * source.attention_mask)}


def forward(model, router: RouterTerms | None, routed: dict | None, token_mask, *args, **kwargs):
  """``(hidden, counts)``: ``model(*args, return_hidden=True, **kwargs)`` and, on an MoE policy,
  its router counts (:meth:`RouterTerms.counts` over ``token_mask``, the forward routed by the
  sampler's ids with replay on); ``{}`` and the very same call on a dense one."""
  if router is None:
    return model(*args, return_hidden=True, **kwargs), {}
  routed = routed or {}
  sampler_ids = routed.get("expert_ids")
  hidden, routing = model(*args, return_hidden=True, return_routing=True,
                          expert_ids=router.replay_ids(sampler_ids), **kwargs)
  return hidden, router.counts(routing, token_mask, sampler_ids, routed.get("routed"))


def summed(counts: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Router counts of stacked micro-batches (``[n, ...]``) summed over them."""
  return {k: jnp.sum(v, axis=0) for k, v in counts.items()}


def with_router_terms(router: RouterTerms | None, loss, counts: dict, router_counts: dict, scale=1.0):
  """``(loss + router terms, counts with the router's)`` of a micro-batch (unchanged when dense);
  the counts leave the gradient."""
  if router is None:
    return loss, counts
  return loss + router.loss(router_counts, scale), {**counts, **jax.lax.stop_gradient(router_counts)}


def zero_counts(router: RouterTerms | None, counts: dict, compared: bool) -> dict:
  """An update's counts before its first micro-batch: ``counts`` and, on an MoE policy, the
  router's (``compared``: the batch carries the sampler's expert ids)."""
  return counts if router is None else {**counts, **router.zero_counts(compared)}


def check_batch(config, batch) -> None:
  """Refuses a batch without the sampler's expert ids when ``learner.routing_replay`` is on."""
  if config.routing_replay and getattr(batch, "expert_ids", None) is None:
    raise ValueError("learner.routing_replay=true: the batch has no expert_ids (the sampler's recorded "
                     "routing, LearnerBatch.expert_ids)")
