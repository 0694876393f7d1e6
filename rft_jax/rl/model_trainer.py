"""What the learner and the critic share: a model's architecture and its optimizer.

A :class:`ModelTrainer` splits a model into its parameters and the rest, owns the AdamW of an
:class:`~rft_jax.rl.optimizer.OptimizerConfig`, and gives the :class:`TrainState` of the
parameters, its layout on a mesh (AdamW's moments exactly like the parameters), rows placed over
the data axis and one optimizer update. :class:`rft_jax.rl.learner.Learner` and
:class:`rft_jax.rl.advantages.critic.Critic` add their compiled steps.

**LoRA.** A model with LoRA adapters (:mod:`rft_jax.models.lora`) trains its adapters only: the
*trainable* parameters (:meth:`ModelTrainer.trainable`) are the ``nnx.LoRAParam`` variables, the
rest of ``TrainState.params`` is the frozen base, held there once (the train state is what a step
donates and a checkpoint saves; the base passes through a step unchanged). Gradients are taken
with respect to the adapters alone (:meth:`ModelTrainer.value_and_grad`: the forward adds the
adapters' product to the base projections, so no gradient of a base weight is ever formed), and
AdamW's state, its moments, covers the adapters alone. :meth:`ModelTrainer.model` returns the
merged model (:func:`~rft_jax.models.lora_model.merged`), what the sampler, the evaluation and
the export read. Without adapters every parameter is trainable and nothing changes.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rft_jax.models.lora_model import has_adapters, merged
from rft_jax.parallel import global_array, with_shardings
from rft_jax.rl.optimizer import OptimizerConfig, make_optimizer, moment_dtype, optimizer_shardings


@flax.struct.dataclass
class TrainState:
  """Everything that changes during training: the one place state lives."""

  params: Any
  opt_state: Any
  step: jax.Array  # train steps (batches) applied; a step skipped as non-finite does not count


class ModelTrainer:
  """A model's parameters and their optimizer, on a mesh (or one device).

  Args:
    model: the model (its architecture; :meth:`init` takes its parameters).
    optim: its optimizer's config.
    mesh: device mesh (None: one device).
    data_axis: the mesh axis batch rows are split over.
  """

  def __init__(self, model: nnx.Module, optim: OptimizerConfig, *, mesh: Mesh | None = None,
               data_axis: str = "data"):
    self.mesh = mesh
    self.data_axis = data_axis
    self.graphdef, _, self._rest = nnx.split(model, nnx.Param, ...)
    self.optimizer, self.schedule = make_optimizer(optim)
    # moment_dtype float32 beside bfloat16 parameters: the optimizer's arithmetic in float32, so
    # the micro-batches' gradients are summed in float32 too (else a bfloat16 running sum).
    self.accumulate_dtype = moment_dtype(optim)
    self.lora = has_adapters(model)  # train the LoRA adapters only

  # ---------------------------------------------------------------------------------------
  # Trainable and frozen parameters (LoRA: the adapters and the base; else all and none).

  def trainable(self, params):
    """The parameters the optimizer updates: ``params``' ``nnx.LoRAParam`` variables with
    LoRA adapters, else ``params`` itself."""
    return nnx.filter_state(params, nnx.LoRAParam) if self.lora else params

  def with_trainable(self, params, trainable):
    """``params`` with its trainable part replaced by ``trainable`` (no copy)."""
    return nnx.merge_state(nnx.filter_state(params, nnx.Not(nnx.LoRAParam)), trainable) if self.lora else trainable

  def value_and_grad(self, fn, *, has_aux: bool = False):
    """``jax.value_and_grad`` of ``fn(params, *args)`` with respect to the trainable part of
    ``params`` only: the gradients are a tree like :meth:`trainable`'s (with LoRA the frozen
    base gets none, computed or stored)."""
    if not self.lora:
      return jax.value_and_grad(fn, has_aux=has_aux)

    def value_and_grad(params, *args):
      frozen = nnx.filter_state(params, nnx.Not(nnx.LoRAParam))
      return jax.value_and_grad(lambda t: fn(nnx.merge_state(frozen, t), *args),
                                has_aux=has_aux)(nnx.filter_state(params, nnx.LoRAParam))

    return value_and_grad

  def zero_grads(self, params):
    """Zeros shaped like the gradients of :meth:`value_and_grad` (an accumulator's start), in
    the parameters' dtype or, with ``moment_dtype: float32``, at least float32."""
    def zeros(x):
      dtype = x.dtype if self.accumulate_dtype is None else jnp.promote_types(x.dtype, self.accumulate_dtype)
      return jnp.zeros_like(x, dtype)
    return jax.tree.map(zeros, self.trainable(params))

  @staticmethod
  def add_grads(total, grads):
    """``total + grads`` leaf by leaf, in ``total``'s dtype (:meth:`zero_grads`)."""
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), total, grads)

  def init(self, model: nnx.Module) -> TrainState:
    """A fresh train state holding ``model``'s parameter arrays (in place, with their shardings).

    The state owns those arrays from now on: the step donates them, so use :meth:`model` (not
    the ``model`` passed here) after the first step. With a mesh, the optimizer state is created
    directly in the layout of :meth:`state_shardings`.
    """
    params = nnx.state(model, nnx.Param)
    if self.mesh is None:
      return TrainState(params=params, opt_state=jax.jit(self.optimizer.init)(self.trainable(params)),
                        step=jnp.zeros((), jnp.int32))
    shardings = self.state_shardings(params)
    params = jax.tree.map(global_array, params, shardings.params)
    opt_state = jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(self.trainable(params))
    return TrainState(params=params, opt_state=opt_state,
                      step=global_array(jnp.zeros((), jnp.int32), shardings.step))

  def state_shardings(self, params) -> TrainState:
    """The layout of a train state on the mesh, from its parameters (arrays or abstract
    ``jax.ShapeDtypeStruct`` with shardings): AdamW's moments exactly like the parameters
    (:func:`~rft_jax.rl.optimizer.optimizer_shardings`; with LoRA, the adapters' moments only)."""
    param_shardings, opt_shardings, replicated = optimizer_shardings(self.optimizer, params, self.mesh)
    if self.lora:
      _, opt_shardings, _ = optimizer_shardings(self.optimizer, self.trainable(params), self.mesh)
    return TrainState(params=param_shardings, opt_state=opt_shardings, step=replicated)

  def abstract_state(self, params) -> TrainState:
    """The train state of ``params`` (abstract or concrete, laid out on the mesh) as
    ``jax.ShapeDtypeStruct`` leaves with the shardings of :meth:`state_shardings`: nothing is
    allocated, e.g. to compile the step for devices this process does not have."""
    shapes = jax.eval_shape(lambda p: TrainState(params=p, opt_state=self.optimizer.init(self.trainable(p)),
                                                 step=jnp.zeros((), jnp.int32)), params)
    return with_shardings(shapes, self.state_shardings(params))

  def model(self, state: TrainState) -> nnx.Module:
    """The model with ``state``'s parameters (no copy); with LoRA, the merged model (a plain one,
    its targeted weights ``W + alpha/r A B`` computed here: :func:`~rft_jax.models.lora_model.merged`)."""
    return merged(self.merge(state.params)) if self.lora else self.merge(state.params)

  def merge(self, params) -> nnx.Module:
    """The model with ``params`` (inside a traced function: the parameters being differentiated)."""
    return nnx.merge(self.graphdef, params, self._rest)

  def rows_sharding(self) -> NamedSharding | None:
    """Rows over the data axis (None without a mesh)."""
    return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec(self.data_axis))

  def constrain_micro_batches(self, x):
    """``x`` (``[n, b, ...]`` micro-batches of rows, or ``[b]``) with its rows over the data axis
    inside a traced step (a sharding constraint; unchanged without a mesh or for None)."""
    if self.mesh is None or x is None:
      return x
    spec = PartitionSpec(None, self.data_axis) if x.ndim >= 2 else PartitionSpec(self.data_axis)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def place_rows(self, tree):
    """``tree``'s arrays as global arrays with rows over the data axis (unchanged without a mesh).

    Leaves may be numpy or ``jax`` arrays; on several processes each process passes the same full
    arrays and fills only its own devices' rows (:func:`rft_jax.parallel.global_array`)."""
    if self.mesh is None:
      return tree
    rows = self.rows_sharding()
    return jax.tree.map(lambda x: global_array(x, rows), tree)

  def apply_gradients(self, state: TrainState, grads) -> tuple[TrainState, jax.Array]:
    """One optimizer update with ``grads`` (of the trainable parameters, :meth:`value_and_grad`):
    the new state (same step count) and the gradients' global norm (before clipping)."""
    trainable = self.trainable(state.params)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, trainable)
    params = self.with_trainable(state.params, optax.apply_updates(trainable, updates))
    return TrainState(params=params, opt_state=opt_state, step=state.step), optax.tree.norm(grads)
