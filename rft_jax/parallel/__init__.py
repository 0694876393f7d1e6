"""Device meshes and the mapping of logical parameter axes onto them."""

from rft_jax.parallel.mesh import MESH_AXES, make_mesh
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
)

__all__ = [
    "DEFAULT_RULES", "FSDP_RULES", "MESH_AXES", "Rules", "TP_RULES", "logical_to_spec",
    "make_mesh", "named_sharding", "shard_model", "state_shardings", "tree_shardings",
]
