"""GPU topologies for `rft-jax plan` (rft_jax/plan/gpu_topology.py) without the CUDA plugin.

The suite's venv has no CUDA plugin, so naming a GPU topology must say what to install; the
target configs under rft_jax/plan/gpu_specs/ must parse as GpuTargetConfigProto text. (With the
plugin, `rft-jax plan --topology h100:8` compiles for 8 H100s: see the module docstring.)
"""

from __future__ import annotations

import importlib.util

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

from rft_jax.plan import gpu_topology as gt
from rft_jax.plan.devices import topology
from rft_jax.plan.topology import PlanError

F = descriptor_pb2.FieldDescriptorProto
# The part of stream_executor.GpuTargetConfigProto (xla/stream_executor/device_description.proto)
# that the specs use, with its field numbers: a field the compiler does not know, or a value of
# the wrong type, fails to parse here as it would in XLA.
SCHEMA = {
    "CudaComputeCapabilityProto": [("major", 1, F.TYPE_INT32), ("minor", 2, F.TYPE_INT32),
                                   ("feature_extension", 3, "FeatureExtension")],
    "GpuDeviceInfoProto": [
        ("threads_per_block_limit", 1, F.TYPE_INT32), ("threads_per_warp", 2, F.TYPE_INT32),
        ("shared_memory_per_block", 3, F.TYPE_INT32), ("shared_memory_per_core", 4, F.TYPE_INT32),
        ("threads_per_core_limit", 5, F.TYPE_INT32), ("core_count", 6, F.TYPE_INT32),
        ("fpus_per_core", 7, F.TYPE_INT64), ("block_dim_limit_x", 8, F.TYPE_INT64),
        ("block_dim_limit_y", 9, F.TYPE_INT64), ("block_dim_limit_z", 10, F.TYPE_INT64),
        ("memory_bandwidth", 11, F.TYPE_INT64), ("l2_cache_size", 12, F.TYPE_INT64),
        ("clock_rate_ghz", 13, F.TYPE_FLOAT), ("device_memory_size", 14, F.TYPE_INT64),
        ("shared_memory_per_block_optin", 15, F.TYPE_INT32),
        ("cuda_compute_capability", 16, "CudaComputeCapabilityProto"),
        ("registers_per_core_limit", 18, F.TYPE_INT64),
        ("registers_per_block_limit", 19, F.TYPE_INT64), ("thread_dim_limit_x", 37, F.TYPE_INT64),
        ("thread_dim_limit_y", 38, F.TYPE_INT64), ("thread_dim_limit_z", 39, F.TYPE_INT64)],
    "GpuTargetConfigProto": [("gpu_device_info", 1, "GpuDeviceInfoProto"),
                             ("device_description_str", 7, F.TYPE_STRING)],
}


def _target_config_class():
  file = descriptor_pb2.FileDescriptorProto(name="gpu_target_config_subset.proto",
                                            package="stream_executor", syntax="proto3")
  enum = file.enum_type.add(name="FeatureExtension")
  for number, value in enumerate(("NONE", "ACCELERATED_FEATURES", "FAMILY_COMPATIBLE_FEATURES")):
    enum.value.add(name=value, number=number)
  for message, fields in SCHEMA.items():
    proto = file.message_type.add(name=message)
    for name, number, kind in fields:
      field = proto.field.add(name=name, number=number, label=F.LABEL_OPTIONAL)
      if isinstance(kind, str):
        field.type = F.TYPE_ENUM if kind == "FeatureExtension" else F.TYPE_MESSAGE
        field.type_name = f".stream_executor.{kind}"
      else:
        field.type = kind
  pool = descriptor_pool.DescriptorPool()
  pool.Add(file)
  return message_factory.GetMessageClass(
      pool.FindMessageTypeByName("stream_executor.GpuTargetConfigProto"))


def _has_cuda_plugin() -> bool:
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no jax_plugins package at all
    return False


def test_gpu_topology_without_the_cuda_plugin_says_what_to_install():
  for name, devices in (("h100:8", 8), ("h100:2x8", 16), ("h200:4", 4)):
    if _has_cuda_plugin():  # a GPU venv (JAX_PLATFORMS=cpu, tests/conftest.py): it works
      topo = topology(name)
      assert len(topo.devices) == devices and topo.devices[0].device_kind.startswith("NVIDIA H")
      continue
    with pytest.raises(PlanError) as error:
      topology(name)
    message = str(error.value)
    assert name in message and "\n" not in message
    assert 'pip install "jax[cuda12]==0.10.2"' in message and "JAX_PLATFORMS=cpu" in message


@pytest.mark.parametrize("name", ["h100:0", "h100:x", "h100:", "h100:2x0", "h100:1x2x3",
                                  "h200:-1", "h100x:8"])
def test_bad_gpu_topology_names(name):
  with pytest.raises(PlanError, match="expected h100"):
    topology(name)
  with pytest.raises(PlanError, match="expected h100"):
    gt.gpu_topology(name)


@pytest.mark.parametrize("kind,gib", [("h100", 79.11), ("h200", 139.80)])
def test_specs_parse_and_give_the_usable_memory(kind, gib, monkeypatch):
  text = gt.spec_path(kind).read_text()
  config = text_format.Parse(text, _target_config_class()())
  info = config.gpu_device_info
  assert info.cuda_compute_capability.major == 9 and info.core_count == 132
  # Unset (0), each of these made XLA's compiler divide by zero, crash on a sort, or fail.
  for field in ("threads_per_warp", "threads_per_block_limit", "block_dim_limit_x",
                "shared_memory_per_block_optin"):
    assert getattr(info, field) > 0, field
  assert config.device_description_str.startswith(f"NVIDIA {kind.upper()}")
  size = info.device_memory_size
  assert gt.device_memory_size(text) == size and round(size / 2**30, 2) == gib
  # hbm_bytes: the device's memory x XLA_PYTHON_CLIENT_MEM_FRACTION (launch/gpu_host.sh: 0.92).
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  assert gt.usable_bytes(kind) == int(size * 0.92)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  assert gt.usable_bytes(kind) == size // 2
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.5")
  with pytest.raises(PlanError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
    gt.gpu_topology(f"{kind}:8")
