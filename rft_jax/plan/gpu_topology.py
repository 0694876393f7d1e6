"""NVIDIA GPU topologies for ``rft-jax plan``: ``h100:8`` (one host), ``h100:2x8`` (hosts x GPUs).

XLA compiles for GPUs that are not attached when it is given a target config, a
``stream_executor.GpuTargetConfigProto`` in text format describing one device (compute
capability, memory size, SM count, clocks, bandwidth, shared-memory and register limits):
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=..., topology=
"SLICES x HOSTS x GPUS_PER_HOST")``. The configs are ``gpu_specs/*.txtpb`` beside this module.
This needs jax's CUDA plugin (``pip install "jax[cuda12]==0.10.2"``, the jax build the project
pins) loaded without a GPU: with ``JAX_PLATFORMS=cpu`` (``rft-jax plan`` sets it unless set) the
plugin registers without starting a driver; otherwise it tries to, fails, and is not registered.

The compile is the real one, down to ptxas (the nvcc wheel's). cuDNN flash attention (the model's
``auto`` on GPU for bfloat16) compiles too, with one difference from a compile on a GPU: XLA
builds the cuDNN graphs only with a device, so their workspace (cuDNN's scratch, for the backward
pass a float32 dQ accumulator of about ``B x N x T x H x 4`` bytes per call) is counted as 0.
Large sorts (Clip_V's ``argsort``) compile as XLA's own sort, with a warning, where a GPU would
run CUB's radix sort (without a device XLA takes CUB's scratch size from tables for known
devices and CUB versions; a config naming no CUB version gets the fallback, while XLA's own
H100 config, which names one, fails with "invalid device ordinal").
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from rft_jax.plan.topology import PlanError, Topology

SPECS = Path(__file__).with_name("gpu_specs")
# Kind in a topology name -> its target config under gpu_specs/.
GPU_SPECS = {"h100": "h100_sxm.txtpb", "h200": "h200_sxm.txtpb"}
# What launch/gpu_host.sh lets a JAX process take of each GPU (XLA_PYTHON_CLIENT_MEM_FRACTION).
DEFAULT_MEM_FRACTION = 0.92
INSTALL = ('GPU topologies need jax\'s CUDA plugin loaded without a GPU: pip install '
           '"jax[cuda12]==0.10.2" (the project\'s jax) and run with JAX_PLATFORMS=cpu')


def spec_path(kind: str) -> Path:
  """The target-config file of a GPU ``kind`` (``h100``, ``h200``)."""
  return SPECS / GPU_SPECS[kind]


def device_memory_size(text: str) -> int:
  """``gpu_device_info.device_memory_size`` of a target config's text: the device's bytes."""
  match = re.search(r"^\s*device_memory_size:\s*(\d+)", text, re.MULTILINE)
  if match is None:
    raise ValueError("target config has no device_memory_size")
  return int(match.group(1))


def mem_fraction() -> float:
  """``XLA_PYTHON_CLIENT_MEM_FRACTION`` if set (the fraction of each GPU XLA's allocator takes
  at start), else 0.92, what launch/gpu_host.sh sets.

  Raises:
    ValueError: a value that is not a number in (0, 1].
  """
  value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "").strip()
  if not value:
    return DEFAULT_MEM_FRACTION
  try:
    fraction = float(value)
  except ValueError:
    fraction = -1.0
  if not 0 < fraction <= 1:
    raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r}: expected a number in (0, 1]")
  return fraction


def usable_bytes(kind: str) -> int:
  """What a JAX process may use of one ``kind`` GPU: its ``device_memory_size`` x
  :func:`mem_fraction`."""
  return int(device_memory_size(spec_path(kind).read_text()) * mem_fraction())


def gpu_topology(name: str):
  """The devices of ``name``: ``h100:N`` (N GPUs on one host), ``h100:HxG`` (H hosts of G GPUs
  each); likewise ``h200``. Returns a :class:`rft_jax.plan.topology.Topology`.

  ``hbm_bytes`` is what a JAX process may use of each GPU: the device's memory as the CUDA
  driver reports it (the config's ``device_memory_size``: 79.11 GiB for an H100 80GB, 139.8 GiB
  for an H200) x ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (the env var if set, else 0.92, as
  launch/gpu_host.sh sets it): XLA's allocator reserves that fraction at start and the
  programs' buffers must fit in it.

  Raises:
    PlanError: a malformed name, or no CUDA plugin (the message says what to install).
  """
  kind, _, shape = name.partition(":")
  match = re.fullmatch(r"(?:(\d+)x)?(\d+)", shape)
  counts = [int(c) for c in match.groups() if c is not None] if match else []
  if kind not in GPU_SPECS or not counts or min(counts) < 1:
    raise PlanError(f"topology {name!r}: expected {'|'.join(GPU_SPECS)}:N (N GPUs on one host) "
                    f"or {'|'.join(GPU_SPECS)}:HxG (H hosts x G GPUs), N, H, G >= 1")
  hosts, per_host = (1, *counts) if len(counts) == 1 else counts
  try:
    hbm = usable_bytes(kind)
  except ValueError as exc:
    raise PlanError(f"topology {name!r}: {exc}") from exc
  from jax.experimental import topologies

  target_config = spec_path(kind).read_text()
  try:
    desc = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                        topology=f"1x{hosts}x{per_host}")
  except NotImplementedError as exc:  # "topology not implemented for cuda": no plugin registered
    raise PlanError(f"topology {name!r}: {INSTALL}") from exc
  except Exception as exc:
    raise PlanError(f"topology {name!r}: {str(exc).splitlines()[0]} ({INSTALL})") from exc
  return Topology(name, tuple(desc.devices), hbm)
