r"""PPO's critic: a value model and its compiled train step (the clipped value loss).

**Model.** :class:`ValueModel` is the policy's decoder (a :class:`~rft_jax.models.Qwen`, without
an untied ``lm_head``: the critic never unembeds) plus a scalar head,
:math:`V(s_t) = h_t^\top w + b` on the final normed hidden state :math:`h_t` (float32), as verl's
critic (``AutoModelForTokenClassification`` with ``num_labels = 1``: a checkpoint's decoder and a
fresh ``score`` layer; ``verl/utils/model.py`` ``load_valuehead_model``).

**Alignment.** With ``input_ids`` ``[B, L]`` and the learner's next-token positions (position
``t`` predicts token ``t + 1``), :meth:`Critic.values` returns ``[B, L-1]`` with entry ``t`` the
value of the state :math:`s_t` = tokens ``0..t``, in which token ``t + 1`` is chosen: the value
that pairs with the action ``input_ids[:, t + 1]``. The last position (no action follows) is
dropped. This is verl's ``values[:, -response_length - 1 : -1]``. Every ``[B, L-1]`` array of
:meth:`Critic.step` (``response_mask``, ``returns``, ``old_values``) is aligned the same way:
``response_mask[:, t] = batch.response_mask[:, t + 1]``. GAE (``rft_jax.rl.advantages.gae``) runs on these
arrays; advantages for the learner's ``[B, L]`` token columns are ``pad(adv, ((0, 0), (1, 0)))``.

**Loss** (Schulman et al. 2017, PPO eq. 9; value clipping as verl ``compute_value_loss``): per
valid token :math:`\ell_t = \frac12\max((V_t - \hat R_t)^2, (\mathrm{clip}(V_t, V^{old}_t \pm c)
- \hat R_t)^2)` (:func:`~rft_jax.rl.advantages.gae.clipped_value_loss`), aggregated with the whole batch's
normaliser (:func:`~rft_jax.rl.losses.aggregate_loss`), so micro-batch gradients sum exactly.
One step is one AdamW update (global-norm clipped); a non-finite step is skipped
(:func:`~rft_jax.rl.nonfinite.keep_if_finite`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from rft_jax.models import Qwen, QwenConfig
from rft_jax.models.layers import param
from rft_jax.parallel import host_array
from rft_jax.rl.batching import merge_rows, split_rows
from rft_jax.rl.checks import choice, finite_numbers, positive
from rft_jax.rl.advantages.gae import clipped_value_loss
from rft_jax.rl.losses import AGGREGATIONS, aggregate_loss, loss_normaliser
from rft_jax.rl.nonfinite import keep_if_finite
from rft_jax.rl.model_trainer import ModelTrainer, TrainState
from rft_jax.rl.optimizer import OptimizerConfig, optimizer_config


class ValueModel(nnx.Module):
  r"""A Qwen decoder and a scalar value head ``value_head`` (``kernel [D, 1]``, ``bias [1]``, float32).

  The head starts at **zero** by default (``head_stddev = 0``): every value is 0 until the critic
  trains, so the first GAE advantages are plain Monte-Carlo returns
  (:math:`\gamma = \lambda = 1`), not noise. A normal init (HF's ``score`` layer:
  :math:`\mathcal N(0, 0.02^2)`) gives :math:`V \sim \mathcal N(0, 0.02^2 D)` on unit-RMS hidden
  states, std ~1.2 at D = 3584: the size of the rewards themselves. A zero head gets a gradient
  (:math:`\partial \ell / \partial w = (V - \hat R) h`) from the first step; the decoder's moves
  from the second on. Its parameters are small and replicated (logical axes ``norm``).

  Args:
    backbone: a ``Qwen`` (wrapped as is, no copy; its untied ``lm_head`` is removed) or the
      ``QwenConfig`` of a new random one.
    rngs: random keys (the backbone's init; the head's when ``head_stddev > 0``).
    head_stddev: the head kernel's init std (0: zeros).
  """

  def __init__(self, backbone: Qwen | QwenConfig, *, rngs: nnx.Rngs, head_stddev: float = 0.0):
    self.backbone = Qwen(backbone, rngs=rngs) if isinstance(backbone, QwenConfig) else backbone
    if hasattr(self.backbone, "lm_head"):
      del self.backbone.lm_head
    init = nnx.initializers.normal(head_stddev) if head_stddev > 0 else nnx.initializers.zeros
    hidden = self.backbone.config.hidden_size
    self.value_head = nnx.Dict(
        kernel=param(init, rngs.params(), (hidden, 1), jnp.float32, ("norm", None)),
        bias=param(nnx.initializers.zeros, rngs.params(), (1,), jnp.float32, (None,)))

  @classmethod
  def from_policy(cls, policy: Qwen, rngs: nnx.Rngs, head_stddev: float = 0.0) -> ValueModel:
    """A critic starting from ``policy``'s decoder: an independent copy of its arrays (same
    shardings, no shared buffer: the learner may donate the policy's) and a new head."""
    graphdef, state = nnx.split(policy)
    return cls(nnx.merge(graphdef, jax.tree.map(jnp.copy, state)), rngs=rngs, head_stddev=head_stddev)

  def values(self, input_ids: Int[Array, "B L"], attention_mask: Int[Array, "B L"],
             mesh: Mesh | None = None) -> Float[Array, "B L"]:
    """``[B, L]`` float32: entry ``t`` is :math:`V(s_t)`, the state of tokens ``0..t``."""
    hidden = self.backbone(input_ids, attention_mask, return_hidden=True, mesh=mesh).astype(jnp.float32)
    return (hidden @ self.value_head["kernel"][...])[..., 0] + self.value_head["bias"][0]


@dataclasses.dataclass
class CriticConfig:
  r"""The critic's train step. Defaults: verl 0.9.1 ``trainer/config/critic/critic.yaml``
  (``optim.lr`` 1e-5 l.19, ``optim.weight_decay`` 0.01 l.28, ``cliprange_value`` 0.5 l.61,
  ``loss_agg_mode`` token-mean l.64), ``critic/dp_critic.yaml`` (``grad_clip`` 1.0) and
  ``optim/fsdp.yaml`` (``betas`` [0.9, 0.999], ``lr_scheduler_type`` constant; torch AdamW eps 1e-8).

  Attributes:
    optim: AdamW and its schedule (``rft_jax.rl.optimizer.OptimizerConfig``; defaults lr 1e-5,
      weight_decay 0.01, max_grad_norm 1.0).
    cliprange_value: c of the value clip :math:`V^{old} \pm c`.
    loss_agg: aggregation of the per-token loss (``rft_jax.rl.losses.AGGREGATIONS``); max_len:
      Dr.GRPO's constant length for ``seq-mean-token-sum-norm`` (None: ``L - 1``).
    micro_batch_size: sequences per gradient-accumulation step and per forward of :meth:`Critic.values`.
    gamma, lam: GAE's discount and :math:`\lambda` (``rft_jax.rl.advantages.gae``; verl 0.9.1
      ``ppo_trainer.yaml`` ``algorithm.gamma`` / ``algorithm.lam``: 1.0, 1.0).
  """

  optim: OptimizerConfig = dataclasses.field(default_factory=lambda: OptimizerConfig(lr=1e-5, weight_decay=0.01))
  cliprange_value: float = 0.5
  loss_agg: str = "token-mean"
  max_len: Optional[int] = None
  micro_batch_size: int = 8
  gamma: float = 1.0
  lam: float = 1.0

  def __post_init__(self):
    self.optim = optimizer_config(self.optim, "critic.optim")
    finite_numbers("critic", self)
    choice("critic.loss_agg", self.loss_agg, AGGREGATIONS)
    for name in ("cliprange_value", "micro_batch_size"):
      positive(f"critic.{name}", getattr(self, name))
    for name in ("gamma", "lam"):
      if not 0 <= getattr(self, name) <= 1:
        raise ValueError(f"critic.{name} must be in [0, 1], got {getattr(self, name)!r}")
    if self.max_len is not None:
      positive("critic.max_len", self.max_len)


@flax.struct.dataclass
class ActorCriticState:
  """PPO's train state: the policy's (``rft_jax.rl.learner.TrainState``) and the critic's.

  ``params`` are the policy's, so that whatever runs the policy of a train state (the sampler,
  the evaluation, ``Learner.model``) runs it the same way for GRPO's and PPO's."""

  policy: Any
  critic: Any

  @property
  def params(self):
    return self.policy.params


class Critic(ModelTrainer):
  """Compiles and runs the critic's value pass and train step (no state of its own): a
  :class:`~rft_jax.rl.model_trainer.ModelTrainer` whose state is a ``TrainState``.

  Args:
    value_model: the :class:`ValueModel` (its architecture; :meth:`init` takes its parameters).
    config: the critic's config.
    mesh: device mesh (None: one device); data_axis: the mesh axis batch rows are split over.
  """

  def __init__(self, value_model: ValueModel, config: CriticConfig, *, mesh: Mesh | None = None,
               data_axis: str = "data"):
    super().__init__(value_model, config.optim, mesh=mesh, data_axis=data_axis)
    self.config = config
    self._compiled: dict[str, Any] = {}

  # ---------------------------------------------------------------------------------------

  def _micro(self, x):
    """``[B, ...] -> [n, B/n, ...]`` micro-batches (strided rows, spread over the data axis)."""
    if x.shape[0] % self.config.micro_batch_size:
      raise ValueError(f"batch of {x.shape[0]} sequences does not split into micro-batches of "
                       f"critic.micro_batch_size={self.config.micro_batch_size}")
    return self.constrain_micro_batches(split_rows(x, x.shape[0] // self.config.micro_batch_size))

  def _next_token_values(self, params, input_ids, attention_mask) -> Float[Array, "b L-1"]:
    return self.merge(params).values(input_ids, attention_mask, self.mesh)[:, :-1]

  def _values_fn(self, params, input_ids, attention_mask):
    micros = (self._micro(input_ids), self._micro(attention_mask))
    return merge_rows(jax.lax.map(lambda xs: self._next_token_values(params, *xs), micros))

  def _micro_loss(self, params, micro, normaliser):
    values = self._next_token_values(params, micro["input_ids"], micro["attention_mask"])
    terms = clipped_value_loss(values, micro["old_values"], micro["returns"], micro["mask"],
                               clip_range=self.config.cliprange_value)
    loss = aggregate_loss(terms.loss, micro["mask"], self.config.loss_agg, normaliser)
    return loss, (jnp.sum(terms.clipped), jnp.sum(jnp.where(micro["mask"] > 0, values, 0.0)))

  def _step_fn(self, state: TrainState, input_ids, attention_mask, response_mask, returns, old_values):
    c = self.config
    mask = response_mask.astype(jnp.float32) * attention_mask[:, 1:]
    normaliser = loss_normaliser(mask, c.max_len or input_ids.shape[1] - 1)
    # Padding entries are zeroed: a NaN there would reach the gradient (0 * NaN in square's VJP).
    returns, old_values = (jnp.where(mask > 0, x.astype(jnp.float32), 0.0) for x in (returns, old_values))
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "mask": mask,
             "returns": returns, "old_values": old_values}
    micros = {k: self._micro(v) for k, v in batch.items()}
    grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

    def accumulate(carry, micro):
      (micro_loss, aux), micro_grads = grad_fn(state.params, micro, normaliser)
      return (self.add_grads(carry[0], micro_grads), *jax.tree.map(jnp.add, carry[1:], (micro_loss, *aux))), None

    zero = jnp.zeros((), jnp.float32)
    init = (self.zero_grads(state.params), zero, jnp.zeros((), jnp.int32), zero)
    (grads, loss, clipped, value_sum), _ = jax.lax.scan(accumulate, init, micros)
    new, grad_norm = self.apply_gradients(state, grads)
    new, skipped = keep_if_finite(new, state, [loss, grad_norm])
    n = jnp.sum(mask)
    valid = mask > 0

    def var(x):  # torch.var over the valid tokens (unbiased), as verl's metric
      mean = jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(n, 1.0)
      return jnp.sum(jnp.where(valid, jnp.square(x - mean), 0.0)) / jnp.maximum(n - 1, 1.0)

    metrics = {
        "value_loss": loss, "value_clipfrac": clipped / (n + 1e-8),
        "value_mean": value_sum / jnp.maximum(n, 1.0),
        "explained_variance": 1.0 - var(batch["returns"] - batch["old_values"]) / (var(batch["returns"]) + 1e-5),
        "critic_grad_norm": grad_norm, "critic_lr": self.schedule(state.step),
        "critic_nonfinite_skipped": skipped}
    return new, metrics

  def _jit(self, name, fn, state_like, n_rows, out, donate):
    """``jax.jit(fn)`` once, with explicit shardings on a mesh (rows over the data axis)."""
    if name not in self._compiled:
      if self.mesh is None:
        self._compiled[name] = jax.jit(fn, donate_argnums=donate)
      else:
        rows = self.rows_sharding()
        layout = jax.tree.map(lambda x: x.sharding, state_like)
        out = jax.tree.map(lambda o: layout if o == "state" else rows if o == "rows" else
                           NamedSharding(self.mesh, PartitionSpec()), out)
        self._compiled[name] = jax.jit(fn, donate_argnums=donate, in_shardings=(layout,) + (rows,) * n_rows,
                                       out_shardings=out)
    return self._compiled[name]

  def values(self, state: TrainState, input_ids, attention_mask) -> Float[Array, "B L-1"]:
    """``[B, L-1]`` float32: entry ``t`` is :math:`V(s_t)`, paired with token ``t + 1`` (module
    docstring), micro-batch by micro-batch; rows over the data axis on a mesh."""
    fn = self._jit("values", self._values_fn, state.params, 2, "rows", ())
    return fn(state.params, *self.place_rows((input_ids, attention_mask)))

  def lower_step(self, state: TrainState, input_ids, attention_mask, response_mask, returns,
                 old_values) -> jax.stages.Lowered:
    """The step (:meth:`step`) lowered for ``state`` and the arrays (concrete, or abstract
    ``jax.ShapeDtypeStruct`` with shardings, e.g. :meth:`abstract_state`):
    ``.compile().memory_analysis()`` gives its bytes per device (``rft-jax plan``)."""
    fn = self._jit("step", self._step_fn, state, 5, ("state", "replicated"), 0)
    return fn.lower(state, input_ids, attention_mask, response_mask, returns, old_values)

  def step(self, state: TrainState, input_ids, attention_mask, response_mask, returns, old_values):
    r"""One AdamW step of the clipped value loss: ``(state, metrics)`` (floats; ``state`` donated).

    Args:
      input_ids, attention_mask: ``[B, L]`` as the learner's batch.
      response_mask, returns, old_values: ``[B, L-1]`` next-token aligned (entry ``t`` is about
        token ``t + 1``): the shifted response mask, GAE returns and :meth:`values` at rollout.
        Only valid entries (``response_mask * attention_mask[:, 1:]``) are read.

    Metrics: ``value_loss`` (aggregated), ``value_clipfrac`` (verl's ``vf_clipfrac``),
    ``value_mean`` (pre-update values on valid tokens), ``explained_variance`` (verl's
    ``vf_explained_var``, :math:`1 - \mathrm{Var}(\hat R - V^{old}) / (\mathrm{Var}(\hat R) + 10^{-5})`,
    unbiased, over valid tokens), ``critic_grad_norm`` (before clipping), ``critic_lr``,
    ``critic_nonfinite_skipped``.
    """
    arrays = self.place_rows((input_ids, attention_mask, response_mask, returns, old_values))
    fn = self._jit("step", self._step_fn, state, 5, ("state", "replicated"), 0)
    state, metrics = fn(state, *arrays)
    return state, {k: float(host_array(v)) for k, v in metrics.items()}
