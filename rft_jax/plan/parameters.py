r"""What a plan's parameters are: how many, how many a token uses, and where they live.

A mixture-of-experts model (:mod:`rft_jax.models.moe`) holds every expert's weights but sends each
token through ``k`` of its ``E`` routed experts, so its parameters per token are fewer than its
parameters:

.. math:: P_\mathrm{active} = P - \frac{E - k}{E}\, P_\mathrm{experts},

with :math:`P_\mathrm{experts}` the routed experts' stacked weights (``[E, D, I]`` and
``[E, I, D]`` per layer). Everything else counts in full: attention, the router, Qwen2-MoE's
shared expert and its gate, the norms, and the embedding and unembedding tables (the convention
of Qwen's model cards: Qwen3-30B-A3B has 30.5B parameters, 3.3B activated). A dense model's two
counts are equal. Model FLOPs of a token (forward and backward) are about
:math:`6 P_\mathrm{active}` less the embedding table's share, not :math:`6 P`.

The parameters are counted from the abstract model state itself (the shapes the compiled programs
take), grouped by their logical axis names (:mod:`rft_jax.parallel.sharding`), each group with its
bytes per device under the mesh's shardings: the routed experts' should be their bytes over
``data x model`` (experts over ``model``, the hidden width over ``data``).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from rft_jax.parallel.sharding import variable_axes

# Groups of parameters by a logical axis name they carry (the first that matches wins).
GROUPS = (("routed experts", "experts"), ("router", "router"),
          ("embedding and unembedding", "vocab"), ("attention", "heads"),
          ("attention", "kv_heads"), ("MLP and shared expert", "mlp"))
OTHER = "norms and gates"


def parameter_group(axes: tuple[str | None, ...] | None) -> str:
  """The group of a parameter with logical ``axes`` (:data:`GROUPS`; :data:`OTHER` if none)."""
  names = set(axes or ())
  return next((group for group, name in GROUPS if name in names), OTHER)


def parameter_report(state: nnx.State, config) -> dict[str, Any]:
  r"""Counts and per-device bytes of ``state``'s parameters (``nnx.Param``, LoRA adapters
  included), abstract or concrete, laid out with shardings (``jax.ShapeDtypeStruct`` leaves
  carrying a ``NamedSharding``).

  Returns:
    ``parameters``: every parameter; ``active_parameters``: those one token's forward uses (the
    module docstring's :math:`P_\mathrm{active}`; equal for a dense model); ``groups``: by name,
    ``parameters``, ``bytes`` (all devices' worth, once), ``bytes_per_device`` (the largest
    shard of each array, summed) and ``specs`` (the distinct ``PartitionSpec`` strings).
  """
  groups: dict[str, dict[str, Any]] = {}
  for _, variable in nnx.to_flat_state(nnx.filter_state(state, nnx.Param)):
    x = variable.get_value()
    group = groups.setdefault(parameter_group(variable_axes(variable)),
                              {"parameters": 0, "bytes": 0, "bytes_per_device": 0, "specs": []})
    size, itemsize = int(np.prod(x.shape)), jnp.dtype(x.dtype).itemsize
    group["parameters"] += size
    group["bytes"] += size * itemsize
    sharding = getattr(x, "sharding", None)
    shard = x.shape if sharding is None else sharding.shard_shape(x.shape)
    group["bytes_per_device"] += int(np.prod(shard)) * itemsize
    spec = str(getattr(sharding, "spec", None))
    if spec not in group["specs"]:
      group["specs"].append(spec)
  total = sum(g["parameters"] for g in groups.values())
  experts = groups.get("routed experts", {}).get("parameters", 0)
  unused = 0 if not experts else (
      experts * (config.num_experts - config.num_experts_per_tok) // config.num_experts)
  return {"parameters": total, "active_parameters": total - unused, "groups": groups}
