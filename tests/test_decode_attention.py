"""The fused decode-attention kernel (``rft_jax.models.decode.decode_attention``) in Pallas' interpret
mode against the XLA path of ``DecoderLayer.extend`` built from the repository's own functions
(q/k RMSNorm, ``rotate``, ``write_slots``, ``visible_slots``, ``attend_cache``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax.models.attention import attend_cache
from rft_jax.models.decode.decode_attention import fused_decode_attention, slot_block
from rft_jax.models.kv_cache import query_slots, visible_slots, write_slots
from rft_jax.models.layers import rms_norm, rope_cos_sin, rope_inv_freq, rotate

# The compiled Triton kernel on a GPU (benchmarks/accelerator/gpu.sh tests), elsewhere Pallas'
# interpret mode.
INTERPRET = jax.default_backend() != "gpu"

EPS = 1e-6


THETA = 1e6


def _xla_step(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mask, index, q_norm, k_norm):
  """``DecoderLayer.extend`` after the projections, for one new token per row."""
  q, k, v = q[:, None], k[:, None], v[:, None]  # [B, 1, n, H]
  if q_norm is not None:
    q, k = rms_norm(q, q_norm, EPS), rms_norm(k, k_norm, EPS)
  rope = _tables(positions, inv_freq, q.dtype)
  q, k = rotate(q, *rope), rotate(k, *rope)
  k_cache = write_slots(k_cache, k.transpose(0, 2, 3, 1), index, axis=3)
  v_cache = write_slots(v_cache, v.transpose(0, 2, 1, 3), index, axis=2)
  mask = visible_slots(slot_mask, query_slots(index, q.shape[0], 1))
  o = attend_cache(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)
  return o[:, 0], k_cache, v_cache


def _tables(positions, inv_freq, dtype):
  """``rope_cos_sin``'s tables at ``positions`` from the kernel's own ``inv_freq`` (the same bits:
  at positions near 1,000 an ulp of the frequency moves the angle by ~1e-4 radians)."""
  angles = positions.astype(jnp.float32)[:, None] * inv_freq
  angles = jnp.concatenate([angles, angles], axis=-1)[:, None, None, :]  # [B, 1, 1, H]
  return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def test_tables_are_rope_cos_sin():
  positions = jnp.arange(40, dtype=jnp.int32)
  ours = jax.jit(_tables, static_argnums=2)(positions, rope_inv_freq(64, THETA), jnp.float32)
  theirs = jax.jit(rope_cos_sin, static_argnums=(1, 2, 3))(positions[:, None], 64, THETA, jnp.float32)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a[:, 0], b[:, 0], atol=1e-6)


def _kernel_step(*args):
  *args, q_norm, k_norm = args
  return fused_decode_attention(*args, q_norm=q_norm, k_norm=k_norm, norm_eps=EPS,
                                interpret=INTERPRET)


def _inputs(rng, b, n, kv, h, s, dtype, index, norm):
  """Random inputs; ``slot_mask``: rows with holes (left padding), a row that sees only its new
  slot (the last but one) and a row that sees nothing (the last); the new slot set on all but
  that last row, as ``Qwen.extend`` passes it."""
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  positions = jnp.asarray(rng.integers(0, 4 * s, (b,)), jnp.int32)
  mask = jnp.asarray(rng.random((b, s)) < 0.7).at[:, :3].set(False)
  only_new = write_slots(jnp.zeros((b, s), jnp.bool_), jnp.ones((b, 1), jnp.bool_), index, axis=1)
  mask = write_slots(mask, jnp.ones((b, 1), jnp.bool_), index, axis=1)
  mask = mask.at[b - 2].set(only_new[b - 2]).at[b - 1].set(False)
  norms = (f(h), f(h)) if norm else (None, None)
  return (f(b, n, h), f(b, kv, h), f(b, kv, h), positions, rope_inv_freq(h, THETA),
          f(b, kv, h, s), f(b, kv, s, h), mask, index, *norms)


def _ulp(x, dtype):
  """One unit in the last place of ``dtype`` at ``x`` (as float32)."""
  bits = 2 ** (23 - jnp.finfo(dtype).nmant)
  return np.spacing(np.abs(np.asarray(x, np.float32))) * bits


# (dtype, query heads, kv heads, head width, slots, per-row index, q/k norm). float32 agrees
# to 1e-5 (summation order, the online softmax); bfloat16 to a few bfloat16 ulps: the kernel
# rounds unnormalised probabilities to bfloat16 for the value product (XLA normalised ones) and
# keeps that product's sum in float32 (XLA rounds it to bfloat16).
CASES = [
    (jnp.float32, 14, 2, 64, 48, True, True),     # G = 7, index past the last slot
    (jnp.float32, 14, 2, 64, 48, False, False),
    (jnp.float32, 4, 2, 128, 256, True, False),   # G = 2
    (jnp.bfloat16, 14, 2, 128, 256, False, True),
    (jnp.bfloat16, 4, 2, 64, 48, True, True),
]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype,n,kv,h,s,per_row,norm", CASES)
def test_matches_xla_path(dtype, n, kv, h, s, per_row, norm):
  rng = np.random.default_rng(n * h + s)
  b = 5
  index = (jnp.asarray([5, s - 1, s + 12, 20, 9], jnp.int32) if per_row
           else jnp.asarray(s // 2 + 3, jnp.int32))
  args = _inputs(rng, b, n, kv, h, s, dtype, index, norm)
  o, k_cache, v_cache = jax.jit(_kernel_step)(*args)
  o_ref, k_ref, v_ref = jax.jit(_xla_step)(*args)
  assert o.dtype == dtype and o.shape == (b, n, h)
  assert k_cache.dtype == dtype and v_cache.dtype == dtype

  # Every row that sees a slot equals the XLA path; the row that sees none is finite.
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(o[:-1], np.float32), np.asarray(o_ref[:-1], np.float32),
                             atol=tol, rtol=tol)
  assert np.isfinite(np.asarray(o[-1], np.float32)).all()

  # Caches: only the new slot written (clamped to the last), bitwise equal to the XLA path's,
  # except that the new key may differ by one ulp where XLA contracts RoPE's multiply-add into
  # an FMA in one program and not the other (not under the suite's -O0 CPU flags: bitwise there).
  slot = np.minimum(np.broadcast_to(np.asarray(index), (b,)), s - 1)
  k_in, v_in = np.array(args[5]), np.array(args[6])
  np.testing.assert_array_equal(np.asarray(v_cache), np.asarray(v_ref))
  k_out, k_want = np.array(k_cache), np.asarray(k_ref)
  for row in range(b):
    new, want = k_out[row, :, :, slot[row]], k_want[row, :, :, slot[row]]
    assert (np.abs(new.astype(np.float32) - want.astype(np.float32)) <= _ulp(want, dtype)).all()
    k_out[row, :, :, slot[row]] = k_in[row, :, :, slot[row]]
    v_in[row, :, slot[row], :] = np.asarray(v_ref)[row, :, slot[row], :]
  np.testing.assert_array_equal(k_out, k_in)  # the rest untouched
  np.testing.assert_array_equal(np.asarray(v_cache), v_in)


def test_decode_loop_in_place():
  """Three steps in a jitted loop, the caches in the carry and donated: each step sees the keys
  and values the earlier steps wrote, as the XLA path does."""
  rng = np.random.default_rng(1)
  b, n, kv, h, s, steps = 2, 14, 2, 64, 48, 3
  index = jnp.asarray([10, 3], jnp.int32)
  q, k, v, positions, inv_freq, k_cache, v_cache, mask, _, q_norm, k_norm = _inputs(
      rng, b, n, kv, h, s, jnp.float32, index, True)
  mask = mask.at[-1].set(True)
  qs, ks, vs = (jnp.asarray(rng.normal(size=(steps, *x.shape)), jnp.float32) for x in (q, k, v))

  def run(step, k_cache, v_cache):
    def body(i, carry):
      k_cache, v_cache, mask, outs = carry
      at = index + i
      mask = write_slots(mask, jnp.ones((b, 1), jnp.bool_), at, axis=1)
      o, k_cache, v_cache = step(qs[i], ks[i], vs[i], positions + i, inv_freq, k_cache, v_cache,
                                 mask, at,
                                 q_norm, k_norm)
      return k_cache, v_cache, mask, outs.at[i].set(o)
    outs = jnp.zeros((steps, b, n, h), jnp.float32)
    return jax.lax.fori_loop(0, steps, body, (k_cache, v_cache, mask, outs))

  want = jax.jit(lambda kc, vc: run(_xla_step, kc, vc))(k_cache, v_cache)
  got = jax.jit(lambda kc, vc: run(_kernel_step, kc, vc), donate_argnums=(0, 1))(k_cache, v_cache)
  np.testing.assert_allclose(got[3], want[3], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_allclose(got[0], want[0], atol=1e-6, rtol=0)


def test_refuses_bad_shapes():
  assert [slot_block(s) for s in (48, 96, 256, 1280)] == [16, 32, 128, 128]
  with pytest.raises(ValueError, match="multiple of 16"):
    slot_block(40)
  z = jnp.zeros
  with pytest.raises(ValueError, match="do not fit"):
    fused_decode_attention(z((2, 6, 64)), z((2, 4, 64)), z((2, 4, 64)), z(2, jnp.int32), z(32),
                           z((2, 4, 64, 32)), z((2, 4, 32, 64)), z((2, 32), bool),
                           jnp.int32(0), interpret=INTERPRET)
