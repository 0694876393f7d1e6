"""The devices of a topology named on the command line: ``cpu:N`` (fake CPU devices), TPU
slices (``v5p:2x2x1``; needs ``libtpu``) and NVIDIA GPUs (``h100:8``;
:mod:`rft_jax.plan.gpu_topology`), each with its memory per device."""

from __future__ import annotations

import os

import jax

from rft_jax.plan.gpu_topology import gpu_topology
from rft_jax.plan.topology import GiB, PlanError, Topology

# Memory per chip as the TPU compiler states it in its out-of-memory messages ("... of N G hbm"),
# with libtpu 0.0.42 (docs/scale.md#memory-per-chip). Keyed by jax's ``device_kind``.
TPU_HBM_BYTES = {
    "TPU v5": int(95.74 * GiB),       # v5p
    "TPU v5 lite": int(15.75 * GiB),  # v5e
    "TPU v6 lite": int(31.25 * GiB),  # v6e (Trillium)
    "TPU v4": int(30.75 * GiB),       # v4, megacore
}


def topology(name: str) -> Topology:
  """The devices of ``name``: ``cpu:N``, a TPU topology such as ``v5p:2x2x1``, or GPUs such
  as ``h100:8``.

  Raises:
    PlanError: an unknown name, too few CPU devices, no ``libtpu`` or no CUDA plugin.
  """
  kind, _, shape = name.partition(":")
  if kind == "cpu":
    if not shape.isdigit() or int(shape) < 1:
      raise PlanError(f"topology {name!r}: expected cpu:N with N >= 1")
    n, devices = int(shape), jax.devices("cpu")
    if len(devices) < n:
      raise PlanError(f"topology {name!r}: only {len(devices)} CPU devices; start with "
                      f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Topology(name, tuple(devices[:n]), ram // n)
  if kind.startswith(("h100", "h200")):  # NVIDIA GPUs, deviceless: h100:8, h100:2x8
    return gpu_topology(name)
  if not kind.startswith("v") or not shape:
    raise PlanError(f"topology {name!r}: expected cpu:N, a TPU name like v5p:2x2x1 or GPUs "
                    f"like h100:8")
  from jax.experimental import topologies

  # v4 chips have two cores; as one "megacore" device each, the mesh has one device per chip.
  extra = {"chip_config_name": "megacore"} if kind == "v4" else {}
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=name, **extra)
  except Exception as exc:  # no libtpu, or a name libtpu does not know
    raise PlanError(f"topology {name!r}: {str(exc).splitlines()[0]} (TPU topologies need "
                    f"libtpu: pip install 'rft_jax[tpu]')") from exc
  devices = tuple(desc.devices)
  kind_name = devices[0].device_kind
  if kind_name not in TPU_HBM_BYTES:
    raise PlanError(f"topology {name!r}: unknown memory size of {kind_name!r}")
  return Topology(name, devices, TPU_HBM_BYTES[kind_name])
