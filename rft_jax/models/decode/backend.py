"""Which decode step a sampling program runs, chosen once, here, from the platform and the config.

A sampler's decode step has several implementations, each where it is fastest:

* ``feature_major`` on CPU (:mod:`~rft_jax.models.decode.feature_major`: weight-first products
  on a transposed copy of the weights), its attention the compiled kernel
  (:mod:`~rft_jax.models.decode.cpu_attention`) for a float32 cache on one CPU device, where it
  is built, else XLA's;
* ``fused`` on one GPU (:mod:`~rft_jax.models.decode.fused_decode`: five Pallas kernels a layer)
  where the kernels take the shapes, ``fused_interpret`` the same kernels anywhere (tests);
* ``xla`` elsewhere: :meth:`~rft_jax.models.Qwen.decode_step` (a mixture of experts always).

A paged cache (``sampling.kv_pages``) adds its attention's kind
(:func:`~rft_jax.models.decode.paged_kv.resolve_kind`). :func:`choose_backend` makes every one
of these choices; the sampler's programs (:mod:`rft_jax.sampling.decoder`) only follow
:class:`DecodeBackend`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rft_jax.models.config import QwenConfig
from rft_jax.models.decode import cpu_attention, feature_major
from rft_jax.models.decode.fused_decode import decode_kernels_kind
from rft_jax.models.decode.paged_kv import resolve_kind

STEPS = ("feature_major", "xla", "fused", "fused_interpret")


@dataclasses.dataclass(frozen=True)
class DecodeBackend:
  """How a sampling program decodes (hashable: a compiled program's static setting).

  Attributes:
    platform: ``cpu``, ``gpu`` or ``tpu``.
    step: one of :data:`STEPS`.
    cpu_kernel: the CPU step's attention is the compiled kernel (else ``feature_major.attend``).
    paged: the paged cache's attention kind; None for a dense cache.
  """

  platform: str
  step: str
  cpu_kernel: bool = False
  paged: str | None = None

  @property
  def on_cpu(self) -> bool:
    return self.platform == "cpu"

  @property
  def slices_layers_once(self) -> bool:
    """Whether a call slices the layers apart once and holds them (GPUs: XLA:GPU copies a
    slice that feeds a product, so sliced in the loop every step would copy every layer's
    weights, ``docs/results/gpu.md#the-decode-step-against-the-memory-bound``); TPUs fuse the
    slices into the products, and CPUs slice by index arguments."""
    return self.platform == "gpu"

  @property
  def tiled_keys(self) -> bool:
    """Whether a continuous pool's dense cache holds its keys tiled for the CPU kernel
    (:func:`~rft_jax.models.decode.cpu_attention.tile_keys`), which reads them faster."""
    return self.cpu_kernel and self.paged is None

  @property
  def attention(self):
    """The CPU step's attention function (None off CPU)."""
    if not self.on_cpu:
      return None
    return cpu_attention.attend if self.cpu_kernel else feature_major.attend


def cpu_kernel_takes(platform: str, devices: int, cache_dtype) -> bool:
  """Whether the compiled CPU attention kernel runs a step: a float32 cache on one CPU device
  (XLA cannot split a custom call over a mesh), the kernel built."""
  return (platform == "cpu" and devices == 1 and jnp.dtype(cache_dtype) == jnp.float32
          and cpu_attention.available())


def choose_backend(config: QwenConfig, *, platform: str, devices: int, rows: int, cache_dtype=None,
                   kv_pages: int | None = None, paged_attention: str = "auto", page_size: int = 16,
                   device_kind: str | None = None) -> DecodeBackend:
  """The :class:`DecodeBackend` of a program of ``rows`` rows for ``config`` on ``devices``
  devices of ``platform`` (``device_kind``: theirs, for the paged kernels' checks).

  Raises:
    ValueError: a decode kernel or paged attention kind named explicitly that cannot run here
      (one line, from :func:`~rft_jax.models.decode.fused_decode.decode_kernels_kind` or
      :func:`~rft_jax.models.decode.paged_kv.resolve_kind`).
  """
  cache_dtype = config.dtype if cache_dtype is None else cache_dtype
  paged = None if kv_pages is None else resolve_kind(paged_attention, platform, page_size,
                                                     config.head_dim, device_kind)
  if platform == "cpu":
    return DecodeBackend(platform, "feature_major", cpu_kernel_takes(platform, devices, cache_dtype),
                         paged)
  step = decode_kernels_kind(config, platform, devices, rows)  # refuses what cannot run
  return DecodeBackend(platform, "xla" if config.is_moe else step, False, paged)
