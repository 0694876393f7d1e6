r"""LoRA adapters of the decoder's projections: their settings and the adapter of one projection.

A projection :math:`y = x W` (``W``: ``[in, out]``, split into heads where the model splits it)
with an adapter computes

.. math:: y = x W + \frac{\alpha}{r}\, (x A) B, \qquad A: [in, r],\ B: [r, out],

with flax NNX's standalone :class:`flax.nnx.LoRA` holding ``A`` (``lora_a``, He-uniform) and ``B``
(``lora_b``, zeros: the adapted model equals the base at init). Both are :class:`flax.nnx.LoRAParam`
(a subclass of ``nnx.Param``), always float32 whatever the base's ``param_dtype``, so a filter
(``nnx.LoRAParam``) separates the trainable adapters from the frozen base. They carry logical axis
names like every parameter: ``A`` the input's (``embed``, ``heads``, ``mlp``), ``B`` the output's
flattened (``heads`` for ``N*H``, which shards the same way as ``N`` heads), the rank axis none.

The adapters sit next to the weights they adapt (``attn.q_lora`` beside ``attn.q_proj``,
``mlp.down_lora`` beside ``mlp.down_proj``); the model's full forward and its cache path add
them. :mod:`rft_jax.models.lora_model` adds them to a loaded model and merges them back into
plain weights (what the sampler's decode kernels and the Hugging Face export read).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

# The projections an adapter may target, by their module names (also peft's / verl's names);
# on a mixture-of-experts model gate/up/down are every expert's (and the shared expert's), and
# ``router`` its router (Qwen3-MoE's ``mlp.gate``).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROUTER = "router"
LORA_TARGETS = PROJECTIONS + (ROUTER,)
ALL_LINEAR = "all-linear"  # verl's and peft's spelling of every projection (not the router)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """LoRA of the policy (``model.lora``; absent or null: full fine-tuning).

  Attributes:
    rank: r, the adapters' inner width (``A: [in, r]``, ``B: [r, out]``).
    alpha: the update's scale is ``alpha / rank`` (peft's ``lora_alpha``).
    targets: the projections that get an adapter, among :data:`LORA_TARGETS` (short forms ``q``,
      ``k``, ``v``, ``o``, ``gate``, ``up``, ``down`` and ``all-linear``, the seven, accepted);
      default: the seven projections. On a mixture-of-experts model ``gate``, ``up`` and
      ``down`` adapt every expert (an adapter each) and ``router`` its router; a dense model
      refuses ``router``.
  """

  rank: int = 16
  alpha: float = 32.0
  targets: tuple[str, ...] = PROJECTIONS

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"model.lora.rank={self.rank!r} must be a positive integer")
    if (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
        or not math.isfinite(self.alpha) or self.alpha <= 0):
      raise ValueError(f"model.lora.alpha={self.alpha!r} must be a finite number > 0")
    object.__setattr__(self, "alpha", float(self.alpha))
    targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
    names = []
    for target in targets:
      if target == ALL_LINEAR:
        names += PROJECTIONS
        continue
      name = target if str(target).endswith("_proj") or target == ROUTER else f"{target}_proj"
      if name not in LORA_TARGETS:
        raise ValueError(f"model.lora.targets: {target!r} is not one of {list(LORA_TARGETS)} "
                         f"(or q, k, v, o, gate, up, down, {ALL_LINEAR})")
      names.append(name)
    if not names:
      raise ValueError("model.lora.targets is empty: name at least one projection "
                       f"({list(LORA_TARGETS)})")
    object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in names))

  @property
  def scale(self) -> float:
    """``alpha / rank``, the factor of the adapters' product."""
    return self.alpha / self.rank


def adapter_name(projection: str) -> str:
  """The attribute of ``projection``'s adapter: ``q_proj`` -> ``q_lora``, ``router`` ->
  ``router_lora``."""
  return projection.removesuffix("_proj") + "_lora"


def merge_adapter(w: Array, a: Float[Array, "... I r"], b: Float[Array, "... r O"], scale: float) -> Array:
  r""":math:`W + \mathrm{scale}\, A B` (``A B`` over the last two axes, any leading ones: layers,
  experts; reshaped to ``W``'s shape), summed in float32 and stored in ``W``'s dtype: the one
  arithmetic of every merge (:func:`rft_jax.models.lora_model.merged`, and the experts' and the
  router's adapters in the forward, :class:`rft_jax.models.moe.MoE`)."""
  delta = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))
  return (w.astype(jnp.float32) + scale * delta.reshape(w.shape)).astype(w.dtype)


class ExpertAdapters(nnx.Module):
  """LoRA adapters of stacked experts ``W [E, in, out]``: ``lora_a [E, in, r]`` (He-uniform per
  expert) and ``lora_b [E, r, out]`` (zeros), float32 :class:`flax.nnx.LoRAParam`, with the
  experts' logical axes (``experts``, then ``in_axis`` / ``out_axis``)."""

  def __init__(self, experts: int, in_features: int, rank: int, out_features: int, in_axis: str,
               out_axis: str, *, rngs: nnx.Rngs):
    init = nnx.initializers.he_uniform(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.lora_a = nnx.LoRAParam(init(rngs.params(), (experts, in_features, rank), jnp.float32),
                                out_sharding=("experts", in_axis, None), eager_sharding=False)
    self.lora_b = nnx.LoRAParam(jnp.zeros((experts, rank, out_features), jnp.float32),
                                out_sharding=("experts", None, out_axis), eager_sharding=False)


def expert_adapters(lora: LoraConfig | None, projection: str, experts: int, in_features: int,
                    out_features: int, in_axis: str, out_axis: str, *, rngs: nnx.Rngs
                    ) -> ExpertAdapters | None:
  """The experts' adapters of ``projection`` when ``lora`` targets it, else None."""
  if lora is None or projection not in lora.targets:
    return None
  return ExpertAdapters(experts, in_features, lora.rank, out_features, in_axis, out_axis, rngs=rngs)


def projection_adapter(lora: LoraConfig | None, projection: str, in_features: int,
                       out_features: int, in_axis: str, out_axis: str, *, dtype,
                       rngs: nnx.Rngs) -> nnx.LoRA | None:
  """The adapter of ``projection`` (``[in, out]``, flattened) when ``lora`` targets it, else None.

  ``A``'s input axis carries the logical name ``in_axis``, ``B``'s output axis ``out_axis``;
  the product runs in ``dtype`` (the model's compute dtype), the parameters are float32.
  """
  if lora is None or projection not in lora.targets:
    return None
  return nnx.LoRA(in_features, lora.rank, out_features, dtype=dtype, param_dtype=jnp.float32,
                  rngs=rngs, a_metadata={"out_sharding": (in_axis, None), "eager_sharding": False},
                  b_metadata={"out_sharding": (None, out_axis), "eager_sharding": False})


def adapter_delta(adapter: nnx.LoRA | None, scale: float, x: Float[Array, "... I"]
                  ) -> Float[Array, "... O"] | None:
  """``scale * (x A) B`` of an adapter (``x``'s last axis the flattened input), or None."""
  if adapter is None:
    return None
  return adapter(x) * jnp.asarray(scale, x.dtype)
