"""Multi-host start-up and the host <-> global-array boundary.

One process runs per host, joined by ``jax.distributed.initialize``. The GPU launch scripts
export ``RFT_JAX_COORDINATOR`` (host:port of process 0), ``RFT_JAX_NUM_PROCESSES`` and
``RFT_JAX_PROCESS_ID``; ``launch/tpu_vm.sh`` exports ``RFT_JAX_DISTRIBUTED=tpu`` instead (on a
TPU VM, jax finds the coordinator and the hosts from the VM's metadata). Without either,
:func:`initialize_from_env` is a no-op (single host).

Every process holds the same full host batch (prompts come from the same seeded stream, rewards
are computed from the full gathered rollouts), so inputs become global arrays with
:func:`global_array` (each process fills only its own devices' shards) and outputs come back as
full numpy arrays with :func:`host_array` (a gather across processes when some shards live on
other hosts). Both are correct, and cheap, on one process too. Both are collective in the sense
that every process must make the same calls in the same order.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding


def initialize_from_env() -> bool:
  """Calls ``jax.distributed.initialize`` when the launch variables are set; True if it did."""
  if os.environ.get("RFT_JAX_DISTRIBUTED") == "tpu":
    jax.distributed.initialize()
    return True
  coordinator = os.environ.get("RFT_JAX_COORDINATOR")
  if not coordinator:
    return False
  missing = [v for v in ("RFT_JAX_NUM_PROCESSES", "RFT_JAX_PROCESS_ID") if v not in os.environ]
  if missing:
    raise RuntimeError(f"RFT_JAX_COORDINATOR is set but {', '.join(missing)} is not")
  jax.distributed.initialize(coordinator_address=coordinator,
                             num_processes=int(os.environ["RFT_JAX_NUM_PROCESSES"]),
                             process_id=int(os.environ["RFT_JAX_PROCESS_ID"]))
  return True


def is_main_process() -> bool:
  """True on process 0, the one that writes logs, plots and progress bars."""
  return jax.process_index() == 0


def global_array(x: Any, sharding: Sharding) -> jax.Array:
  """A global ``jax.Array`` with ``sharding`` holding ``x``, the same full value on every process.

  Args:
    x: ``[...]`` a numpy array (or anything ``np.asarray`` takes), or a ``jax.Array``; on several
      processes it must hold the same value on each (only the shards of this process's devices
      are read from it).
    sharding: the target sharding, possibly over devices of other processes.

  Returns:
    ``[...]`` the array, laid out with ``sharding`` (``x`` itself when it already is); host
    values get JAX's canonical dtype (int64 -> int32 without x64).
  """
  if isinstance(x, jax.Array):
    if x.sharding == sharding:
      return x
    if not x.is_fully_addressable or jax.process_count() == 1:
      return jax.device_put(x, sharding)  # a device-to-device reshard
  x = np.asarray(x)
  x = x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def host_array(x: Any) -> np.ndarray:
  """The full value of ``x`` as a numpy array on this process.

  Args:
    x: ``[...]`` a ``jax.Array`` (possibly with shards on other processes' devices) or a host
      value. When ``x`` is sharded over several processes this is a collective: every process
      must call it.

  Returns:
    ``[...]`` numpy array with the global shape.
  """
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def sync_processes(name: str) -> None:
  """Waits until every process has reached ``name`` (nothing to wait for on one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
