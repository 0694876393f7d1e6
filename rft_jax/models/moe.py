r"""The sparse mixture-of-experts feed-forward block of Qwen2-MoE / Qwen3-MoE, dropless.

Each token ``x`` goes to the ``k`` experts of highest router probability
:math:`p = \mathrm{softmax}(x W_r)` (float32), and the block returns

.. math:: y = \sum_{j=1}^{k} w_j\, E_{e_j}(x), \qquad
   E_e(x) = W^{e}_d\,(\mathrm{silu}(x W^{e}_g) \odot x W^{e}_u),

with :math:`w_j = p_{e_j}` or, with ``norm_topk_prob``, :math:`p_{e_j} / \sum_i p_{e_i}` (as
transformers' ``Qwen2MoeTopKRouter``). Qwen2-MoE adds a shared expert behind a sigmoid gate,
:math:`\sigma(x w_s) \cdot \mathrm{MLP}_s(x)`.

Dropless: every (token, expert) assignment is computed, none is dropped for capacity. The
``N k`` assignments are sorted by expert, the products run grouped with
:func:`jax.lax.ragged_dot` over the stacked expert weights (``[E, D, I]``, ``[E, I, D]``), and
the results go back to token order and are summed with their weights.

Routing replay: :func:`route` (and the block) take the expert ids from outside (``[..., k]``,
e.g. those the sampler chose) instead of the top-k; the weights are still the live router's
probabilities at those ids, so the router keeps its gradient. The block returns a
:class:`Routing` (router logits and the ids used) for the load-balancing loss
(:func:`load_balancing_loss`, as transformers computes it), the z-loss (:func:`router_z_loss`)
and routing metrics.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.custom_batching
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from rft_jax.models.layers import MLP, normal_init, param
from rft_jax.models.lora import ROUTER, expert_adapters, merge_adapter, projection_adapter
from rft_jax.models.expert_gmm import gmm_experts
from rft_jax.models.expert_parallel import expert_parallel, is_expert_parallel
from rft_jax.models.expert_tiles import in_assignment_order, sort_assignments, tiled_experts
from rft_jax.parallel.mesh import platform_of


@flax.struct.dataclass
class Routing:
  """What the routers of one or more MoE layers saw and chose.

  Attributes:
    router_logits: ``[..., E]`` float32, :math:`x W_r` of every token (padding included).
    expert_ids: ``[..., k]`` int32, the experts each token went to (the top-k, or the ids
      given for replay), in the router's order (highest probability first).
  """

  router_logits: Float[Array, "... E"]
  expert_ids: Int[Array, "... k"]


def route(router_logits: Float[Array, "N E"], k: int, norm_topk_prob: bool,
          expert_ids: Int[Array, "N k"] | None = None
          ) -> tuple[Float[Array, "N k"], Int[Array, "N k"]]:
  r"""The routing weights and expert ids of each token.

  :math:`p = \mathrm{softmax}(\ell)` in float32; ids the top-k of :math:`p` (ties to the lower
  id) unless given; weights :math:`p` at the ids, renormalised to sum to 1 with
  ``norm_topk_prob``. Differentiable in ``router_logits`` either way.

  Returns:
    ``(weights [N, k] float32, expert_ids [N, k] int32)``.
  """
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  if expert_ids is None:
    weights, expert_ids = jax.lax.top_k(probs, k)
  else:
    expert_ids = expert_ids.astype(jnp.int32)
    weights = jnp.take_along_axis(probs, expert_ids, axis=-1)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, expert_ids.astype(jnp.int32)


def grouped_experts(x: Float[Array, "N D"], expert_ids: Int[Array, "N k"],
                    weights: Float[Array, "N k"], gate: Float[Array, "E D I"],
                    up: Float[Array, "E D I"], down: Float[Array, "E I D"], *,
                    vmappable: bool = False, mesh: Mesh | None = None) -> Float[Array, "N D"]:
  r""":math:`\sum_j w_j E_{e_j}(x)` for every token, dropless, with grouped products.

  The ``N k`` assignments are sorted by expert (stable), each expert's rows multiplied by its
  weights in one :func:`jax.lax.ragged_dot` per projection, and the outputs put back in token
  order and summed with ``weights``. Products in ``x.dtype`` (the weights are cast to it).

  ``vmappable``: the form the cache paths run. ``jax.vmap`` of ``ragged_dot`` with unbatched
  weights is not implemented (jax 0.10), and the paged sampler vmaps its decode step over the
  data shards; this form's batching rule runs the tokens of every batch entry as one call
  (tokens are independent). It has no derivative (``custom_vmap``): the full forward, which the
  learner differentiates, runs the plain form.

  The product: :func:`expert_product` of ``mesh``'s platform (None: the default backend's; the
  cache form always the default backend's). On a mesh whose ``model`` axis divides the experts,
  each of its devices runs the product on its own experts (:func:`rft_jax.models.
  expert_parallel.expert_parallel`).
  """
  if vmappable:
    return _vmappable_grouped_experts(x, expert_ids, weights, gate, up, down)
  product = differentiable_product(platform_of(mesh))
  if is_expert_parallel(mesh, gate.shape[0]):
    return expert_parallel(product, x, expert_ids, weights, gate, up, down, mesh=mesh)
  return product(x, expert_ids, weights, gate, up, down)


def differentiable_product(platform: str):
  """The full forward's expert product on ``platform`` (:func:`expert_product`, differentiable),
  as a function of ``(x, expert_ids, weights, gate, up, down)``."""
  if expert_product(platform, differentiable=True) == "tiled":
    return functools.partial(tiled_experts, differentiable=True)
  return gmm_experts


def expert_product(platform: str, differentiable: bool) -> str:
  """The expert product that does the least work on ``platform`` (``cpu``, ``gpu``, ``tpu``).

  * ``ragged`` (:func:`jax.lax.ragged_dot`): on TPUs where nothing is differentiated (their
    compiler has a grouped forward product: the FLOPs of ``N k`` rows).
  * ``gmm`` (:func:`rft_jax.models.expert_gmm.gmm_experts`, megablox's Pallas kernels): on TPUs
    where a derivative is taken, since the TPU compiler's derivative of ``ragged_dot`` with
    respect to the weights runs over all ``E`` experts.
  * ``tiled`` (:func:`rft_jax.models.expert_tiles.tiled_experts`): on CPUs and GPUs: XLA's CPU
    and GPU backends expand ``ragged_dot`` over all ``E`` experts (on a GPU a ``[N k, E D]``
    copy of the rows: 32 GiB a layer at 8 x 8,192 assignments of Qwen3-30B-A3B), where the
    tiles compute ``N k`` rows plus at most one part-filled tile per expert. ``differentiable``
    picks its form (the map over every possible tile, or the loop over those that exist).

  The cache paths (no derivative) run on the default backend's product (they see no mesh:
  a plan compiled deviceless on a CPU host runs the tiles there), in chunks of
  :data:`CACHE_PATH_ASSIGNMENTS` assignments.
  """
  if platform == "tpu":
    return "gmm" if differentiable else "ragged"
  return "tiled"


def _grouped_experts(x, expert_ids, weights, gate, up, down):
  n, k = expert_ids.shape
  order, rows, sizes = sort_assignments(x, expert_ids, gate.shape[0])  # rows [N k, D] by expert
  dtype = x.dtype
  g = jax.lax.ragged_dot(rows, gate.astype(dtype), sizes)
  u = jax.lax.ragged_dot(rows, up.astype(dtype), sizes)
  y = in_assignment_order(jax.lax.ragged_dot(jax.nn.silu(g) * u, down.astype(dtype), sizes), order)
  return jnp.einsum("nkd,nk->nd", y.reshape(n, k, -1), weights.astype(dtype))


@jax.custom_batching.custom_vmap
def _vmappable_grouped_experts(x, expert_ids, weights, gate, up, down):
  return _undifferentiated_experts(x, expert_ids, weights, gate, up, down)


# The most assignments (tokens x k) one expert product of the cache paths takes at once: a
# prompt's prefill runs in chunks of this many, so its sorted rows and outputs stay 128 MiB at
# Qwen3-30B-A3B's width in bfloat16 (its sampler's prefill of 64 prompts of 1,024 tokens held
# 2 GiB of them per layer, several layers' at once: deviceless h100:8).
CACHE_PATH_ASSIGNMENTS = 32_768


def _undifferentiated_experts(x, expert_ids, weights, gate, up, down):
  n, k = expert_ids.shape
  chunk = max(1, CACHE_PATH_ASSIGNMENTS // k)
  if n > chunk:  # tokens in chunks; the padding tokens (expert 0, weight 0) are dropped
    pad = -n % chunk
    parts = [jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(-1, chunk, *a.shape[1:])
             for a in (x, expert_ids, weights)]
    y = jax.lax.map(lambda c: _undifferentiated_experts(*c, gate, up, down), tuple(parts))
    return y.reshape(-1, x.shape[-1])[:n]
  if expert_product(jax.default_backend(), differentiable=False) == "tiled":
    return tiled_experts(x, expert_ids, weights, gate, up, down)
  return _grouped_experts(x, expert_ids, weights, gate, up, down)


@_vmappable_grouped_experts.def_vmap
def _fold_batch_into_tokens(axis_size, in_batched, x, expert_ids, weights, gate, up, down):
  """Batched tokens, shared experts: one call on the ``S N`` tokens; batched experts: a loop."""
  tokens = [a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, batched in zip((x, expert_ids, weights), in_batched[:3])]
  if any(in_batched[3:]):
    experts = [a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
               for a, batched in zip((gate, up, down), in_batched[3:])]
    return jax.lax.map(lambda args: _undifferentiated_experts(*args), (*tokens, *experts)), True
  flat = [a.reshape((-1,) + a.shape[2:]) for a in tokens]
  y = _vmappable_grouped_experts(*flat, gate, up, down)
  return y.reshape(tokens[0].shape), True


@flax.struct.dataclass
class ExpertWeights:
  """The arrays of one sparse block (:class:`MoE`), for :func:`sparse_block`.

  Attributes:
    router: ``[D, E]``.
    gate, up: ``[E, D, I]``; down: ``[E, I, D]`` the stacked experts.
    shared_gate, shared_up: ``[D, S]``; shared_down: ``[S, D]``; shared_expert_gate: ``[D]``:
      Qwen2-MoE's shared expert and its gate (None without one).
  """

  router: Array
  gate: Array
  up: Array
  down: Array
  shared_gate: Array | None = None
  shared_up: Array | None = None
  shared_down: Array | None = None
  shared_expert_gate: Array | None = None

  def astype(self, dtype) -> ExpertWeights:
    """Every array cast to ``dtype`` (a decode loop's copy in the compute dtype)."""
    return jax.tree.map(lambda a: a.astype(dtype), self)


def sparse_block(x: Float[Array, "N D"], w: ExpertWeights, k: int, norm_topk_prob: bool,
                 expert_ids: Int[Array, "N k"] | None = None, *, vmappable: bool = False,
                 mesh: Mesh | None = None) -> tuple[Float[Array, "N D"], Routing]:
  r"""The sparse block on ``x`` (the normed residual, in the compute dtype): the router's
  logits :math:`x W_r` (accumulated in float32), :func:`route` (top-k, or ``expert_ids``),
  :func:`grouped_experts` (``vmappable``: its cache-path form), plus the gated shared expert
  when ``w`` has one.

  Returns:
    ``(y [N, D] in x.dtype, Routing of [N, ...])``.
  """
  dtype = x.dtype
  logits = jnp.einsum("nd,de->ne", x, w.router.astype(dtype), preferred_element_type=jnp.float32)
  weights, ids = route(logits, k, norm_topk_prob, expert_ids)
  y = grouped_experts(x, ids, weights, w.gate, w.up, w.down, vmappable=vmappable, mesh=mesh)
  if w.shared_gate is not None:
    h = (jax.nn.silu(x @ w.shared_gate.astype(dtype)) * (x @ w.shared_up.astype(dtype))
         ) @ w.shared_down.astype(dtype)
    y = y + jax.nn.sigmoid(x @ w.shared_expert_gate.astype(dtype))[:, None] * h
  return y, Routing(router_logits=logits, expert_ids=ids)


class MoE(nnx.Module):
  """The sparse block: router ``[D, E]``, stacked experts, and Qwen2-MoE's shared expert.

  Parameters (logical axes for :mod:`rft_jax.parallel.sharding`): ``router [D, E]``
  (``embed``, ``router``), ``expert_gate`` / ``expert_up [E, D, I]`` and ``expert_down
  [E, I, D]`` (``experts``, ``embed``, ``expert_mlp``); with a shared expert, ``shared_expert``
  (an :class:`~rft_jax.models.layers.MLP` of width ``shared_expert_intermediate_size``) and
  ``shared_expert_gate [D]``.
  """

  def __init__(self, config, *, rngs: nnx.Rngs):
    c = config
    d, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
    self.dtype = c.dtype
    self.k = c.num_experts_per_tok
    self.norm_topk_prob = c.norm_topk_prob
    self.router = param(normal_init, rngs.params(), (d, e), c.param_dtype, ("embed", "router"))
    self.expert_gate = param(normal_init, rngs.params(), (e, d, i), c.param_dtype,
                             ("experts", "embed", "expert_mlp"))
    self.expert_up = param(normal_init, rngs.params(), (e, d, i), c.param_dtype,
                           ("experts", "embed", "expert_mlp"))
    self.expert_down = param(normal_init, rngs.params(), (e, i, d), c.param_dtype,
                             ("experts", "expert_mlp", "embed"))
    shared = c.shared_expert_intermediate_size
    self.shared_expert = (MLP(d, shared, dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs, lora=c.lora)
                          if shared else None)
    if shared:
      self.shared_expert_gate = param(normal_init, rngs.params(), (d,), c.param_dtype, ("embed",))
    # LoRA (rft_jax.models.lora): an adapter per expert of the targeted projections, and the
    # router's; None where not targeted.
    self.lora_scale = None if c.lora is None else c.lora.scale
    self.gate_lora, self.up_lora, self.down_lora = (
        expert_adapters(c.lora, f"{name}_proj", e, n_in, n_out, in_axis, out_axis, rngs=rngs)
        for name, n_in, n_out, in_axis, out_axis in (("gate", d, i, "embed", "expert_mlp"),
                                                     ("up", d, i, "embed", "expert_mlp"),
                                                     ("down", i, d, "expert_mlp", "embed")))
    self.router_lora = projection_adapter(c.lora, ROUTER, d, e, "embed", "router", dtype=c.dtype, rngs=rngs)

  def expert_weights(self) -> ExpertWeights:
    """The block's arrays as stored (:func:`sparse_block` casts them); with LoRA adapters, each
    targeted weight merged with its adapter (:func:`~rft_jax.models.lora.merge_adapter`, as
    :func:`~rft_jax.models.lora_model.merged` merges them for the sampler: the same weights).
    The gradients reach the adapters through the merge; the merged copy of a layer's experts
    lives while the layer runs."""
    def weight(module, name, adapter):
      w = getattr(module, name)[...]
      lora = getattr(module, adapter, None)
      return w if lora is None else merge_adapter(w, lora.lora_a[...], lora.lora_b[...], self.lora_scale)

    shared = {}
    if self.shared_expert is not None:
      s = self.shared_expert
      shared = dict(shared_gate=weight(s, "gate_proj", "gate_lora"), shared_up=weight(s, "up_proj", "up_lora"),
                    shared_down=weight(s, "down_proj", "down_lora"), shared_expert_gate=self.shared_expert_gate[...])
    return ExpertWeights(router=weight(self, "router", "router_lora"), gate=weight(self, "expert_gate", "gate_lora"),
                         up=weight(self, "expert_up", "up_lora"), down=weight(self, "expert_down", "down_lora"),
                         **shared)

  def __call__(self, x: Float[Array, "B T D"], expert_ids: Int[Array, "B T k"] | None = None,
               *, vmappable: bool = False, mesh: Mesh | None = None
               ) -> tuple[Float[Array, "B T D"], Routing]:
    """The block on ``x`` (the post-attention normed residual), routed by its own top-k or by
    ``expert_ids`` (replay); returns the output and the :class:`Routing` (``[B, T, ...]``).
    ``vmappable``: the cache paths' form (:func:`grouped_experts`), without a derivative;
    ``mesh``: the mesh the arrays live on (expert parallelism, the product's platform)."""
    shape = x.shape
    ids = None if expert_ids is None else expert_ids.reshape(-1, self.k)
    y, routing = sparse_block(x.astype(self.dtype).reshape(-1, shape[-1]), self.expert_weights(),
                              self.k, self.norm_topk_prob, ids, vmappable=vmappable, mesh=mesh)
    return y.reshape(shape), jax.tree.map(lambda a: a.reshape(*shape[:-1], -1), routing)


def load_balancing_loss(router_logits: Float[Array, "L B T E"], k: int,
                        attention_mask: Int[Array, "B T"] | None = None,
                        expert_ids: Int[Array, "L B T k"] | None = None) -> Float[Array, ""]:
  r"""The Switch Transformer load-balancing loss as transformers'
  ``load_balancing_loss_func`` computes it (Fedus et al. 2021, eqs. 4-6), over all layers:

  .. math:: \mathcal{L}_\mathrm{aux} = E \sum_{e=1}^{E} f_e\, P_e,\qquad
     f_e = \frac{\sum_{l,n} m_n\, [e \in \mathrm{top}_k(p_{l,n})]}{L \sum_n m_n},\qquad
     P_e = \frac{\sum_{l,n} m_n\, p_{l,n,e}}{L \sum_n m_n},

  with :math:`p_{l,n} = \mathrm{softmax}(\ell_{l,n})` in float32, tokens :math:`n` over the
  batch, :math:`m_n` the attention mask (all ones when None: padding then counts, as in
  transformers). :math:`\sum_e f_e = k`: a uniform router scores :math:`k`.

  Args:
    router_logits: ``[L, B, T, E]`` (:attr:`Routing.router_logits` of the model's layers).
    k: experts per token.
    attention_mask: ``[B, T]``, 1 on tokens, 0 on padding.
    expert_ids: ``[L, B, T, k]`` the assignments to count (e.g. replayed ones); None: the
      top-k of the logits, as transformers.

  Returns:
    The scalar loss (multiply by ``router_aux_loss_coef`` for HF's training term).
  """
  num_experts = router_logits.shape[-1]
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [L, B, T, E]
  if expert_ids is None:
    _, expert_ids = jax.lax.top_k(probs, k)
  mask = (jnp.ones(router_logits.shape[1:-1], jnp.float32) if attention_mask is None
          else attention_mask.astype(jnp.float32))  # [B, T]
  rows = router_logits.shape[0] * jnp.sum(mask)
  counted = jnp.broadcast_to(mask[None, :, :, None], expert_ids.shape)  # [L, B, T, k]
  tokens_per_expert = jnp.zeros(num_experts, jnp.float32).at[expert_ids.reshape(-1)].add(
      counted.reshape(-1)) / rows
  prob_per_expert = jnp.einsum("lbte,bt->e", probs, mask) / rows
  return num_experts * jnp.sum(tokens_per_expert * prob_per_expert)


def router_z_loss(router_logits: Float[Array, "L B T E"],
                  attention_mask: Int[Array, "B T"] | None = None) -> Float[Array, ""]:
  r"""The router z-loss of ST-MoE (Zoph et al. 2022, eq. 5): the mean over layers and real
  tokens of :math:`(\log \sum_e e^{\ell_e})^2`, which keeps the router logits small.

  Args:
    router_logits: ``[L, B, T, E]``; attention_mask: ``[B, T]`` (all ones when None).
  """
  z = jnp.square(jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1))  # [L, B, T]
  if attention_mask is None:
    return jnp.mean(z)
  mask = attention_mask.astype(jnp.float32)
  return jnp.sum(z * mask) / (z.shape[0] * jnp.sum(mask))
