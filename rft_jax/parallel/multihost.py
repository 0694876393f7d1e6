"""Multi-host start-up: one process per host, joined by ``jax.distributed.initialize``.

The launch scripts export ``RFT_JAX_COORDINATOR`` (host:port of process 0),
``RFT_JAX_NUM_PROCESSES`` and ``RFT_JAX_PROCESS_ID``; without them this is a no-op
(single host).
"""

from __future__ import annotations

import os

import jax


def initialize_from_env() -> bool:
  """Calls ``jax.distributed.initialize`` when the launch variables are set; True if it did."""
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
