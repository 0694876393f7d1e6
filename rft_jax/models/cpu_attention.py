r"""A decode step's attention on CPU as one compiled kernel (``cpu_attention.cc``, an XLA FFI
custom call): what :func:`rft_jax.models.feature_major.attend` computes, faster.

XLA:CPU runs that step's attention as a few small fusions: the score sum over ``H`` on one
thread, every cache slot read (live or not, up to the cache's length). On the peers' large model
(32 rows, 176 slots, two cores) attention is about a quarter of a decode step
(``python benchmarks/speed/decode_layout.py``). The kernel reads each row's cache only from its
first to its last live slot (a left-padded prompt's padding and the slots not yet written are
skipped, as a paged cache would), accumulates the scores along contiguous slots, and splits the
rows over XLA's intra-op thread pool. Per (row, key head) pair, with ``s`` over the live
slots::

  scores[g, s] = sum_h q[g, h] k[h, s] / sqrt(H)
  p[g, :]      = softmax(scores[g, :])        # masked slots get probability 0
  out[g, :]    = sum_s p[g, s] v[s, :]

in float32, as ``attend`` does; only the summation order and ``exp`` (a polynomial good to about
2e-7) differ (``tests/test_cpu_attention.py`` compares them). On that model the decode step's
attention takes 7.0 ms of 39.5 where ``attend`` takes 12.0 of 44.5 (``python
benchmarks/speed/decode_layout.py --rounds 5``, medians, 2026-11-27: 64 steps after 48 prompt slots;
``python benchmarks/speed/cpu_attention.py`` times one layer's call).

Its vectors are one register wide on the CPU it is built for (8 float lanes with AVX2, 16 with
AVX-512). Written with 16-lane vectors throughout, it spilled them on an AVX2 machine (the AMD
EPYC of 2026-11-26): the large model's layer took 2.0 ms against XLA's 1.5, and 0.7-1.1 ms with
register-wide vectors (``python benchmarks/speed/cpu_attention.py``, a loaded machine; the peers'
small model's decode step at 64 rows: ``python benchmarks/speed/cpu_decode_step.py``). Each lane's
sums run in the same order at any width, and the softmax normaliser is summed by 16 lanes at
any width, so its results do not depend on the register width.

The kernel is C++ built on first use with the machine's compiler (``c++ -O3 -march=native``)
into ``$XDG_CACHE_HOME/rft_jax`` (``~/.cache/rft_jax``), keyed by its source, jax's version and
the CPU, then registered with XLA. Where that fails (no compiler, or it fails) :func:`available`
logs why, once, and the sampler uses ``attend``; so it does with ``RFT_JAX_CPU_ATTENTION=0``, and
on a mesh of several devices (XLA cannot split a custom call over one).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_attention.cc")
_TARGET = "rft_jax_decode_attention"
_log = logging.getLogger(__name__)


def _cpu_signature() -> str:
  """What ``-march=native`` compiles for: the CPU's model and feature flags."""
  try:
    with open("/proc/cpuinfo") as f:
      return "".join(l for l in f if l.startswith(("model name", "flags", "Features"))).strip()
  except OSError:
    return platform.processor()


def _build(compiler: str, out: str) -> None:
  """Compiles the kernel into the shared library ``out`` (atomically: a temporary, renamed)."""
  os.makedirs(os.path.dirname(out), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
  os.close(fd)
  try:
    cmd = [compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
           f"-I{jax.ffi.include_dir()}", _SOURCE, "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


@functools.cache
def available() -> bool:
  """Whether the kernel is built and registered (once per process; False says why in the log)."""
  if os.environ.get("RFT_JAX_CPU_ATTENTION", "1") == "0":
    return False
  compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if compiler is None:
    _log.warning("CPU decode attention kernel off: no C++ compiler (c++, g++ or $CXX) found")
    return False
  with open(_SOURCE, "rb") as f:
    source = f.read()
  key = hashlib.sha256(b"\0".join([source, jax.__version__.encode(), compiler.encode(),
                                   _cpu_signature().encode()])).hexdigest()[:16]
  cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rft_jax")
  library = os.path.join(cache, f"cpu_attention-{key}.so")
  try:
    if not os.path.exists(library):
      _build(compiler, library)
    handler = ctypes.cdll.LoadLibrary(library).RftDecodeAttention
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(handler), platform="cpu")
  except (OSError, RuntimeError, subprocess.SubprocessError) as e:
    _log.warning("CPU decode attention kernel off: %s", e)
    return False
  return True


def attend(q: Float[Array, "B K G H"], k_cache: Float[Array, "B K H S"],
           v_cache: Float[Array, "B K S H"], mask: Bool[Array, "B S"]) -> Float[Array, "B K G H"]:
  """:func:`~rft_jax.models.feature_major.attend` by the kernel, in float32, on one CPU device
  (XLA cannot split a custom call over a mesh); where :func:`available` is False, an error."""
  if not available():
    raise RuntimeError("the CPU decode attention kernel is off (RFT_JAX_CPU_ATTENTION=0) or could "
                       "not be built (the log says why): use feature_major.attend")
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                          vmap_method="sequential")
  out = call(q.astype(jnp.float32), k_cache.astype(jnp.float32), v_cache.astype(jnp.float32), mask)
  return out.astype(q.dtype)
