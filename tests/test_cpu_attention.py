"""The compiled CPU decode attention (``rft_jax.models.cpu_attention``) against
``feature_major.attend``, the XLA form it replaces, and when the sampler uses it."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from rft_jax.models import KVCache, cpu_attention, feature_major
from rft_jax.sampling.loop import cpu_attention_for

# (B, K, G, H, S): paired and odd query heads; H a multiple of 64, with a remainder, below 64;
# slot counts around the kernel's 16- and 64-slot tiles.
SHAPES = [(3, 2, 2, 64, 40), (2, 1, 3, 80, 17), (4, 2, 1, 16, 70), (1, 1, 4, 128, 130),
          (2, 3, 7, 64, 64)]


def _inputs(b, k, g, h, s, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, k, g, h)).astype(np.float32)
  keys = rng.standard_normal((b, k, h, s)).astype(np.float32)
  values = rng.standard_normal((b, k, s, h)).astype(np.float32)
  return q, keys, values, rng


def _masks(b, s, rng):
  """Decoding's masks (left-padded prompts, then every slot up to the one written), a mask with
  gaps, and one with a single live slot per row."""
  prompt, index = s // 3, s - 1 - s // 5
  lengths = rng.integers(1, prompt + 1, b)
  slots = np.arange(s)[None]
  decoding = ((slots >= prompt - lengths[:, None]) & (slots < prompt)) | \
      ((slots >= prompt) & (slots <= index))
  gaps = rng.random((b, s)) < 0.4
  gaps[:, -1] = True
  single = np.zeros((b, s), bool)
  single[np.arange(b), rng.integers(0, s, b)] = True
  return {"decoding": decoding, "gaps": gaps, "single": single}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda x: "x".join(map(str, x)))
def test_kernel_equals_attend(shape):
  """Every mask kind, inside ``jit``: equal to ``attend`` up to float32 summation order."""
  assert cpu_attention.available()
  q, keys, values, rng = _inputs(*shape)
  kernel = jax.jit(cpu_attention.attend)
  for name, mask in _masks(shape[0], shape[-1], rng).items():
    want = feature_major.attend(q, keys, values, jnp.asarray(mask))
    got = kernel(q, keys, values, jnp.asarray(mask))
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=name)


def test_a_row_without_live_slots_averages_every_value_as_attend_does():
  """Never in decoding (the slot written is live), but defined as ``attend``'s softmax over
  equal masked scores: the mean of the values."""
  q, keys, values, rng = _inputs(2, 2, 2, 64, 24)
  mask = np.ones((2, 24), bool)
  mask[1] = False
  np.testing.assert_allclose(cpu_attention.attend(q, keys, values, jnp.asarray(mask)),
                             feature_major.attend(q, keys, values, jnp.asarray(mask)),
                             rtol=2e-5, atol=2e-6)


def test_nan_stays_nan():
  """A NaN in one query gives NaN attention for that query, as ``attend`` does, and leaves the
  others finite (the kernel's ``exp`` must not clamp NaN to a number)."""
  q, keys, values, rng = _inputs(2, 2, 2, 64, 40)
  q[1, 0, 1, 5] = np.nan
  mask = jnp.asarray(_masks(2, 40, rng)["decoding"])
  got = np.isnan(np.asarray(cpu_attention.attend(q, keys, values, mask))).any(axis=-1)
  want = np.zeros((2, 2, 2), bool)
  want[1, 0, 1] = True
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.isnan(feature_major.attend(q, keys, values, mask)).any(-1), want)


def test_off_or_unbuildable_falls_back_with_one_line(monkeypatch, tmp_path, caplog):
  """``RFT_JAX_CPU_ATTENTION=0`` turns the kernel off; a compiler that fails turns it off with
  one logged line naming the command; the sampler then uses ``attend``."""
  cache = KVCache(k=(jnp.zeros((2, 1, 4, 8)),), v=(jnp.zeros((2, 1, 8, 4)),),
                  slot_mask=jnp.zeros((2, 8), bool), positions=jnp.zeros(2, jnp.int32),
                  index=jnp.int32(0))
  try:
    with monkeypatch.context() as m:
      m.setenv("RFT_JAX_CPU_ATTENTION", "0")
      cpu_attention.available.cache_clear()
      assert not cpu_attention.available()
      assert cpu_attention_for(cache, None) is feature_major.attend
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING):
      m.setenv("CXX", "false")
      m.setenv("XDG_CACHE_HOME", str(tmp_path))
      cpu_attention.available.cache_clear()
      assert not cpu_attention.available()
    lines = [r.getMessage() for r in caplog.records if "kernel off" in r.getMessage()]
    assert len(lines) == 1 and "false -O3" in lines[0] and "\n" not in lines[0]
  finally:
    cpu_attention.available.cache_clear()
  assert cpu_attention.available()


def test_the_sampler_uses_the_kernel_for_a_float32_cache_on_one_device():
  """One device and float32: the kernel; a bfloat16 cache, or rows over a mesh of several
  devices (XLA cannot split a custom call): ``attend``."""
  def cache(dtype):
    return KVCache(k=(jnp.zeros((2, 1, 4, 8), dtype),), v=(jnp.zeros((2, 1, 8, 4), dtype),),
                   slot_mask=jnp.zeros((2, 8), bool), positions=jnp.zeros(2, jnp.int32),
                   index=jnp.int32(0))
  one = Mesh(np.asarray(jax.devices()[:1]), ("data",))
  assert cpu_attention_for(cache(jnp.float32), None) is cpu_attention.attend
  assert cpu_attention_for(cache(jnp.float32), one) is cpu_attention.attend
  assert cpu_attention_for(cache(jnp.bfloat16), None) is feature_major.attend
  if len(jax.devices()) > 1:
    two = Mesh(np.asarray(jax.devices()[:2]), ("data",))
    assert cpu_attention_for(cache(jnp.float32), two) is feature_major.attend
