"""Tiny random Hugging Face Qwen3-MoE / Qwen2-MoE checkpoints (no downloads), as
:mod:`tests.hf_fixtures` builds the dense ones: every tensor random (norm scales around 1), the
router's included, so that a wrong mapping or routing shows in the logits."""

from __future__ import annotations

from pathlib import Path

from tests.hf_fixtures import _quiet_transformers, random_weights


def tiny_moe_hf_config(family: str = "qwen3_moe", *, hidden: int = 64, layers: int = 2,
                       vocab: int = 256, experts: int = 8, top_k: int = 2,
                       moe_intermediate: int = 32, norm_topk_prob: bool = True,
                       shared_intermediate: int = 48, tie: bool = False, **extra):
  """A transformers ``Qwen3MoeConfig`` / ``Qwen2MoeConfig`` of toy size (4 heads, 2 KV heads)."""
  from transformers import Qwen2MoeConfig, Qwen3MoeConfig

  common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=96,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                tie_word_embeddings=tie, rms_norm_eps=1e-6, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=moe_intermediate, norm_topk_prob=norm_topk_prob,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **extra)
  if family == "qwen3_moe":
    return Qwen3MoeConfig(head_dim=hidden // 4, **common)
  if family == "qwen2_moe":
    return Qwen2MoeConfig(shared_expert_intermediate_size=shared_intermediate, **common)
  raise ValueError(f"unknown MoE family {family!r}")


def make_tiny_moe(root: Path, family: str = "qwen3_moe", *, seed: int = 0,
                  max_shard_size: str | None = None, **config_kw) -> Path:
  """Saves a random tiny MoE checkpoint (float32) under ``root`` and returns its directory."""
  import torch
  from transformers import AutoModelForCausalLM

  _quiet_transformers()
  config = tiny_moe_hf_config(family, **config_kw)
  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  random_weights(model, unit_scale=("mlp.gate.weight",))  # router logits of order 1: distinct top-k
  name = f"{family}_s{seed}_" + "_".join(f"{k}{v}" for k, v in sorted(config_kw.items()))
  out = Path(root) / (name + (f"_{max_shard_size}" if max_shard_size else ""))
  model.save_pretrained(out, **({} if max_shard_size is None else
                                {"max_shard_size": max_shard_size}))
  return out
