r"""Building blocks of the decoder: annotated parameters, RMSNorm, RoPE and the SwiGLU MLP.

Every parameter carries its logical axis names as flax ``out_sharding`` metadata (with eager
sharding off, so a model is built without a mesh); :mod:`rft_jax.parallel.sharding` maps the names
onto a mesh. The names used by the decoder:

=============  ============================================================
``vocab``      vocabulary rows / logits columns (V)
``embed``      the residual width (D) of matrices
``norm``       1-D scales and biases over D (small; replicated by default)
``heads``      query heads (N)
``kv_heads``   key/value heads (K)
``head_dim``   per-head width (H)
``mlp``        SwiGLU width (F)
``layers``     the stacked-layer axis (L), added by ``nnx.vmap``
=============  ============================================================
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from rft_jax.models.lora import LoraConfig, adapter_delta, projection_adapter

Initializer = Callable[..., Array]
normal_init = nnx.initializers.normal(stddev=0.02)


def param(init: Initializer, key: Array, shape: tuple[int, ...], dtype, axes: tuple[str, ...]
          ) -> nnx.Param:
  """An ``nnx.Param`` of ``shape`` with logical axis names ``axes`` (no eager sharding)."""
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {axes} do not match shape {shape}")
  return nnx.Param(init(key, shape, dtype), out_sharding=axes, eager_sharding=False)


def rms_norm(x: Float[Array, "... D"], scale: Float[Array, "D"], eps: float, axis: int = -1
             ) -> Float[Array, "... D"]:
  r"""RMSNorm as Hugging Face computes it, over ``axis`` (the last by default).

  .. math:: y = w \odot \mathrm{cast}\Big(\frac{x}{\sqrt{\mathrm{mean}(x^2) + \epsilon}}\Big)

  The normalisation runs in float32; the result is cast back to ``x.dtype`` and only then
  multiplied by the weight (cast to the same dtype), exactly as ``Qwen2RMSNorm``.
  """
  x32 = x.astype(jnp.float32)
  var = jnp.mean(jnp.square(x32), axis=axis, keepdims=True)
  normed = (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)
  scale = jnp.expand_dims(scale, tuple(range(1, x.ndim - axis % x.ndim)))  # [D, 1, ...]
  return scale.astype(x.dtype) * normed


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learned scale (initialised to ones)."""

  def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs,
               axes: tuple[str, ...] = ("norm",)):
    self.eps = eps
    self.scale = param(nnx.initializers.ones_init(), rngs.params(), (dim,), param_dtype, axes)

  def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
    return rms_norm(x, self.scale[...], self.eps)


def rope_inv_freq(head_dim: int, theta: float) -> Float[Array, "H/2"]:
  r"""Inverse frequencies :math:`\theta^{-2i/H}`, :math:`i = 0 .. H/2-1`, in float32."""
  exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  return 1.0 / (jnp.float32(theta) ** exponents)


def rope_cos_sin(positions: Int[Array, "B T"], head_dim: int, theta: float, dtype
                 ) -> tuple[Float[Array, "B T 1 H"], Float[Array, "B T 1 H"]]:
  r""":math:`\cos\phi` and :math:`\sin\phi` of :func:`rotate`, shared by every head and layer.

  :math:`\phi = p \cdot \theta^{-2i/H}` repeated twice along the head dimension, computed in
  float32; cos/sin are cast to ``dtype`` (the rotated activations'), as HF does.
  """
  angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(head_dim, theta)  # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
  return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def rotate(x: Float[Array, "B T n H"], cos: Float[Array, "B T 1 H"], sin: Float[Array, "B T 1 H"],
           axis: int = -1) -> Float[Array, "B T n H"]:
  r"""Rotary embedding in the Hugging Face ``rotate_half`` convention.

  :math:`y = x \cos\phi + \mathrm{rotate\_half}(x) \sin\phi` with
  :math:`\mathrm{rotate\_half}([x_1, x_2]) = [-x_2, x_1]` and ``cos``, ``sin`` from
  :func:`rope_cos_sin` at the tokens' positions. ``axis``: where the head width lies (``cos``
  and ``sin`` broadcast against ``x``).
  """
  x1, x2 = jnp.split(x, 2, axis=axis)
  rotated = jnp.concatenate([-x2, x1], axis=axis)
  return x * cos + rotated * sin


class MLP(nnx.Module):
  r"""SwiGLU feed-forward: :math:`W_d\,(\mathrm{silu}(x W_g) \odot x W_u)`, each product with its
  LoRA adapter's when ``lora`` targets it (:mod:`rft_jax.models.lora`)."""

  def __init__(self, hidden: int, intermediate: int, *, dtype, param_dtype, rngs: nnx.Rngs,
               lora: LoraConfig | None = None):
    self.dtype = dtype
    self.gate_proj = param(normal_init, rngs.params(), (hidden, intermediate), param_dtype,
                           ("embed", "mlp"))
    self.up_proj = param(normal_init, rngs.params(), (hidden, intermediate), param_dtype,
                         ("embed", "mlp"))
    self.down_proj = param(normal_init, rngs.params(), (intermediate, hidden), param_dtype,
                           ("mlp", "embed"))
    self.lora_scale = None if lora is None else lora.scale
    self.gate_lora = projection_adapter(lora, "gate_proj", hidden, intermediate, "embed", "mlp",
                                        dtype=dtype, rngs=rngs)
    self.up_lora = projection_adapter(lora, "up_proj", hidden, intermediate, "embed", "mlp",
                                      dtype=dtype, rngs=rngs)
    self.down_lora = projection_adapter(lora, "down_proj", intermediate, hidden, "mlp", "embed",
                                        dtype=dtype, rngs=rngs)

  def _project(self, x: Float[Array, "B T I"], name: str) -> Float[Array, "B T O"]:
    y = x @ getattr(self, f"{name}_proj")[...].astype(self.dtype)
    delta = adapter_delta(getattr(self, f"{name}_lora"), self.lora_scale, x)
    return y if delta is None else y + delta

  def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
    x = x.astype(self.dtype)
    gate, up = self._project(x, "gate"), self._project(x, "up")
    return self._project(jax.nn.silu(gate) * up, "down")
