"""Device meshes, the mapping of logical parameter axes onto them, and the host <-> global
array boundary of multi-process runs."""

from rft_jax.parallel.mesh import (DATA_AXIS, MESH_AXES, MODEL_AXIS, axis_if_divides, first_device, make_mesh,
                                   mesh_of, platform_of)
from rft_jax.parallel.multihost import global_array, host_array, is_main_process, sync_processes
from rft_jax.parallel.sharding import (
    DEFAULT_RULES,
    FSDP_RULES,
    TP_RULES,
    Rules,
    logical_to_spec,
    named_sharding,
    shard_model,
    state_shardings,
    tree_shardings,
    with_shardings,
)

__all__ = [
    "DATA_AXIS", "DEFAULT_RULES", "FSDP_RULES", "MESH_AXES", "MODEL_AXIS", "Rules", "TP_RULES",
    "axis_if_divides", "first_device", "global_array", "host_array", "is_main_process", "logical_to_spec",
    "make_mesh", "mesh_of", "named_sharding", "platform_of", "shard_model",
    "state_shardings", "sync_processes", "tree_shardings", "with_shardings",
]
