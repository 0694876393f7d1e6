r"""Pallas GPU (Triton) kernels for the projections of one decode step of a decoder layer.

A decode step has ``M`` rows of one token each (M = 16-256): every projection is a skinny,
memory-bound product ``[M, K] x [K, N]`` whose cost is reading the weight once. XLA runs each
layer's norm, products, bias adds, SwiGLU and residual adds as about 14 kernels; with these
three (and a fused attention kernel) a layer is five:

* :func:`norm_projections`: ``rms_norm(x) @ w_i (+ b_i)`` for q, k and v in one call;
* :func:`swiglu_projection`: ``silu(n @ w_gate) * (n @ w_up)``, ``n = rms_norm(x)``;
* :func:`residual_projection`: ``residual + (a @ w (+ b))`` (attention's output projection, the
  MLP's down projection).

Each kernel's grid is ``(M blocks, N blocks)``, M blocks first (Triton's fastest launch axis)
so that the programs reading one weight block run close together and can share it through L2
(not measured: no GPU was at hand when these were written). A program loops over the
contracted axis in ``[BLOCK_K, BLOCK_N]`` weight blocks with a float32 accumulator; the norm's
per-row ``rsqrt(mean(x^2) + eps)`` needs a whole row, so each program first reads its rows of
``x`` (small: ``[M, D]``) once for it and normalises each block of ``x`` in the main loop. The
arrays are passed whole (no block specs: ``D = 896`` is no power of two, and Triton's blocks
must be) and indexed with power-of-two slices; rows past ``M`` (a block of 16 or 64 rows over a
ragged ``M``) are masked on load and store, so no array is padded or copied around the call.

The rounding follows the XLA path (``layers.rms_norm``, ``Attention._proj`` / ``out``,
``MLP``, ``DecoderLayer._residual``) step for step: the norm in float32, cast to the compute
dtype, times the scale in the compute dtype; products accumulated in float32 and rounded to
the compute dtype; biases, SwiGLU's ``silu(gate) * up`` (with ``sigmoid`` rounded step by step
as XLA expands it, :func:`_sigmoid`) and residual adds in the compute dtype. The differences:
the float32 sums run in another order (the norm's sum of squares and the products, by blocks
of ``BLOCK_K``), so a bfloat16 result may be one bfloat16 step off where the float32 value lies
near a rounding boundary; on a GPU, ``exp`` and ``rsqrt`` are libdevice's and Triton's float32
division may be its 2-ulp one rather than XLA's correctly rounded one (float32 ulps, which
rarely survive a rounding to bfloat16); float32 products are IEEE float32 on a GPU (no TF32,
whatever ``jax_default_matmul_precision`` says). Weights, biases and scales in another dtype
than ``x`` are cast to it block by block inside the kernel (as the XLA path casts the params),
not copied.

All three run on CPU in Pallas' interpret mode (``interpret=True``), as the tests check them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

BLOCK_M = 64  # the most rows per program (fewer, a power of two of at least 16, for small M)
MIN_BLOCK_M = 16  # Triton's dot wants every block dimension >= 16
BLOCK_N = 64  # output columns per program: more programs for the skinny products
BLOCK_K = 128  # contracted columns per loop step (64 where 128 does not divide)
WIDTH_MULTIPLE = 64  # every width (D, N_i, F, K) must be a multiple of this
NUM_WARPS = 4
NUM_STAGES = 3  # software pipelining of the weight loads in the loop over K


def fits(m: int, *widths: int) -> bool:
  """Whether these kernels take these shapes: ``m >= 1`` rows (any number: ragged blocks are
  masked) and widths (``D`` and each ``N_i``; ``D`` and ``F``; ``K`` and ``D``) that are
  positive multiples of 64, so that blocks of 64 or 128 columns divide them. The integrator
  falls back to XLA otherwise."""
  return m >= 1 and all(w > 0 and w % WIDTH_MULTIPLE == 0 for w in widths)


def _block_m(m: int) -> int:
  return min(BLOCK_M, max(MIN_BLOCK_M, pl.next_power_of_2(m)))


def _block(width: int, most: int) -> int:
  return most if width % most == 0 else WIDTH_MULTIPLE


def _check(name: str, m: int, *widths: int) -> None:
  if not fits(m, *widths):
    raise ValueError(f"{name}: rows {m} and widths {widths} do not fit the kernel (widths must "
                     f"be positive multiples of {WIDTH_MULTIPLE}; see fits)")


class _Rows:
  """One program's block of rows ``[r0, r0 + bm)`` of ``m``, masked when ``m`` is ragged."""

  def __init__(self, bm: int, m: int):
    self.bm, self.m = bm, m
    self.ragged = m % bm != 0
    self.r0 = pl.multiple_of(pl.program_id(0) * bm, bm)

  def _mask(self, width: int) -> Array:
    rows = self.r0 + jnp.arange(self.bm)
    return jnp.broadcast_to((rows < self.m)[:, None], (self.bm, width))

  def load(self, ref, c0, width: int) -> Array:
    """``ref[rows, c0:c0 + width]``, ``[bm, width]`` (rows past ``m`` read as zeros)."""
    block = ref.at[pl.ds(self.r0, self.bm), pl.ds(c0, width)]
    if not self.ragged:
      return block[...]
    return plgpu.load(block, mask=self._mask(width), other=0)

  def store(self, ref, c0, value: Array) -> None:
    """``ref[rows, c0:c0 + width] = value`` (rows past ``m`` not written)."""
    block = ref.at[pl.ds(self.r0, self.bm), pl.ds(c0, value.shape[1])]
    if not self.ragged:
      block[...] = value
    else:
      plgpu.store(block, value, mask=self._mask(value.shape[1]))


def _inverse_rms(x_ref, rows: _Rows, bk: int, eps: float) -> Float[Array, "bm"]:
  """``rsqrt(mean(x^2) + eps)`` of the program's rows, in float32, from ``x`` in blocks."""
  d = x_ref.shape[1]

  def body(k, acc):
    x = rows.load(x_ref, pl.multiple_of(k * bk, bk), bk).astype(jnp.float32)
    return acc + x * x

  squares = jax.lax.fori_loop(0, d // bk, body, jnp.zeros((rows.bm, bk), jnp.float32))
  return jax.lax.rsqrt(jnp.sum(squares, axis=1) / d + eps)


def _products(a_ref, w_refs, rows: _Rows, c0, bn: int, bk: int, norm=None
              ) -> tuple[Float[Array, "bm bn"], ...]:
  """``a[rows] @ w[:, c0:c0 + bn]`` for each ``w`` of ``w_refs``, accumulated in float32 over
  blocks of ``bk``; with ``norm = (scale_ref, inverse_rms)`` the rows of ``a`` are RMS-normed
  first (``layers.rms_norm``'s rounding)."""
  dtype = a_ref.dtype

  def body(k, accs):
    k0 = pl.multiple_of(k * bk, bk)
    a = rows.load(a_ref, k0, bk)
    if norm is not None:
      scale_ref, inverse_rms = norm
      normed = (a.astype(jnp.float32) * inverse_rms[:, None]).astype(dtype)
      a = scale_ref[pl.ds(k0, bk)].astype(dtype)[None, :] * normed
    return tuple(
        acc + jnp.dot(a, w_ref[pl.ds(k0, bk), pl.ds(c0, bn)].astype(dtype),
                      precision=jax.lax.Precision.HIGHEST,  # float32: IEEE, not TF32
                      preferred_element_type=jnp.float32)
        for acc, w_ref in zip(accs, w_refs))

  zeros = tuple(jnp.zeros((rows.bm, bn), jnp.float32) for _ in w_refs)
  return jax.lax.fori_loop(0, a_ref.shape[1] // bk, body, zeros)


def _compiler_params():
  return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _norm_projections_kernel(x_ref, scale_ref, *refs, n: int, has_bias: tuple[bool, ...],
                             starts: tuple[int, ...], eps: float, bm: int, bn: int, bk: int):
  w_refs, rest = refs[:n], refs[n:]
  n_biases = sum(has_bias)
  bias_iter, out_refs = iter(rest[:n_biases]), rest[n_biases:]
  b_refs = [next(bias_iter) if flag else None for flag in has_bias]
  rows = _Rows(bm, x_ref.shape[0])
  inverse_rms = _inverse_rms(x_ref, rows, bk, eps)
  j = pl.program_id(1)
  for w_ref, b_ref, o_ref, start in zip(w_refs, b_refs, out_refs, starts):
    stop = start + w_ref.shape[1] // bn

    @pl.when((j >= start) & (j < stop))
    def _(w_ref=w_ref, b_ref=b_ref, o_ref=o_ref, start=start):
      c0 = pl.multiple_of((j - start) * bn, bn)
      (acc,) = _products(x_ref, (w_ref,), rows, c0, bn, bk, norm=(scale_ref, inverse_rms))
      y = acc.astype(o_ref.dtype)
      if b_ref is not None:
        y = y + b_ref[pl.ds(c0, bn)].astype(o_ref.dtype)[None, :]
      rows.store(o_ref, c0, y)


def norm_projections(x: Float[Array, "M D"], scale: Float[Array, "D"],
                     weights: tuple[Float[Array, "D N_i"], ...],
                     biases: tuple[Float[Array, "N_i"] | None, ...] | None = None, *, eps: float,
                     interpret: bool = False) -> tuple[Float[Array, "M N_i"], ...]:
  """``rms_norm(x, scale, eps) @ w_i (+ b_i)`` for each weight, in ONE pallas_call (q, k and v
  of attention).

  Grid ``(ceil(M / bm), sum_i N_i / bn)``: the second axis runs over the column blocks of all
  weights together, each program picking its weight with ``pl.when`` on static block ranges,
  so the weights are read where they lie (never concatenated). ``biases``: one per weight
  (an entry may be None), or None. Outputs ``[M, N_i]`` in ``x.dtype``.
  """
  weights = tuple(weights)
  biases = (None,) * len(weights) if biases is None else tuple(biases)
  if len(biases) != len(weights):
    raise ValueError(f"norm_projections: {len(biases)} biases for {len(weights)} weights")
  m, d = x.shape
  widths = tuple(w.shape[1] for w in weights)
  if scale.shape != (d,) or any(w.shape[0] != d for w in weights) or any(
      b is not None and b.shape != (w,) for b, w in zip(biases, widths)):
    raise ValueError(f"norm_projections: x {x.shape}, scale {scale.shape}, weights "
                     f"{[w.shape for w in weights]}, biases "
                     f"{[None if b is None else b.shape for b in biases]} do not agree")
  _check("norm_projections", m, d, *widths)
  bm, bk = _block_m(m), _block(d, BLOCK_K)
  bn = BLOCK_N if all(w % BLOCK_N == 0 for w in widths) else WIDTH_MULTIPLE
  blocks = [w // bn for w in widths]
  starts = tuple(sum(blocks[:i]) for i in range(len(blocks)))
  kernel = functools.partial(
      _norm_projections_kernel, n=len(weights), has_bias=tuple(b is not None for b in biases),
      starts=starts, eps=eps, bm=bm, bn=bn, bk=bk)
  return tuple(pl.pallas_call(
      kernel, grid=(pl.cdiv(m, bm), sum(blocks)),
      out_shape=tuple(jax.ShapeDtypeStruct((m, w), x.dtype) for w in widths),
      compiler_params=_compiler_params(), interpret=interpret, name="norm_projections",
  )(x, scale, *weights, *(b for b in biases if b is not None)))


def _swiglu_kernel(x_ref, scale_ref, gate_ref, up_ref, o_ref, *, eps: float, bm: int, bn: int,
                   bk: int):
  rows = _Rows(bm, x_ref.shape[0])
  inverse_rms = _inverse_rms(x_ref, rows, bk, eps)
  c0 = pl.multiple_of(pl.program_id(1) * bn, bn)
  gate, up = _products(x_ref, (gate_ref, up_ref), rows, c0, bn, bk,
                       norm=(scale_ref, inverse_rms))
  dtype = o_ref.dtype
  gate, up = gate.astype(dtype), up.astype(dtype)
  rows.store(o_ref, c0, gate * _sigmoid(gate) * up)


def _sigmoid(x: Array) -> Array:
  """``jax.nn.sigmoid(x)`` rounded as XLA (GPU and CPU) expands it in ``x.dtype``:
  ``1 / (exp(-x) + 1)``, the exponential and the sum each rounded to ``x.dtype``, the
  reciprocal computed in float32 and rounded."""
  f32, dtype = jnp.float32, x.dtype
  e = jnp.exp(-x.astype(f32)).astype(dtype)
  return (1 / (e.astype(f32) + 1).astype(dtype).astype(f32)).astype(dtype)


def swiglu_projection(x: Float[Array, "M D"], scale: Float[Array, "D"],
                      w_gate: Float[Array, "D F"], w_up: Float[Array, "D F"], *, eps: float,
                      interpret: bool = False) -> Float[Array, "M F"]:
  """``silu(n @ w_gate) * (n @ w_up)``, ``n = rms_norm(x, scale, eps)``, in ONE pallas_call.

  Grid ``(ceil(M / bm), F / bn)``: each program accumulates the same column block of gate and
  up (two float32 accumulators) and combines them. Output ``[M, F]`` in ``x.dtype``.
  """
  m, d = x.shape
  f = w_gate.shape[1]
  if scale.shape != (d,) or w_gate.shape != (d, f) or w_up.shape != (d, f):
    raise ValueError(f"swiglu_projection: x {x.shape}, scale {scale.shape}, w_gate "
                     f"{w_gate.shape}, w_up {w_up.shape} do not agree")
  _check("swiglu_projection", m, d, f)
  bm, bn, bk = _block_m(m), _block(f, BLOCK_N), _block(d, BLOCK_K)
  kernel = functools.partial(_swiglu_kernel, eps=eps, bm=bm, bn=bn, bk=bk)
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(m, bm), f // bn), out_shape=jax.ShapeDtypeStruct((m, f), x.dtype),
      compiler_params=_compiler_params(), interpret=interpret, name="swiglu_projection",
  )(x, scale, w_gate, w_up)


def _residual_kernel(a_ref, w_ref, r_ref, *refs, has_bias: bool, bm: int, bn: int, bk: int):
  b_ref, o_ref = refs if has_bias else (None, refs[0])
  rows = _Rows(bm, a_ref.shape[0])
  c0 = pl.multiple_of(pl.program_id(1) * bn, bn)
  (acc,) = _products(a_ref, (w_ref,), rows, c0, bn, bk)
  dtype = o_ref.dtype
  y = acc.astype(dtype)
  if b_ref is not None:
    y = y + b_ref[pl.ds(c0, bn)].astype(dtype)[None, :]
  rows.store(o_ref, c0, rows.load(r_ref, c0, bn).astype(dtype) + y)


def residual_projection(a: Float[Array, "M K"], w: Float[Array, "K D"],
                        residual: Float[Array, "M D"], bias: Float[Array, "D"] | None = None,
                        *, interpret: bool = False) -> Float[Array, "M D"]:
  """``residual + (a @ w (+ bias))``, in ONE pallas_call (attention's o projection, the MLP's
  down projection).

  Grid ``(ceil(M / bm), D / bn)``; each program loops over ``K`` and adds its block of
  ``residual`` to the rounded product. Output ``[M, D]`` in ``a.dtype``.
  """
  m, k = a.shape
  d = w.shape[1]
  if w.shape != (k, d) or residual.shape != (m, d) or (bias is not None
                                                         and bias.shape != (d,)):
    raise ValueError(f"residual_projection: a {a.shape}, w {w.shape}, residual "
                     f"{residual.shape}, bias {None if bias is None else bias.shape} "
                     f"do not agree")
  _check("residual_projection", m, k, d)
  bm, bn, bk = _block_m(m), _block(d, BLOCK_N), _block(k, BLOCK_K)
  kernel = functools.partial(_residual_kernel, has_bias=bias is not None, bm=bm, bn=bn, bk=bk)
  return pl.pallas_call(
      kernel, grid=(pl.cdiv(m, bm), d // bn), out_shape=jax.ShapeDtypeStruct((m, d), a.dtype),
      compiler_params=_compiler_params(), interpret=interpret, name="residual_projection",
  )(a, w, residual, *(() if bias is None else (bias,)))
