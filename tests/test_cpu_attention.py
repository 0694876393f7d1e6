"""The compiled CPU decode attention (``rft_jax.models.decode.cpu_attention``) against
``feature_major.attend``, the XLA form it replaces, how it is built, and when the sampler uses it.
Built by ``tests/conftest.py`` (``cpu_kernel``) as ``rft-jax build-kernels`` builds it; every
array here is on the CPU backend, also where the default one is an accelerator (the kernel has a
handler on CPU only)."""

from __future__ import annotations

import ctypes
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from rft_jax import cli
from rft_jax.models import KVCache
from rft_jax.models.decode import cpu_attention, feature_major
from rft_jax.sampling import decoder
from rft_jax.sampling.decoder import cpu_attention_for

# (B, K, G, H, S): paired and odd query heads; H a multiple of 64, with a remainder, below 64;
# slot counts around the kernel's 16- and 64-slot tiles.
SHAPES = [(3, 2, 2, 64, 40), (2, 1, 3, 80, 17), (4, 2, 1, 16, 70), (1, 1, 4, 128, 130),
          (2, 3, 7, 64, 64)]


@pytest.fixture(autouse=True)
def on_cpu():
  with jax.default_device(jax.devices("cpu")[0]):
    yield


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
def test_kernel_equals_attend(shape, cpu_kernel):
  """Every mask kind, inside ``jit``: equal to ``attend`` up to float32 summation order."""
  q, keys, values, rng = _inputs(*shape)
  kernel = jax.jit(cpu_attention.attend)
  for name, mask in _masks(shape[0], shape[-1], rng).items():
    want = feature_major.attend(q, keys, values, jnp.asarray(mask))
    got = kernel(q, keys, values, jnp.asarray(mask))
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=name)


def test_a_row_without_live_slots_averages_every_value_as_attend_does(cpu_kernel):
  """Never in decoding (the slot written is live), but defined as ``attend``'s softmax over
  equal masked scores: the mean of the values."""
  q, keys, values, rng = _inputs(2, 2, 2, 64, 24)
  mask = np.ones((2, 24), bool)
  mask[1] = False
  np.testing.assert_allclose(cpu_attention.attend(q, keys, values, jnp.asarray(mask)),
                             feature_major.attend(q, keys, values, jnp.asarray(mask)),
                             rtol=2e-5, atol=2e-6)


def test_nan_stays_nan(cpu_kernel):
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


@pytest.mark.parametrize("shape", [(3, 2, 2, 64, 128), (2, 1, 3, 80, 64), (2, 3, 7, 16, 192)],
                         ids=lambda x: "x".join(map(str, x)))
def test_tiled_keys_give_the_same_bits(shape, cpu_kernel):
  """Keys tiled by ``tile_keys`` (``[B, K, S / 64, H, 64]``, what the CPU pool holds) give the
  bits of ``[B, K, H, S]`` keys, every mask kind (the kernel reads the same slots in the same
  order in both layouts), and ``untile_keys`` gives the keys back."""
  q, keys, values, rng = _inputs(*shape)
  tiled = cpu_attention.tile_keys(jnp.asarray(keys))
  assert tiled.shape == (shape[0], shape[1], shape[-1] // 64, shape[3], 64)
  np.testing.assert_array_equal(cpu_attention.untile_keys(tiled), keys)
  kernel = jax.jit(cpu_attention.attend)
  for name, mask in _masks(shape[0], shape[-1], rng).items():
    want = np.asarray(kernel(q, keys, values, jnp.asarray(mask)))
    got = np.asarray(kernel(q, tiled, values, jnp.asarray(mask)))
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32), err_msg=name)


def test_write_tiled_keys_writes_what_write_slots_writes():
  """One token's keys written into tiled keys, at a shared slot and at one slot per row, equal
  the untiled write, tiled, also past the last slot (clamped to it); a cache of a partial tile
  is refused in one line."""
  from rft_jax.models.kv_cache import write_slots
  rng = np.random.default_rng(3)
  keys = jnp.asarray(rng.standard_normal((3, 2, 16, 128)), jnp.float32)
  token = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
  for index in (jnp.int32(70), jnp.asarray([0, 63, 127], jnp.int32), jnp.int32(130),
                jnp.asarray([128, 5, 200], jnp.int32)):
    want = cpu_attention.tile_keys(write_slots(keys, token[..., None], index, axis=3))
    got = jax.jit(cpu_attention.write_tiled_keys)(cpu_attention.tile_keys(keys), token, index)
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="70 slots is not a multiple of the tile, 64"):
    cpu_attention.tile_keys(keys[..., :70])


def test_every_x86_64_build_gives_the_same_bits(cpu_kernel, monkeypatch, tmp_path):
  """The x86-64-v2 build (4 lanes, no AVX) and this machine's x86-64-v3 one (8 lanes) agree bit
  for bit on every shape and mask kind: each lane's sums run in the same order at any width and
  nothing is fused into an FMA (``-ffp-contract=off``), so any x86-64 CPU gives these bits."""
  if cpu_attention.target() != "x86-64-v3":
    pytest.skip(f"this CPU builds {cpu_attention.target()}, not x86-64-v3")
  with monkeypatch.context() as m:
    m.setenv("XDG_CACHE_HOME", str(tmp_path))
    library = cpu_attention.build("x86-64-v2")
  assert "x86-64-v2" in library and library.startswith(str(tmp_path))
  handler = ctypes.cdll.LoadLibrary(library).RftDecodeAttention
  jax.ffi.register_ffi_target("rft_jax_decode_attention_v2", jax.ffi.pycapsule(handler),
                              platform="cpu")
  for shape in SHAPES:
    q, keys, values, rng = _inputs(*shape)
    v2 = jax.ffi.ffi_call("rft_jax_decode_attention_v2", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    for name, mask in _masks(shape[0], shape[-1], rng).items():
      want = np.asarray(cpu_attention.attend(q, keys, values, jnp.asarray(mask)))
      got = np.asarray(v2(q, keys, values, jnp.asarray(mask)))
      np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32), err_msg=name)


def _cache(dtype=jnp.float32):
  return KVCache(k=(jnp.zeros((2, 1, 4, 8), dtype),), v=(jnp.zeros((2, 1, 8, 4), dtype),),
                 slot_mask=jnp.zeros((2, 8), bool), positions=jnp.zeros(2, jnp.int32),
                 index=jnp.int32(0))


def test_off_or_not_built_falls_back_to_xla_with_one_line(cpu_kernel, monkeypatch, tmp_path,
                                                           caplog):
  """``RFT_JAX_CPU_ATTENTION=0`` turns the kernel off; not built (an empty cache directory), it is
  off with one logged line saying how to build it, and nothing is compiled: the sampler's
  attention is then XLA's, with its results; the kernel's own call is an error."""
  q, keys, values, rng = _inputs(3, 2, 2, 64, 40)
  mask = jnp.asarray(_masks(3, 40, rng)["decoding"])
  want = np.asarray(jax.jit(feature_major.attend)(q, keys, values, mask))
  try:
    with monkeypatch.context() as m:
      m.setenv("RFT_JAX_CPU_ATTENTION", "0")
      cpu_attention.available.cache_clear()
      assert not cpu_attention.available()
      assert cpu_attention_for(_cache(), None) is feature_major.attend
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING):
      m.setenv("XDG_CACHE_HOME", str(tmp_path))
      cpu_attention.available.cache_clear()
      attention = cpu_attention_for(_cache(), None)
      assert not cpu_attention.available()
      got = np.asarray(jax.jit(attention)(q, keys, values, mask))
      with pytest.raises(RuntimeError, match="not built .*rft-jax build-kernels"):
        cpu_attention.attend(q, keys, values, mask)
    assert not list(tmp_path.rglob("*")), "a sampling call compiled the kernel"
    lines = [r.getMessage() for r in caplog.records if "kernel off" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "not built" in lines[0] and "rft-jax build-kernels" in lines[0] and "XLA" in lines[0]
    assert attention is feature_major.attend
    np.testing.assert_array_equal(got, want)
  finally:
    cpu_attention.available.cache_clear()
  assert cpu_attention.available()


def test_build_kernels_command(cpu_kernel, monkeypatch, tmp_path, capsys):
  """``rft-jax build-kernels`` names the library it built (or finds built); a compiler that fails
  is one error line naming its command, exit 1, and no library."""
  assert cli.main(["build-kernels"]) == 0
  assert cpu_attention.library_path() in capsys.readouterr().out
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  monkeypatch.setenv("CXX", "false")
  try:
    assert cli.main(["build-kernels"]) == 1
  finally:
    cpu_attention.available.cache_clear()
  err = capsys.readouterr().err.strip()
  assert err.startswith("rft-jax build-kernels: error: false -O3") and "\n" not in err, err
  assert "-march=" in err or not cpu_attention.target().startswith("x86-64")
  assert not list(tmp_path.rglob("*.so"))


def test_the_sampler_uses_the_kernel_for_a_float32_cache_on_one_cpu_device(cpu_kernel,
                                                                           monkeypatch):
  """One CPU device and float32: the kernel; a bfloat16 cache, rows over a mesh of several
  devices (XLA cannot split a custom call), or another platform: ``attend``."""
  cpus = jax.devices("cpu")
  one = Mesh(np.asarray(cpus[:1]), ("data",))
  on_cpu = jax.default_backend() == "cpu"
  assert cpu_attention_for(_cache(), None) is (cpu_attention.attend if on_cpu
                                               else feature_major.attend)
  assert cpu_attention_for(_cache(), one) is cpu_attention.attend
  assert cpu_attention_for(_cache(jnp.bfloat16), one) is feature_major.attend
  if len(cpus) > 1:
    two = Mesh(np.asarray(cpus[:2]), ("data",))
    assert cpu_attention_for(_cache(), two) is feature_major.attend
  monkeypatch.setattr(decoder, "platform_of", lambda mesh: "gpu")
  assert cpu_attention_for(_cache(), None) is feature_major.attend
