"""Architecture of a Qwen2 / Qwen2.5 / Qwen3 decoder, dense or mixture-of-experts (Qwen2-MoE,
Qwen3-MoE), read from and written to an HF `config.json`.

One frozen dataclass describes every family; the model reads features (``attention_bias``,
``qk_norm``, ``num_experts``), never family names. The MoE keys are read, written and checked by
:mod:`rft_jax.models.moe_config`. ``from_hf_dict`` accepts the legacy (``rope_theta`` /
``rope_scaling``) and the transformers 5.x (``rope_parameters``) spellings of the RoPE settings
and rejects what the decoder does not implement (scaled RoPE, sliding windows, other
activations) with an error naming the field and its value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from rft_jax.models.errors import CheckpointError
from rft_jax.models.lora import LoraConfig
from rft_jax.models.moe_config import (ARCHITECTURES as MOE_ARCHITECTURES, MOE_MODEL_TYPES,
                                       check_moe, moe_fields_from_hf, moe_fields_to_hf)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3") + MOE_MODEL_TYPES
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", **MOE_ARCHITECTURES}
QWEN_BOS = 151643  # <|endoftext|>
QWEN_EOS = 151645  # <|im_end|>
# Implementations of the causal self-attention (rft_jax.models.attention.causal_self_attention).
ATTENTION_KINDS = ("auto", "blockwise", "cudnn", "splash", "reference")
# Implementations of the sampler's decode step on an accelerator (rft_jax.models.decode.fused_decode).
DECODE_KERNEL_KINDS = ("auto", "xla", "fused", "fused_interpret")
# Dtypes a config names (model.dtype, model.param_dtype, learner.ref_dtype).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class QwenConfig:
  """Shapes and options of the decoder.

  Attributes:
    model_type: ``'qwen2'`` (Qwen2, Qwen2.5), ``'qwen3'``, or their mixture-of-experts forms
      ``'qwen2_moe'`` (Qwen1.5-MoE, Qwen2-MoE) and ``'qwen3_moe'`` (Qwen3-30B-A3B, ...).
    vocab_size: V, rows of the embedding table.
    hidden_size: D, the residual width.
    intermediate_size: F, the SwiGLU width (of dense layers; an MoE model has none, its
      config.json still gives it).
    num_hidden_layers: L.
    num_attention_heads: N query heads.
    num_key_value_heads: K key/value heads; N must be a multiple of K (grouped-query attention).
    head_dim: H; ``hidden_size // num_attention_heads`` unless given (Qwen3 sets it).
    rope_theta: RoPE base; inverse frequencies ``theta ** (-2i / H)``.
    rms_norm_eps: epsilon inside every RMSNorm.
    tie_word_embeddings: the output matrix is the embedding table transposed.
    attention_bias: q/k/v projections carry a bias (always for Qwen2).
    attention_out_bias: the output projection carries a bias (Qwen3 with ``attention_bias``).
    qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3).
    max_position_embeddings: longest context the checkpoint was trained for (informational).
    bos_token_id, eos_token_id: written back to ``config.json`` / ``generation_config.json``.
    dtype: compute dtype of activations and matmuls (norms, RoPE and softmax run in float32).
    param_dtype: storage dtype of the parameters.
    remat: rematerialise each decoder layer in the backward pass.
    attention: the causal self-attention implementation of the full forward and the prefill
      (:data:`ATTENTION_KINDS`; ``auto`` chooses by backend, see
      :func:`rft_jax.models.attention.attention_kind`).
    decode_kernels: the sampler's decode step on an accelerator (:data:`DECODE_KERNEL_KINDS`):
      ``auto`` (five Pallas kernels a layer on one GPU where they take the shapes, else XLA's),
      ``xla``, ``fused`` (:mod:`rft_jax.models.decode.fused_decode`), or ``fused_interpret`` (the same
      kernels in Pallas' interpret mode, on any backend: for tests). It chooses the step on a
      dense KV cache: CPUs decode feature-major (:mod:`rft_jax.models.decode.feature_major`) and a paged
      cache (``sampling.kv_pages``) with its paged attention, whatever this says.
    num_experts: E routed experts per MoE layer (0: a dense model).
    num_experts_per_tok: k experts each token is routed to.
    moe_intermediate_size: I, each expert's SwiGLU width.
    norm_topk_prob: the k routing weights are renormalised to sum to 1 (else the softmax's).
    decoder_sparse_step, mlp_only_layers: which layers are sparse in HF (``(i + 1) % step == 0``
      and ``i`` not listed); only every layer (1 and ``()``) is supported.
    router_aux_loss_coef: weight of the load-balancing loss
      (:func:`rft_jax.models.moe.load_balancing_loss`) in HF's training loss.
    output_router_logits: HF's switch to return the router logits (written back as read).
    shared_expert_intermediate_size: the width of Qwen2-MoE's shared expert, gated by a sigmoid
      (0: none, as Qwen3-MoE).
    lora: LoRA adapters on the projections (:class:`~rft_jax.models.lora.LoraConfig`); None:
      none. Not part of the architecture: ``config.json`` never holds it (an export merges the
      adapters, :mod:`rft_jax.models.lora_model`).
  """

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int | None = None
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  attention_bias: bool | None = None
  attention_out_bias: bool | None = None
  qk_norm: bool | None = None
  max_position_embeddings: int = 32768
  bos_token_id: int | None = QWEN_BOS
  eos_token_id: int | tuple[int, ...] | None = QWEN_EOS
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  remat: bool = False
  attention: str = "auto"
  decode_kernels: str = "auto"
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  router_aux_loss_coef: float = 0.001
  output_router_logits: bool = False
  shared_expert_intermediate_size: int = 0
  lora: LoraConfig | None = None

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise CheckpointError(
          f"config.json: unsupported model_type {self.model_type!r}; "
          f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    qwen3 = self.family == "qwen3"
    defaults = {
        "head_dim": self.hidden_size // self.num_attention_heads,
        "attention_bias": not qwen3,
        "attention_out_bias": bool(qwen3 and self.attention_bias),
        "qk_norm": qwen3,
    }
    for name, value in defaults.items():
      if getattr(self, name) is None:
        object.__setattr__(self, name, value)
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
    if self.attention not in ATTENTION_KINDS:
      raise ValueError(f"QwenConfig: attention={self.attention!r} is not one of {ATTENTION_KINDS}")
    if self.decode_kernels not in DECODE_KERNEL_KINDS:
      raise ValueError(f"QwenConfig: decode_kernels={self.decode_kernels!r} is not one of "
                       f"{DECODE_KERNEL_KINDS}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"num_attention_heads={self.num_attention_heads} is not a multiple of "
          f"num_key_value_heads={self.num_key_value_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    # What Hugging Face can represent: Qwen2 hard-codes q/k/v biases (Qwen2-MoE has a switch,
    # qkv_bias), Qwen3 has one switch for all four projections and always normalises q and k.
    if qwen3:
      family = {"qk_norm": True, "attention_out_bias": self.attention_bias}
    elif self.is_moe:
      family = {"qk_norm": False, "attention_out_bias": False}
    else:
      family = {"qk_norm": False, "attention_bias": True, "attention_out_bias": False}
    for name, want in family.items():
      if getattr(self, name) != want:
        raise ValueError(
            f"QwenConfig: {name}={getattr(self, name)} is not expressible for model_type "
            f"{self.model_type!r} (expected {want})")
    check_moe(self)

  # --------------------------------------------------------------------------------------------
  # Derived sizes.

  @property
  def family(self) -> str:
    """``'qwen2'`` or ``'qwen3'``: the attention's family (an MoE model type without ``_moe``)."""
    return self.model_type.removesuffix("_moe")

  @property
  def is_moe(self) -> bool:
    """The decoder's feed-forward blocks are mixtures of experts (:mod:`rft_jax.models.moe`)."""
    return self.model_type in MOE_MODEL_TYPES

  @property
  def num_groups(self) -> int:
    """G = N / K query heads per key/value head."""
    return self.num_attention_heads // self.num_key_value_heads

  def replace(self, **changes) -> QwenConfig:
    """A copy with ``changes`` applied (e.g. ``dtype``, ``remat``)."""
    return dataclasses.replace(self, **changes)

  # --------------------------------------------------------------------------------------------
  # Hugging Face config.json.

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], **runtime) -> QwenConfig:
    """Builds the config from a parsed HF ``config.json``.

    Args:
      d: the dict.
      **runtime: ``dtype``, ``param_dtype``, ``remat``, ``attention``, ``decode_kernels``.

    Raises:
      CheckpointError: not a JSON object, a missing or mistyped size, or an unsupported
      ``model_type``, RoPE scaling kind, sliding window or activation; or sizes the decoder
      cannot use (heads not a multiple of key/value heads, an odd head dimension); MoE keys
      the block does not implement (:func:`~rft_jax.models.moe_config.moe_fields_from_hf`).
    """
    if not isinstance(d, dict):
      raise CheckpointError(f"config.json: the top level must be a JSON object, not a {type(d).__name__}")
    if runtime.get("attention", "auto") not in ATTENTION_KINDS:  # a runtime option, not the file's
      raise ValueError(f"QwenConfig: attention={runtime['attention']!r} is not one of {ATTENTION_KINDS}")
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise CheckpointError(
          f"config.json: unsupported model_type {model_type!r}; "
          f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    missing = [key for key in _REQUIRED_SIZES if key not in d]
    if missing:
      raise CheckpointError(f"config.json: missing key(s) {', '.join(missing)} (sizes of the model)")
    for key in _REQUIRED_SIZES + _OPTIONAL_SIZES:
      value = d.get(key)
      if key in d and value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                             or value < 1):
        raise CheckpointError(f"config.json: {key}={value!r} must be a positive integer")
    try:
      return cls._from_checked_dict(d, **runtime)
    except CheckpointError:
      raise
    except (ValueError, TypeError, AttributeError) as exc:  # a mistyped value; __post_init__
      raise CheckpointError(f"config.json: {exc}") from exc

  @classmethod
  def _from_checked_dict(cls, d: dict[str, Any], **runtime) -> QwenConfig:
    model_type = d["model_type"]
    rope_theta = _rope_theta(d)
    if d.get("use_sliding_window"):
      raise CheckpointError(
          "config.json: use_sliding_window=true is not supported (sliding_window="
          f"{d.get('sliding_window')!r}); only full attention is implemented")
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise CheckpointError(f"config.json: unsupported hidden_act {act!r}; expected 'silu'")
    heads = d["num_attention_heads"]
    family = model_type.removesuffix("_moe")
    if model_type == "qwen2_moe":
      attention_bias = bool(d.get("qkv_bias", True))
    else:
      attention_bias = True if family == "qwen2" else bool(d.get("attention_bias", False))
    return cls(
        model_type=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        attention_out_bias=family == "qwen3" and attention_bias,
        qk_norm=family == "qwen3",
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        **moe_fields_from_hf(d, model_type),
        **runtime,
    )

  def to_hf_dict(self) -> dict[str, Any]:
    """The HF ``config.json`` dict (transformers 5.x spelling, plus legacy ``rope_theta``)."""
    d: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[self.model_type]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": self.max_position_embeddings,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        "tie_word_embeddings": self.tie_word_embeddings,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": (list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                         else self.eos_token_id),
        "dtype": self.param_dtype.name,
        "torch_dtype": self.param_dtype.name,
        "use_cache": True,
    }
    if self.family == "qwen3":
      d["attention_bias"] = self.attention_bias
    elif self.is_moe:
      d["qkv_bias"] = self.attention_bias
    return {**d, **moe_fields_to_hf(self)}

  # --------------------------------------------------------------------------------------------
  # Presets: the published Hugging Face configs.

  @classmethod
  def qwen2_5_0_5b(cls, **runtime) -> QwenConfig:
    """Qwen/Qwen2.5-0.5B(-Instruct)."""
    return cls("qwen2", 151936, 896, 4864, 24, 14, 2, tie_word_embeddings=True, **runtime)

  @classmethod
  def qwen2_5_1_5b(cls, **runtime) -> QwenConfig:
    """Qwen/Qwen2.5-1.5B(-Instruct)."""
    return cls("qwen2", 151936, 1536, 8960, 28, 12, 2, tie_word_embeddings=True, **runtime)

  @classmethod
  def qwen2_5_7b(cls, **runtime) -> QwenConfig:
    """Qwen/Qwen2.5-7B(-Instruct)."""
    return cls("qwen2", 152064, 3584, 18944, 28, 28, 4, tie_word_embeddings=False, **runtime)

  @classmethod
  def qwen3_4b(cls, **runtime) -> QwenConfig:
    """Qwen/Qwen3-4B."""
    return cls("qwen3", 151936, 2560, 9728, 36, 32, 8, head_dim=128, tie_word_embeddings=True,
               max_position_embeddings=40960, **runtime)

  @classmethod
  def qwen3_30b_a3b(cls, **runtime) -> QwenConfig:
    """Qwen/Qwen3-30B-A3B: 48 MoE layers of 128 experts, 8 per token (3B active parameters)."""
    return cls("qwen3_moe", 151936, 2048, 6144, 48, 32, 4, head_dim=128,
               max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
               moe_intermediate_size=768, norm_topk_prob=True, **runtime)


# Sizes config.json must give (positive integers), and those it may give.
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def _rope_theta(d: dict[str, Any]) -> float:
  """RoPE base from either spelling; only unscaled ('default') RoPE is accepted."""
  params = d.get("rope_parameters") or {}
  scaling = d.get("rope_scaling") or {}
  for field, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind != "default":
      raise CheckpointError(
          f"config.json: unsupported {field} kind {kind!r} ({spec}); only unscaled "
          "('default') RoPE is implemented")
  theta = params.get("rope_theta", d.get("rope_theta"))
  return 10000.0 if theta is None else theta
