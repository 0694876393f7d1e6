"""The decode-step projection kernels (``rft_jax.models.decode.decode_projections``) in Pallas'
interpret mode, against the XLA maths the decoder runs (``rms_norm``, products accumulated in
float32 and rounded, biases, SwiGLU and residual adds in the compute dtype).

float32 is held to ~1e-5: only the order of the float32 sums differs (the kernels add blocks of
the contracted axis one after the other). bfloat16 is held to about one bfloat16 step (2^-8
relative) of the result's scale: the same float32 sums, differently ordered, land on the other
side of a bfloat16 rounding boundary now and then, and the ops after the rounding (bias,
silu * up, the residual add) carry that step along; most elements must still agree exactly.
The Triton compile for a GPU is not checked here (it needs the CUDA plugin)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax.models.decode.decode_projections import (fits, norm_projections, residual_projection,
                                               swiglu_projection)
from rft_jax.models.layers import rms_norm

# The compiled Triton kernel on a GPU (benchmarks/accelerator/gpu.sh tests), elsewhere Pallas'
# interpret mode.
INTERPRET = jax.default_backend() != "gpu"

EPS = 1e-6
# Widths: D = 192 (blocks of 64 along the contracted axis), q 128, k/v 64, F 256 (blocks of 128).
D, Q, KV, F = 192, 128, 64, 256
# M = 16: whole blocks of 16 rows; 8: a block of 16 with 8 masked rows; 40: 64 with 24 masked.
ROWS = (16, 8, 40)
DTYPES = (jnp.float32, jnp.bfloat16)
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2 ** -7}  # relative to the result's scale
MOSTLY_EXACT = 0.9  # bfloat16: the share of elements that must agree bit for bit


def _normal(key: int, shape, dtype, scale: float = 1.0):
  rng = np.random.default_rng(key)
  return jnp.asarray(rng.normal(size=shape) * scale, dtype)


def _product(a, w):
  """A projection as the XLA path computes it: float32 accumulation, rounded to a's dtype."""
  return jnp.dot(a, w.astype(a.dtype), preferred_element_type=jnp.float32).astype(a.dtype)


def _bias(y, b):
  return y if b is None else y + b.astype(y.dtype)


def _close(actual, expected, dtype):
  assert actual.dtype == expected.dtype == dtype and actual.shape == expected.shape
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  scale = float(np.max(np.abs(expected)))
  np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE[dtype] * scale)
  if dtype == jnp.bfloat16:
    assert np.mean(actual == expected) >= MOSTLY_EXACT


def _pallas_calls(fn, *args) -> list[str]:
  """The primitives of ``fn``'s jaxpr (outside the kernels)."""
  return [e.primitive.name for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_norm_projections_equal_rms_norm_then_the_products(dtype, m, with_bias):
  x = _normal(1, (m, D), dtype)
  scale = _normal(2, (D,), dtype, 0.1) + 1
  weights = tuple(_normal(3 + i, (D, n), dtype, D ** -0.5) for i, n in enumerate((Q, KV, KV)))
  biases = tuple(_normal(6 + i, (n,), dtype, 0.5) for i, n in enumerate((Q, KV, KV)))
  if not with_bias:
    biases = None
  got = jax.jit(lambda *a: norm_projections(*a, eps=EPS, interpret=INTERPRET))(
      x, scale, weights, biases)
  normed = rms_norm(x, scale, EPS)
  for out, w, b in zip(got, weights, biases or (None,) * 3):
    _close(out, _bias(_product(normed, w), b), dtype)


def test_norm_projections_take_a_bias_for_some_weights_only_and_weights_of_another_dtype():
  x = _normal(1, (8, D), jnp.bfloat16)
  scale = _normal(2, (D,), jnp.float32, 0.1) + 1  # params in float32, cast inside the kernel
  weights = (_normal(3, (D, Q), jnp.float32, D ** -0.5), _normal(4, (D, KV), jnp.float32, 0.1))
  biases = (None, _normal(5, (KV,), jnp.float32))
  got = jax.jit(lambda *a: norm_projections(*a, eps=EPS, interpret=INTERPRET))(
      x, scale, weights, biases)
  normed = rms_norm(x, scale, EPS)
  _close(got[0], _product(normed, weights[0]), jnp.bfloat16)
  _close(got[1], _bias(_product(normed, weights[1]), biases[1]), jnp.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
def test_swiglu_projection_equals_the_mlps_gate_and_up(dtype, m):
  x = _normal(1, (m, D), dtype)
  scale = _normal(2, (D,), dtype, 0.1) + 1
  w_gate, w_up = _normal(3, (D, F), dtype, D ** -0.5), _normal(4, (D, F), dtype, D ** -0.5)
  got = jax.jit(lambda *a: swiglu_projection(*a, eps=EPS, interpret=INTERPRET))(
      x, scale, w_gate, w_up)
  normed = rms_norm(x, scale, EPS)
  _close(got, jax.nn.silu(_product(normed, w_gate)) * _product(normed, w_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k", [Q, F])  # attention's o projection, the MLP's down projection
@pytest.mark.parametrize("with_bias", [True, False])
def test_residual_projection_adds_the_rounded_product(dtype, m, k, with_bias):
  a = _normal(1, (m, k), dtype)
  w = _normal(2, (k, D), dtype, k ** -0.5)
  residual = _normal(3, (m, D), dtype, 4.0)
  bias = _normal(4, (D,), dtype, 0.5) if with_bias else None
  got = jax.jit(lambda *a: residual_projection(*a, interpret=INTERPRET))(a, w, residual, bias)
  _close(got, residual + _bias(_product(a, w), bias), dtype)


def test_each_function_is_one_pallas_call():
  x, scale = jnp.zeros((16, D), jnp.bfloat16), jnp.ones((D,), jnp.bfloat16)
  wq, wk = jnp.zeros((D, Q), jnp.bfloat16), jnp.zeros((D, KV), jnp.bfloat16)
  bq, bk = jnp.zeros((Q,), jnp.bfloat16), jnp.zeros((KV,), jnp.bfloat16)
  w_gate = jnp.zeros((D, F), jnp.bfloat16)
  assert _pallas_calls(lambda *a: norm_projections(*a[:2], a[2:5], a[5:], eps=EPS),
                       x, scale, wq, wk, wk, bq, bk, bk) == ["pallas_call"]
  assert _pallas_calls(lambda *a: swiglu_projection(*a, eps=EPS),
                       x, scale, w_gate, w_gate) == ["pallas_call"]
  assert _pallas_calls(residual_projection, jnp.zeros((16, F), jnp.bfloat16),
                       jnp.zeros((F, D), jnp.bfloat16), x, jnp.zeros((D,), jnp.bfloat16)
                       ) == ["pallas_call"]


def test_fits_takes_the_qwen_shapes_and_refuses_the_rest():
  for d, q, kv, f in ((896, 896, 128, 4864), (1536, 1536, 256, 8960),
                      (3584, 3584, 512, 18944)):
    for m in (1, 8, 64, 100, 256):
      assert fits(m, d, q, kv, kv) and fits(m, d, f) and fits(m, f, d)
  assert not fits(0, 896, 896)  # no rows
  assert not fits(8, 896, 96)  # a width that is no multiple of 64
  assert not fits(8, 100)
  assert not fits(8, 0)


def test_shapes_the_kernels_cannot_take_are_refused():
  x, scale = jnp.zeros((8, 96), jnp.float32), jnp.ones((96,), jnp.float32)
  with pytest.raises(ValueError, match="do not fit"):
    norm_projections(x, scale, (jnp.zeros((96, 64), jnp.float32),), eps=EPS, interpret=INTERPRET)
  with pytest.raises(ValueError, match="do not fit"):
    swiglu_projection(jnp.zeros((8, 128)), jnp.ones((128,)), jnp.zeros((128, 96)),
                      jnp.zeros((128, 96)), eps=EPS, interpret=INTERPRET)
  with pytest.raises(ValueError, match="do not fit"):
    residual_projection(jnp.zeros((8, 96)), jnp.zeros((96, 128)), jnp.zeros((8, 128)),
                        interpret=INTERPRET)
  with pytest.raises(ValueError, match="do not agree"):
    residual_projection(jnp.zeros((8, 128)), jnp.zeros((128, 128)), jnp.zeros((4, 128)),
                        interpret=INTERPRET)
  with pytest.raises(ValueError, match="biases"):
    norm_projections(jnp.zeros((8, 128)), jnp.ones((128,)), (jnp.zeros((128, 64)),),
                     (None, None), eps=EPS, interpret=INTERPRET)
