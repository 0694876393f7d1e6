r"""The one table that knows Hugging Face tensor names, and how each maps onto the NNX state.

Each :class:`KeyRule` pairs an HF name template (``{layer}`` stands for the layer index,
``{expert}`` for an MoE layer's expert) with the path of the NNX parameter, the HF shape, and the
axis permutation applied before reshaping to the NNX shape. Per-layer NNX parameters are
stacked: HF ``model.layers.3.*`` is row 3 of the NNX array, and an expert's
``model.layers.3.mlp.experts.5.up_proj.weight`` is row ``[3, 5]`` of the stacked experts
``[L, E, D, I]`` (transformers 5 saves each expert's projections apart, as the Hub's
checkpoints hold them). :func:`to_nnx` and :func:`to_hf` are exact inverses (a permutation and a reshape), so
load -> save -> load is bitwise lossless.

HF ``nn.Linear`` weights are ``[out, in]``; NNX kernels are ``[in, ...out]`` split into heads,
e.g. ``q_proj.weight [N*H, D]`` -> transpose -> ``[D, N*H]`` -> reshape -> ``[D, N, H]``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Iterator

import numpy as np

from rft_jax.models.config import QwenConfig

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class KeyRule:
  """One HF tensor (per layer when the template has ``{layer}``).

  Attributes:
    hf: HF name template (``{layer}``, ``{expert}``).
    nnx: path of the parameter in ``nnx.state(model)``.
    hf_shape: the HF tensor shape for a config.
    perm: axes permutation from HF to NNX order before the reshape (``None``: none).
    when: whether the config has this tensor.
  """

  hf: str
  nnx: tuple[str, ...]
  hf_shape: Callable[[QwenConfig], Shape]
  perm: tuple[int, ...] | None = None
  when: Callable[[QwenConfig], bool] = lambda c: True

  @property
  def per_layer(self) -> bool:
    return "{layer}" in self.hf

  @property
  def per_expert(self) -> bool:
    return "{expert}" in self.hf

  @property
  def pattern(self) -> re.Pattern:
    escaped = re.escape(self.hf)
    for field in ("{layer}", "{expert}"):
      escaped = escaped.replace(re.escape(field), r"(\d+)")
    return re.compile(escaped + r"\Z")


def _layer(name: str) -> str:
  return "model.layers.{layer}." + name


def _dense(c: QwenConfig) -> bool:
  return not c.is_moe


def _shared(c: QwenConfig) -> bool:
  return c.shared_expert_intermediate_size > 0


_ATTN = ("layers", "attn")
_MOE = ("layers", "mlp")
KEY_RULES: tuple[KeyRule, ...] = (
    KeyRule("model.embed_tokens.weight", ("embed_tokens",),
            lambda c: (c.vocab_size, c.hidden_size)),
    KeyRule("model.norm.weight", ("norm", "scale"), lambda c: (c.hidden_size,)),
    KeyRule("lm_head.weight", ("lm_head",), lambda c: (c.vocab_size, c.hidden_size), (1, 0),
            when=lambda c: not c.tie_word_embeddings),
    KeyRule(_layer("input_layernorm.weight"), ("layers", "input_layernorm", "scale"),
            lambda c: (c.hidden_size,)),
    KeyRule(_layer("post_attention_layernorm.weight"),
            ("layers", "post_attention_layernorm", "scale"), lambda c: (c.hidden_size,)),
    KeyRule(_layer("self_attn.q_proj.weight"), _ATTN + ("q_proj",),
            lambda c: (c.num_attention_heads * c.head_dim, c.hidden_size), (1, 0)),
    KeyRule(_layer("self_attn.k_proj.weight"), _ATTN + ("k_proj",),
            lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size), (1, 0)),
    KeyRule(_layer("self_attn.v_proj.weight"), _ATTN + ("v_proj",),
            lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size), (1, 0)),
    KeyRule(_layer("self_attn.o_proj.weight"), _ATTN + ("o_proj",),
            lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim), (1, 0)),
    KeyRule(_layer("self_attn.q_proj.bias"), _ATTN + ("q_bias",),
            lambda c: (c.num_attention_heads * c.head_dim,), when=lambda c: c.attention_bias),
    KeyRule(_layer("self_attn.k_proj.bias"), _ATTN + ("k_bias",),
            lambda c: (c.num_key_value_heads * c.head_dim,), when=lambda c: c.attention_bias),
    KeyRule(_layer("self_attn.v_proj.bias"), _ATTN + ("v_bias",),
            lambda c: (c.num_key_value_heads * c.head_dim,), when=lambda c: c.attention_bias),
    KeyRule(_layer("self_attn.o_proj.bias"), _ATTN + ("o_bias",),
            lambda c: (c.hidden_size,), when=lambda c: c.attention_out_bias),
    KeyRule(_layer("self_attn.q_norm.weight"), _ATTN + ("q_norm", "scale"),
            lambda c: (c.head_dim,), when=lambda c: c.qk_norm),
    KeyRule(_layer("self_attn.k_norm.weight"), _ATTN + ("k_norm", "scale"),
            lambda c: (c.head_dim,), when=lambda c: c.qk_norm),
    KeyRule(_layer("mlp.gate_proj.weight"), ("layers", "mlp", "gate_proj"),
            lambda c: (c.intermediate_size, c.hidden_size), (1, 0), when=_dense),
    KeyRule(_layer("mlp.up_proj.weight"), ("layers", "mlp", "up_proj"),
            lambda c: (c.intermediate_size, c.hidden_size), (1, 0), when=_dense),
    KeyRule(_layer("mlp.down_proj.weight"), ("layers", "mlp", "down_proj"),
            lambda c: (c.hidden_size, c.intermediate_size), (1, 0), when=_dense),
    # Mixture of experts (rft_jax.models.moe): the router, the experts, the shared expert.
    KeyRule(_layer("mlp.gate.weight"), _MOE + ("router",),
            lambda c: (c.num_experts, c.hidden_size), (1, 0), when=lambda c: c.is_moe),
    KeyRule(_layer("mlp.experts.{expert}.gate_proj.weight"), _MOE + ("expert_gate",),
            lambda c: (c.moe_intermediate_size, c.hidden_size), (1, 0), when=lambda c: c.is_moe),
    KeyRule(_layer("mlp.experts.{expert}.up_proj.weight"), _MOE + ("expert_up",),
            lambda c: (c.moe_intermediate_size, c.hidden_size), (1, 0), when=lambda c: c.is_moe),
    KeyRule(_layer("mlp.experts.{expert}.down_proj.weight"), _MOE + ("expert_down",),
            lambda c: (c.hidden_size, c.moe_intermediate_size), (1, 0), when=lambda c: c.is_moe),
    KeyRule(_layer("mlp.shared_expert.gate_proj.weight"), _MOE + ("shared_expert", "gate_proj"),
            lambda c: (c.shared_expert_intermediate_size, c.hidden_size), (1, 0), when=_shared),
    KeyRule(_layer("mlp.shared_expert.up_proj.weight"), _MOE + ("shared_expert", "up_proj"),
            lambda c: (c.shared_expert_intermediate_size, c.hidden_size), (1, 0), when=_shared),
    KeyRule(_layer("mlp.shared_expert.down_proj.weight"), _MOE + ("shared_expert", "down_proj"),
            lambda c: (c.hidden_size, c.shared_expert_intermediate_size), (1, 0), when=_shared),
    KeyRule(_layer("mlp.shared_expert_gate.weight"), _MOE + ("shared_expert_gate",),
            lambda c: (1, c.hidden_size), when=_shared),
)

# Names a checkpoint may carry that the decoder recomputes or shares: RoPE buffers of old
# exports, and lm_head.weight of tied models (some exports write the shared matrix twice).
_IGNORED = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq\Z"),)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One concrete HF tensor: its name, rule, layer (``None`` if not per layer), expert
  (``None`` if not per expert) and shape."""

  name: str
  rule: KeyRule
  layer: int | None
  hf_shape: Shape
  expert: int | None = None

  @property
  def index(self) -> tuple[int, ...]:
    """Where the tensor lies in its stacked NNX parameter: ``()``, ``(layer,)`` or
    ``(layer, expert)``."""
    return tuple(i for i in (self.layer, self.expert) if i is not None)


def expected_tensors(config: QwenConfig) -> dict[str, TensorSpec]:
  """Every HF tensor a checkpoint of ``config`` holds, by name, in table order."""
  out: dict[str, TensorSpec] = {}
  for rule in KEY_RULES:
    if not rule.when(config):
      continue
    layers: Iterator[int | None] = (iter(range(config.num_hidden_layers)) if rule.per_layer
                                    else iter([None]))
    for layer in layers:
      for expert in range(config.num_experts) if rule.per_expert else [None]:
        name = rule.hf.format(layer=layer, expert=expert)
        out[name] = TensorSpec(name, rule, layer, tuple(rule.hf_shape(config)), expert)
  return out


def is_ignored(name: str, config: QwenConfig) -> bool:
  """A checkpoint tensor that loading skips without complaint."""
  if name == "lm_head.weight" and config.tie_word_embeddings:
    return True
  return any(p.match(name) for p in _IGNORED)


def _transpose(x: np.ndarray, perm, block: int = 128) -> np.ndarray:
  """A contiguous transpose, moving bits as unsigned ints (numpy copies bfloat16 slowly);
  matrices go tile by tile, faster than numpy's strided copy for large ones
  (``docs/results/cpu.md#loading-a-checkpoints-tensors``)."""
  bits = x.view(np.dtype(f"u{x.dtype.itemsize}"))
  if tuple(perm) != (1, 0):
    return np.ascontiguousarray(np.transpose(bits, perm)).view(x.dtype)
  rows, cols = bits.shape
  out = np.empty((cols, rows), bits.dtype)
  for i in range(0, rows, block):
    for j in range(0, cols, block):
      out[j:j + block, i:i + block] = bits[i:i + block, j:j + block].T
  return out.view(x.dtype)


def describe_unexpected(name: str, config: QwenConfig) -> str:
  """``name``, annotated when it is a known tensor this config does not have."""
  for rule in KEY_RULES:
    match = rule.pattern.match(name)
    if match is None:
      continue
    if not rule.when(config):
      return f"{name} (not used by this config)"
    if rule.per_layer and int(match.group(1)) >= config.num_hidden_layers:
      return f"{name} (layer {match.group(1)} >= num_hidden_layers={config.num_hidden_layers})"
    if rule.per_expert and int(match.group(2)) >= config.num_experts:
      return f"{name} (expert {match.group(2)} >= num_experts={config.num_experts})"
  return name


def checkpoint_experts(names: Iterable[str]) -> int | None:
  """How many experts per layer a checkpoint's tensor names hold (one more than the highest
  ``mlp.experts.{e}`` index), or None when they hold no per-expert tensors."""
  found = [int(m.group(1)) for m in map(_EXPERT_NAME.match, names) if m]
  return max(found) + 1 if found else None


_EXPERT_NAME = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def to_nnx(x: np.ndarray, spec: TensorSpec, nnx_shape: Shape) -> np.ndarray:
  """HF tensor -> NNX layout (one layer's, or one layer's expert's, slice for stacked
  parameters)."""
  if spec.rule.perm is not None:
    x = _transpose(x, spec.rule.perm)
  return np.ascontiguousarray(x.reshape(nnx_shape))


def to_hf(y: np.ndarray, spec: TensorSpec) -> np.ndarray:
  """NNX layout -> HF tensor; the inverse of :func:`to_nnx`."""
  perm = spec.rule.perm
  if perm is None:
    return np.ascontiguousarray(y.reshape(spec.hf_shape))
  permuted = tuple(spec.hf_shape[p] for p in perm)
  return _transpose(y.reshape(permuted), tuple(np.argsort(perm)))
