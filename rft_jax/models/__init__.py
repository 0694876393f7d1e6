"""Qwen2 / Qwen2.5 / Qwen3 in Flax NNX, and conversion from and to Hugging Face checkpoints."""

from rft_jax.models.config import QwenConfig
from rft_jax.models.errors import CheckpointError
from rft_jax.models.hf import abstract_model, load_hf, read_config, save_hf
from rft_jax.models.kv_cache import KVCache, init_cache
from rft_jax.models.model import Qwen, positions_from_mask
from rft_jax.models.tokenizer import apply_chat_template, chat_token_ids, load_tokenizer

__all__ = [
    "CheckpointError", "KVCache", "Qwen", "QwenConfig", "abstract_model", "apply_chat_template",
    "chat_token_ids", "init_cache", "load_hf", "load_tokenizer", "positions_from_mask",
    "read_config", "save_hf",
]
