r"""A CPU decode step's weight products at a few rows as one compiled kernel
(``cpu_matmul.cc``, an XLA FFI custom call built into the attention kernel's library): what
``W @ h`` computes for ``h`` of 1 to :data:`MAX_COLUMNS` columns, faster.

At the tail of a long-tailed rollout a few rows decode, and a step multiplies every weight by
1-16 columns: it should stream the weights from memory once, at the machine's bandwidth. XLA's
products do not get there: on the peers' large model's ``[1536, 512]`` matrices (24 of them, 75
MiB, 2 cores of an AVX-512 EPYC, 2026-11-27) XLA took 4.1 ms at 1 column, 5.6 at 8 and 5.6 at 16
(18 / 13 / 13 GB/s), and its XNNPACK, YNNPACK and oneDNN dot fusions
(``--xla_cpu_experimental_{xnn,ynn,onednn}_fusion_type=dot``) 3.0-3.3, 4.9-7.1 and 5.6-8.0 ms,
while numpy's OpenBLAS took 11 ms at 8 columns. This kernel reads each weight panel (8 rows,
contiguous) once and keeps ``B`` sums per row in registers: ``python
benchmarks/speed/cpu_matmul.py`` says what it gives on the machine at hand.

The weights are packed once per decode call (:func:`panels`: ``[O, I]`` to ``[O / 8, I, 8]``,
rows padded to a multiple of 8), beside the ``[O, I]`` copy the larger batches' XLA products read.
Each output is one chain of fused multiply-adds over the ``I`` inputs in order, from zero: the
same bits at any batch size (unlike XLA's products, whose blocking follows the shape) and on any
CPU with AVX2 and FMA, the only ones it is built for (``x86-64-v3``); elsewhere
:func:`available` is False and the products stay XLA's. It runs on one CPU device only, in
float32, as the attention kernel does.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from rft_jax.models import cpu_attention

PANEL = 8  # rows of a weight per panel
MAX_COLUMNS = 12  # from 16 columns on, XLA multiplies as fast (cpu_matmul.py benchmark)
_TARGET = "rft_jax_panel_matmul"


@functools.cache
def available() -> bool:
  """Whether the kernels' library is built (:func:`rft_jax.models.cpu_attention.available`)
  with the panel product, which it holds where built for ``x86-64-v3``, and registered."""
  if not cpu_attention.available():
    return False
  try:
    handler = ctypes.cdll.LoadLibrary(cpu_attention.library_path()).RftPanelMatmul
  except (OSError, AttributeError):
    return False
  jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(handler), platform="cpu")
  return True


def panels(w: Float[Array, "O I"]) -> Float[Array, "P I 8"]:
  """``w`` packed for :func:`matmul`: its rows padded with zeros to ``P = ceil(O / 8)`` panels
  of 8, panel ``p``'s column ``i`` holding ``w[8p : 8p + 8, i]`` (float32)."""
  o, i = w.shape
  pad = -o % PANEL
  w = jnp.pad(w.astype(jnp.float32), ((0, pad), (0, 0)))
  return w.reshape(-1, PANEL, i).transpose(0, 2, 1)


def matmul(packed: Float[Array, "P I 8"], h: Float[Array, "I B"], rows: int
           ) -> Float[Array, "rows B"]:
  """``w @ h`` in float32 for ``packed = panels(w)`` of ``rows`` rows, by the kernel (one CPU
  device; ``B`` at most :data:`MAX_COLUMNS` to be worth it; :func:`available` must hold)."""
  p, i, _ = packed.shape
  out = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((p * PANEL, h.shape[1]), jnp.float32),
                         vmap_method="sequential")(packed, h.astype(jnp.float32))
  return out if rows == p * PANEL else out[:rows]
