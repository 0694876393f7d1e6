r"""Logical axis names -> mesh axes: the rules table, and the shardings of a model's state.

A rule is ``(logical_name, mesh_axis)`` (a mesh axis name, a tuple of them, or ``None``). For
each dimension of a parameter, the first rule for its logical name is taken whose mesh axes are
not used by another dimension of the same array and whose total size divides the dimension;
otherwise the dimension is replicated. Mesh axes of size 1 are dropped from the specs, so a
``data=8, model=1`` mesh yields pure FSDP specs.

Tables (order is priority):

* :data:`FSDP_RULES` shards the large ``embed`` / ``vocab`` / ``mlp`` dims over ``data``;
* :data:`TP_RULES` shards ``heads`` / ``kv_heads`` / ``mlp`` / ``vocab`` over ``model``, and an
  MoE layer's ``experts`` over ``model`` (expert parallelism: each device holds ``E / model``
  whole experts; their width ``expert_mlp`` over ``model`` where the experts do not divide);
* :data:`DEFAULT_RULES` is tensor parallel first, then FSDP on what is left, plus ``batch``
  over ``data`` for activations and the KV cache.
"""

from __future__ import annotations

import math
from typing import Any, Sequence, Union

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rft_jax.parallel.multihost import global_array

MeshAxes = Union[str, Sequence[str], None]
Rules = Sequence[tuple[str, MeshAxes]]

FSDP_RULES: Rules = (("embed", "data"), ("vocab", "data"), ("mlp", "data"), ("batch", "data"))
TP_RULES: Rules = (("vocab", "model"), ("heads", "model"), ("kv_heads", "model"),
                   ("mlp", "model"), ("experts", "model"), ("expert_mlp", "model"))
DEFAULT_RULES: Rules = tuple(TP_RULES) + tuple(FSDP_RULES)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Rules = DEFAULT_RULES) -> PartitionSpec:
  """The ``PartitionSpec`` of an array with logical ``axes`` and ``shape`` on ``mesh``.

  Raises:
    ValueError: ``axes`` and ``shape`` differ in length, or a rule names an axis not in the mesh.
  """
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
  used: set[str] = set()
  spec: list[Any] = []
  for name, dim in zip(axes, shape):
    choice: tuple[str, ...] = ()
    for logical, target in rules:
      if logical != name or target is None:
        continue
      targets = (target,) if isinstance(target, str) else tuple(target)
      unknown = [a for a in targets if a not in mesh.shape]
      if unknown:
        raise ValueError(f"sharding rule ({logical!r}, {target!r}) names mesh axes {unknown} "
                         f"not in the mesh {dict(mesh.shape)}")
      targets = tuple(a for a in targets if mesh.shape[a] > 1)
      if not targets or used.intersection(targets):
        continue
      if dim % math.prod(mesh.shape[a] for a in targets) == 0:
        choice = targets
        break
    used.update(choice)
    spec.append(None if not choice else choice[0] if len(choice) == 1 else choice)
  return PartitionSpec(*spec)


def named_sharding(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                   rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """:func:`logical_to_spec` as a ``NamedSharding`` on ``mesh``."""
  return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def variable_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
  """The logical axis names of a variable (flax ``out_sharding`` metadata), or ``None``."""
  axes = variable.get_metadata().get("out_sharding")
  return None if axes is None else tuple(axes)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
  """``state`` with every variable's value replaced by its ``NamedSharding``.

  Works on concrete and abstract (``nnx.eval_shape``) states; variables without logical names
  are replicated.
  """
  def one(variable: nnx.Variable):
    shape = variable.get_value().shape
    axes = variable_axes(variable) or (None,) * len(shape)
    return variable.replace(named_sharding(axes, shape, mesh, rules))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def is_axis_names(x: Any) -> bool:
  """A leaf of an axes tree: a tuple of logical axis names (``str`` or ``None``), maybe empty."""
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_shardings(tree: Any, axes_tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """Shardings of a plain pytree (e.g. a KV cache) from a same-structured tree of axis tuples.

  Containers of the axes tree may themselves be tuples (a tuple of per-layer arrays); a tuple
  of names is a leaf (:func:`is_axis_names`).
  """
  return jax.tree.map(lambda axes, x: named_sharding(axes, x.shape, mesh, rules), axes_tree,
                      tree, is_leaf=is_axis_names)


def with_shardings(tree: Any, shardings: Any) -> Any:
  """``tree``'s arrays (or abstract values) as ``jax.ShapeDtypeStruct`` carrying the matching
  leaf of ``shardings``: a layout to compile for, nothing allocated."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
  """Moves every parameter of ``model`` to its ``NamedSharding`` on ``mesh`` (in place).

  On several processes every process must hold the same parameter values (e.g. the same seed
  or checkpoint); each fills only its own devices' shards.
  """
  state = nnx.state(model)
  nnx.update(model, jax.tree.map(global_array, state, state_shardings(state, mesh, rules)))
  return model
