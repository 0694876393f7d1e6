"""Token methods: what chooses, once per train step, which tokens the loss keeps (a registry).

Importing this package registers every method shipped with rft_jax; a method of one's own is
registered by importing its module (``rft_jax.rl.token_methods.registry``).
"""

from rft_jax.rl.token_methods import cov_methods
from rft_jax.rl.token_methods import entropy_masks
from rft_jax.rl.token_methods import entropy_target
from rft_jax.rl.token_methods import forking
from rft_jax.rl.token_methods.entropy_masks import OutlierMask
from rft_jax.rl.token_methods.entropy_masks import mask_scores
from rft_jax.rl.token_methods.entropy_target import TARGET_MU_GRID
from rft_jax.rl.token_methods.registry import TOKEN_METHODS
from rft_jax.rl.token_methods.registry import TokenChoice
from rft_jax.rl.token_methods.registry import TokenInputs
from rft_jax.rl.token_methods.registry import TokenMethod
from rft_jax.rl.token_methods.registry import entropy_keep_mask
from rft_jax.rl.token_methods.registry import method_class
from rft_jax.rl.token_methods.registry import method_names
from rft_jax.rl.token_methods.registry import register_token_method
from rft_jax.rl.token_methods.registry import configured_class
from rft_jax.rl.token_methods.registry import configured_method

__all__ = [
    "TARGET_MU_GRID",
    "TOKEN_METHODS",
    "OutlierMask",
    "TokenChoice",
    "TokenInputs",
    "TokenMethod",
    "configured_class",
    "configured_method",
    "cov_methods",
    "entropy_keep_mask",
    "entropy_masks",
    "entropy_target",
    "forking",
    "mask_scores",
    "method_class",
    "method_names",
    "register_token_method",
]
