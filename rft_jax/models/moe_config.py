"""The mixture-of-experts fields of an HF ``config.json`` (``qwen3_moe``, ``qwen2_moe``).

:class:`~rft_jax.models.config.QwenConfig` holds them; this module reads them from and writes
them to the HF dict, and checks what the MoE block (:mod:`rft_jax.models.moe`) implements:

* every decoder layer sparse (``decoder_sparse_step`` 1, ``mlp_only_layers`` empty): the layers
  are stacked and scanned, so a mix of dense and sparse layers is refused, naming the key;
* a softmax router with greedy top-k (``norm_topk_prob`` renormalises the k weights);
* Qwen2-MoE's one shared expert behind a sigmoid gate (``shared_expert_intermediate_size``),
  none for Qwen3-MoE;

and refuses, naming the key and its value, the router and shared-expert features of other MoE
families (grouped or sigmoid routing, scaled weights, several shared experts, jitter noise).
"""

from __future__ import annotations

from typing import Any

from rft_jax.models.errors import CheckpointError

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
ARCHITECTURES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# Keys of other MoE families' configs -> the values that mean what this block does (absent is
# fine too). Anything else is refused at load.
_FEATURES: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("softmax",),
    "topk_method": ("greedy",),
    "router_type": ("softmax",),
    "moe_router_type": ("softmax",),
    "router_activation": ("softmax",),
    "router_jitter_noise": (0, 0.0),
    "routed_scaling_factor": (1, 1.0),
    "n_group": (1,),
    "topk_group": (1,),
    "n_shared_experts": (0,),
    "num_shared_experts": (0,),
    "shared_expert_gate_type": ("sigmoid",),
    "first_k_dense_replace": (0,),
    "moe_layer_freq": (1,),
}


def moe_fields_from_hf(d: dict[str, Any], model_type: str) -> dict[str, Any]:
  """The ``QwenConfig`` keyword arguments of an MoE ``config.json`` (``{}`` for a dense one).

  Raises:
    CheckpointError: a missing or mistyped MoE size, a mix of dense and sparse layers, or a
      router / shared-expert feature the block does not implement; the message names the key.
  """
  if model_type not in MOE_MODEL_TYPES:
    return {}
  for key, accepted in _FEATURES.items():
    if d.get(key) is not None and d[key] not in accepted:
      raise CheckpointError(f"config.json: {key}={d[key]!r} is not implemented (the MoE block "
                            f"routes by softmax and greedy top-k); accepted: {list(accepted)}")
  shared = d.get("shared_expert_intermediate_size")
  if model_type == "qwen3_moe" and shared:
    raise CheckpointError(f"config.json: shared_expert_intermediate_size={shared!r}: qwen3_moe "
                          "has no shared expert (Qwen2-MoE's is model_type 'qwen2_moe')")
  experts = d.get("num_experts", d.get("num_local_experts"))  # Qwen3MoeConfig saves the latter
  fields: dict[str, Any] = {
      "num_experts": experts,
      "num_experts_per_tok": d.get("num_experts_per_tok"),
      "moe_intermediate_size": d.get("moe_intermediate_size"),
  }
  if model_type == "qwen2_moe":
    fields["shared_expert_intermediate_size"] = shared
  for key, value in fields.items():
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise CheckpointError(f"config.json: {key}={value!r} must be a positive integer "
                            f"(model_type {model_type!r})")
  step = d.get("decoder_sparse_step", 1)
  if step != 1:
    raise CheckpointError(f"config.json: decoder_sparse_step={step!r} is not supported: every "
                          "layer must be sparse (the layers are stacked); expected 1")
  dense_layers = d.get("mlp_only_layers") or []
  if dense_layers:
    raise CheckpointError(f"config.json: mlp_only_layers={dense_layers!r} is not supported: "
                          "every layer must be sparse (the layers are stacked); expected []")
  for key in ("norm_topk_prob", "output_router_logits"):
    if not isinstance(d.get(key, False), bool):
      raise CheckpointError(f"config.json: {key}={d[key]!r} must be true or false")
  coef = d.get("router_aux_loss_coef", 0.001)
  if not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0:
    raise CheckpointError(f"config.json: router_aux_loss_coef={coef!r} must be a number >= 0")
  return {**fields, "norm_topk_prob": d.get("norm_topk_prob", False),
          "router_aux_loss_coef": float(coef),
          "output_router_logits": d.get("output_router_logits", False),
          "decoder_sparse_step": 1, "mlp_only_layers": ()}


def moe_fields_to_hf(config) -> dict[str, Any]:
  """The MoE keys of ``config``'s HF ``config.json`` (``{}`` for a dense model)."""
  if not config.is_moe:
    return {}
  d = {
      "num_experts": config.num_experts,
      "num_experts_per_tok": config.num_experts_per_tok,
      "moe_intermediate_size": config.moe_intermediate_size,
      "norm_topk_prob": config.norm_topk_prob,
      "decoder_sparse_step": config.decoder_sparse_step,
      "mlp_only_layers": list(config.mlp_only_layers),
      "router_aux_loss_coef": config.router_aux_loss_coef,
      "output_router_logits": config.output_router_logits,
  }
  if config.model_type == "qwen2_moe":
    d["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
  return d


def check_moe(config) -> None:
  """The MoE fields of a :class:`~rft_jax.models.config.QwenConfig` built in code.

  Raises:
    ValueError: MoE sizes on a dense model type, or sizes / layouts the block cannot run.
  """
  if not config.is_moe:
    if config.num_experts:
      raise ValueError(f"QwenConfig: num_experts={config.num_experts} needs an MoE model_type "
                       f"({', '.join(MOE_MODEL_TYPES)}), not {config.model_type!r}")
    if config.lora is not None and "router" in config.lora.targets:
      raise ValueError(f"model.lora.targets: 'router' on a dense model ({config.model_type!r} has no "
                       "router); target its projections")
    return
  if config.num_experts < 1 or config.moe_intermediate_size < 1:
    raise ValueError(f"QwenConfig: model_type {config.model_type!r} needs num_experts >= 1 "
                     f"and moe_intermediate_size >= 1 (got {config.num_experts}, "
                     f"{config.moe_intermediate_size})")
  if not 1 <= config.num_experts_per_tok <= config.num_experts:
    raise ValueError(f"QwenConfig: num_experts_per_tok={config.num_experts_per_tok} must be in "
                     f"[1, num_experts={config.num_experts}]")
  if config.decoder_sparse_step != 1 or config.mlp_only_layers:
    raise ValueError(f"QwenConfig: decoder_sparse_step={config.decoder_sparse_step}, "
                     f"mlp_only_layers={list(config.mlp_only_layers)}: every layer must be sparse "
                     "(expected 1 and [])")
  has_shared = config.shared_expert_intermediate_size > 0
  if has_shared != (config.model_type == "qwen2_moe"):
    raise ValueError(f"QwenConfig: shared_expert_intermediate_size="
                     f"{config.shared_expert_intermediate_size}: qwen2_moe has one shared expert "
                     "(a positive size), qwen3_moe none (0)")

