r"""A decode step of five kernels a layer: the sampler's GPU step with Pallas kernels.

XLA runs one decode step of a small model such as Qwen2.5-0.5B at batch 64 on a GPU as 14
kernels a layer (the two norms, the q/k/v, output, gate/up and down products, their split-K
reductions, RoPE, two cache writes, the score and value products, the softmax, the residual adds;
``benchmarks/accelerator/decode_kernels.py`` counts them deviceless), and the launches, not the
bytes, set the step's time: several times what reading the weights and the cache takes at the
memory bound (figures: ``docs/results/gpu.md#the-decode-step-against-the-memory-bound``). This
step runs each layer as five Pallas kernels, reading every weight once:

1. RMSNorm and the q, k and v products (with their biases):
   :func:`~rft_jax.models.decode.decode_projections.norm_projections`;
2. (Qwen3's q/k norms,) RoPE, the new key and value written into the layer's cache in place, and
   attention over the cache: :func:`~rft_jax.models.decode.decode_attention.fused_decode_attention`;
3. the output product and the residual add:
   :func:`~rft_jax.models.decode.decode_projections.residual_projection`;
4. RMSNorm, the gate and up products and SwiGLU:
   :func:`~rft_jax.models.decode.decode_projections.swiglu_projection`;
5. the down product and the residual add (as 3).

Around the layers a step keeps XLA's embedding gather, the RoPE rows, the slot-mask write, the
final norm, the logits product and the sampling. The results equal :meth:`Qwen.decode_step`'s up
to float rounding (the same samples for a seed in float32:
``tests/test_fused_decode.py``), on one device; ``QwenConfig.decode_kernels`` chooses
(:func:`decode_kernels_kind`). The kernels run on CPU in Pallas' interpret mode
(``fused_interpret``), which is how the CPU suite checks them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rft_jax.models.decode import decode_attention, decode_projections
from rft_jax.models.config import DECODE_KERNEL_KINDS, QwenConfig
from rft_jax.models.kv_cache import KVCache, write_slots
from rft_jax.models.layers import rope_inv_freq


def fused_decode_fits(config: QwenConfig, rows: int) -> str | None:
  """None if the fused step takes this model at ``rows`` rows, else why not (one line)."""
  c = config
  if c.lora is not None:
    return "LoRA adapters (the fused kernels have none; the XLA step applies them)"
  if c.is_moe:
    return (f"a mixture of experts (model_type {c.model_type!r}: the fused kernels have a dense "
            "MLP; the XLA step routes the experts)")
  half = c.head_dim // 2
  if half < 16 or half & (half - 1):
    return (f"head_dim={c.head_dim} (the attention kernel takes halves of a power of two of at "
            f"least 16)")
  widths = (c.hidden_size, c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim, c.intermediate_size)
  if not decode_projections.fits(rows, *widths):
    return (f"{rows} rows of widths {widths} (hidden, q, k/v, mlp): not blocks the projection "
            f"kernels take")
  return None


def decode_kernels_kind(config: QwenConfig, platform: str, devices: int, rows: int) -> str:
  """What ``config.decode_kernels`` stands for on ``devices`` devices of ``platform`` for a
  step of ``rows`` rows: ``xla`` (:meth:`Qwen.decode_step`'s XLA step), ``fused`` or
  ``fused_interpret`` (:func:`fused_decode_step`, compiled, or in Pallas' interpret mode).

  ``auto``: ``fused`` on one GPU where the kernels take the shapes, else ``xla``. The kernels
  run on one device (a mesh's step would gather their operands), so on a mesh of more than one
  device, or for shapes they do not take, an explicit ``fused`` is refused in one line.
  """
  kind = config.decode_kernels
  if kind not in DECODE_KERNEL_KINDS:
    raise ValueError(f"decode_kernels={kind!r} is not one of {DECODE_KERNEL_KINDS}")
  if kind == "xla":
    return kind
  why_not = fused_decode_fits(config, rows)
  if devices > 1:
    why_not = f"a mesh of {devices} devices (the fused kernels run on one)"
  if kind == "auto":
    return "fused" if platform == "gpu" and why_not is None else "xla"
  if why_not is not None:
    raise ValueError(f"decode_kernels={kind!r} cannot take {why_not}; use auto or xla")
  if kind == "fused" and platform != "gpu":
    raise ValueError(f"decode_kernels='fused' needs a GPU (this is {platform}); "
                     f"fused_interpret runs the same kernels anywhere, slowly")
  return kind


def fused_decode_step(model, tokens: Int[Array, "B"], cache: KVCache, layers, *,
                      interpret: bool = False) -> tuple[Float[Array, "B V"], KVCache]:
  """:meth:`Qwen.decode_step` in five Pallas kernels a layer (see the module docstring).

  Args:
    model: the :class:`~rft_jax.models.Qwen`, its matrices in the compute dtype (the sampler's
      ``decode_state``).
    tokens: one token per row.
    cache: the dense :class:`KVCache`, one write index shared or one per row.
    layers: ``model.unstacked_layers()``, sliced once per call by the sampler.
    interpret: run the kernels in Pallas' interpret mode (any backend; for tests).

  Returns:
    The next-token logits ``[B, V]`` (float32) and the cache with the tokens written.
  """
  c = model.config
  b, dtype = tokens.shape[0], c.dtype
  n, k, h = c.num_attention_heads, c.num_key_value_heads, c.head_dim
  x = model._embed(tokens[:, None])[:, 0]  # [B, D]
  slot_mask = write_slots(cache.slot_mask, jnp.ones((b, 1), jnp.bool_), cache.index, axis=1)
  # The attention kernel makes each row's cos and sin from these; computed now, on the default
  # device (the same arithmetic as in a program), they enter the program as a constant instead
  # of a kernel at every step.
  with jax.ensure_compile_time_eval():
    inv_freq = rope_inv_freq(c.head_dim, c.rope_theta)
  eps = c.rms_norm_eps
  k_all, v_all = [], []
  for i, layer in enumerate(layers):
    attn, mlp = layer.attn, layer.mlp
    weights = tuple(getattr(attn, f"{name}_proj")[...].astype(dtype).reshape(c.hidden_size, -1)
                    for name in "qkv")
    biases = None
    if c.attention_bias:
      biases = tuple(getattr(attn, f"{name}_bias")[...].astype(dtype).reshape(-1) for name in "qkv")
    q, key, value = decode_projections.norm_projections(
        x, layer.input_layernorm.scale[...], weights, biases, eps=eps, interpret=interpret)
    norms = {}
    if c.qk_norm:
      norms = dict(q_norm=attn.q_norm.scale[...], k_norm=attn.k_norm.scale[...], norm_eps=eps)
    o, k_layer, v_layer = decode_attention.fused_decode_attention(
        q.reshape(b, n, h), key.reshape(b, k, h), value.reshape(b, k, h), cache.positions,
        inv_freq, cache.k[i],
        cache.v[i], slot_mask, cache.index, interpret=interpret, **norms)
    o_bias = attn.o_bias[...].astype(dtype) if c.attention_out_bias else None
    x = decode_projections.residual_projection(
        o.reshape(b, n * h), attn.o_proj[...].astype(dtype).reshape(n * h, -1), x, o_bias,
        interpret=interpret)
    hidden = decode_projections.swiglu_projection(
        x, layer.post_attention_layernorm.scale[...], mlp.gate_proj[...].astype(dtype),
        mlp.up_proj[...].astype(dtype), eps=eps, interpret=interpret)
    x = decode_projections.residual_projection(hidden, mlp.down_proj[...].astype(dtype), x,
                                               interpret=interpret)
    k_all.append(k_layer)
    v_all.append(v_layer)
  cache = KVCache(k=tuple(k_all), v=tuple(v_all), slot_mask=slot_mask,
                  positions=cache.positions + 1, index=cache.index + 1)
  return model.logits(model.norm(x)), cache


def decode_step(model, tokens: Int[Array, "B"], cache: KVCache, layers, kind: str
                ) -> tuple[Float[Array, "B V"], KVCache]:
  """The sampler's accelerator decode step of ``kind`` (:func:`decode_kernels_kind`)."""
  if kind == "xla":
    return model.decode_step(tokens, cache, layers=layers)
  if layers is None:
    layers = model.unstacked_layers()
  return fused_decode_step(model, tokens, cache, layers, interpret=kind == "fused_interpret")

