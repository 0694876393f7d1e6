"""The device mesh: axes ``('data', 'model')``, built once and passed explicitly everywhere."""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

DATA_AXIS = "data"  # rows (and FSDP's parameter shards)
MODEL_AXIS = "model"  # heads, MLP width, vocabulary (tensor parallelism)
MESH_AXES = (DATA_AXIS, MODEL_AXIS)


def axis_if_divides(mesh: Mesh, size: int, axis: str = MODEL_AXIS) -> str | None:
  """``axis`` when the mesh's ``axis`` divides ``size`` evenly, else ``None`` (replicated).

  The one rule for what a kernel under :func:`jax.shard_map` may split, e.g. key/value heads over
  ``model``: the sharding rules replicate a dimension the axis does not divide, and so do the
  kernels and ``rft-jax plan``'s byte counts."""
  return axis if size % dict(mesh.shape).get(axis, 1) == 0 else None


def first_device(mesh: Mesh | None) -> jax.Device:
  """The first device of ``mesh`` (without one: of the default devices)."""
  return next(iter(mesh.devices.flat if mesh is not None else jax.devices()))


def mesh_of(tree) -> Mesh | None:
  """The mesh ``tree``'s arrays are laid out on (a model, a state): the first ``NamedSharding``'s;
  None when they are on single devices."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return sharding.mesh
  return None


def platform_of(mesh: Mesh | None) -> str:
  """``cpu``, ``gpu`` or ``tpu``: the platform of ``mesh``'s devices (else the default ones),
  what the programs and kernels choose their forms by."""
  return first_device(mesh).platform


def make_mesh(data: int | None = None, model: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``data x model`` mesh over ``devices`` (default: all of ``jax.devices()``).

  ``data`` defaults to ``len(devices) // model``. The axes are ``Auto`` (GSPMD propagates
  shardings from the parameters and inputs), and ``data * model`` must equal the number of
  devices given, or be at most the number available when ``devices`` is omitted.

  Raises:
    ValueError: sizes that do not fit the devices, naming both.
  """
  explicit = devices is not None
  devices = list(jax.devices() if devices is None else devices)
  if data is None:
    if model < 1 or len(devices) % model:
      raise ValueError(f"make_mesh: model={model} does not divide the {len(devices)} devices")
    data = len(devices) // model
  size = data * model
  if data < 1 or model < 1 or size > len(devices) or (explicit and size != len(devices)):
    raise ValueError(
        f"make_mesh: data={data} x model={model} = {data * model} devices, but "
        f"{len(devices)} {'were given' if explicit else 'are available'}")
  return jax.make_mesh((data, model), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                       devices=devices[:data * model])
