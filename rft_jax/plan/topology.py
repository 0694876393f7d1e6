"""What capacity planning plans for: a :class:`Topology` (devices and memory per device), and
the :class:`PlanError` a topology or config that cannot be planned raises."""

from __future__ import annotations

import dataclasses

GiB = 1024**3


class PlanError(ValueError):
  """A topology or config that cannot be planned; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Topology:
  """Devices to compile for (possibly not attached to this process) and memory per device."""

  name: str
  devices: tuple
  hbm_bytes: int
