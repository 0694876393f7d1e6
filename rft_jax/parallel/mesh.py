"""The device mesh: axes ``('data', 'model')``, built once and passed explicitly everywhere."""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "model")


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
