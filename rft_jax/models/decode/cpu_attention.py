r"""A decode step's attention on CPU as one compiled kernel (``cpu_attention.cc``, an XLA FFI
custom call): what :func:`rft_jax.models.decode.feature_major.attend` computes, faster.

XLA:CPU runs that step's attention as a few small fusions: the score sum over ``H`` on one
thread, every cache slot read (live or not, up to the cache's length); on the peers' large model
that is a large share of a decode step. The kernel reads each row's cache only from its
first to its last live slot (a left-padded prompt's padding and the slots not yet written are
skipped, as a paged cache would), accumulates the scores along contiguous slots, and splits the
rows over XLA's intra-op thread pool. Per (row, key head) pair, with ``s`` over the live
slots::

  scores[g, s] = sum_h q[g, h] k[h, s] / sqrt(H)
  p[g, :]      = softmax(scores[g, :])        # masked slots get probability 0
  out[g, :]    = sum_s p[g, s] v[s, :]

in float32, as ``attend`` does; only the summation order and ``exp`` (a polynomial good to about
2e-7) differ (``tests/test_cpu_attention.py`` compares them). The key rows a score block reads
lie a cache length apart, more streams than the hardware prefetcher follows, so the kernel
fetches each one a block ahead. Figures (the step's attention against ``attend``'s, the
prefetch, the tiles, the vector width, the build target), each with its command and date:
``docs/results/cpu.md#the-decode-attention-kernel``.

The continuous sampler's pool holds its keys **tiled** (:func:`tile_keys`: ``[B, K, S / 64, H,
64]``, the 64 slots of every feature contiguous), which the kernel also reads: a block of slots
is then one stretch of 16 KiB instead of ``H`` rows a cache length apart (more streams than the
prefetcher follows, each in its own page), and a layer's attention runs faster
(``docs/results/cpu.md#tiled-keys``). In both layouts a row's span starts and ends at a
multiple of 16 slots (the slots added are masked; a run of 64 slots is taken at once only
within a tile), so both read the same slots in the same order and give the same bits
(``tests/test_cpu_attention.py``). Multiples of 64 instead (a first version) read too many
padding slots at short contexts.
The static sampler keeps ``[B, K, H, S]`` keys.

Its vectors are one register wide on the target it is built for (8 float lanes on x86-64-v3, 4
on x86-64-v2): written with 16-lane vectors throughout, it spilled them on an AVX2 machine and
ran slower than XLA (``docs/results/cpu.md#register-wide-vectors``). Each lane's sums run in the
same order at any width, and the softmax normaliser is summed by 16 lanes at any width, so its
results do not depend on the register width.

The kernel is C++, built by an explicit step, never by a sampling call: ``rft-jax
build-kernels`` (:func:`build`) compiles it with the machine's compiler (``$CXX``, else ``c++`` or
``g++``) into ``$XDG_CACHE_HOME/rft_jax`` (``~/.cache/rft_jax``), keyed by its source, jax's
version and the build's target (:func:`target`). :func:`available` only loads that library and
registers it with XLA; where it is not built (or cannot be loaded) it logs one line saying so and
how to build it, and the sampler uses ``attend``; so it does with ``RFT_JAX_CPU_ATTENTION=0``, on
a mesh of several devices (XLA cannot split a custom call over one), and off CPU.

It is built for a portable target, not the machine's own CPU: ``x86-64-v3`` (AVX2 and FMA: 8
float lanes) where the CPU has it, else ``x86-64-v2`` (SSE4.2: 4 lanes; else the compiler's
default), with ``-ffp-contract=off`` (no product and sum fused into one FMA, which the build
would otherwise do where the target has FMA). Each lane's sums run in the same order at any width
and no operation is fused, so every x86-64 CPU gets the same bits (``tests/test_cpu_attention.py``
compares the ``x86-64-v2`` and ``x86-64-v3`` builds; the former ``-march=native`` build, with
FMA, was not bit-equal to them). Against that build the portable one costs a few percent of the
kernel's time, no difference a decode step shows (``docs/results/cpu.md#a-portable-build-target``).
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
from jaxtyping import Array, Bool, Float, Int

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_attention.cc")
_TARGET = "rft_jax_decode_attention"
_FLAGS = ["-O3", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC"]
# The x86-64 levels the kernel is built for, widest first, with the /proc/cpuinfo flags each needs.
_X86_LEVELS = (("x86-64-v3", {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe",
                              "xsave"}),
               ("x86-64-v2", {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}))
_log = logging.getLogger(__name__)


def _cpu_flags() -> set[str]:
  """The CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
  try:
    with open("/proc/cpuinfo") as f:
      return set(next((l.split(":", 1)[1] for l in f if l.startswith("flags")), "").split())
  except OSError:
    return set()


def target() -> str:
  """What the kernel is built for on this machine: the widest x86-64 level its CPU runs
  (``x86-64-v3``, ``x86-64-v2``, else ``x86-64``), or elsewhere the architecture (the compiler's
  default target, e.g. ``aarch64``)."""
  machine = platform.machine().lower()
  if machine not in ("x86_64", "amd64"):
    return machine
  flags = _cpu_flags()
  return next((level for level, need in _X86_LEVELS if need <= flags), "x86-64")


def library_path(build_target: str | None = None) -> str:
  """The shared library of the kernel for ``build_target`` (default :func:`target`): in
  ``$XDG_CACHE_HOME/rft_jax``, named by a hash of the source, jax's version, target and flags."""
  build_target = build_target or target()
  with open(_SOURCE, "rb") as f:
    source = f.read()
  key = hashlib.sha256(b"\0".join([source, jax.__version__.encode(), build_target.encode(),
                                   " ".join(_FLAGS).encode()])).hexdigest()[:16]
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return os.path.join(cache, "rft_jax", f"cpu_attention-{build_target}-{key}.so")


def build(build_target: str | None = None, *, force: bool = False) -> str:
  """Compiles the kernel for ``build_target`` (default :func:`target`) into
  :func:`library_path` unless it is there (or ``force``); returns its path. Raises RuntimeError
  naming the missing compiler or the failing command."""
  build_target = build_target or target()
  out = library_path(build_target)
  if os.path.exists(out) and not force:
    return out
  compile_library(_SOURCE, out, build_target)
  available.cache_clear()  # a process that builds it then uses it
  return out


def compile_library(source: str, out: str, build_target: str | None = None) -> None:
  """Compiles the kernel's C++ ``source`` as :func:`build` does (its flags, for ``build_target``)
  into the shared library ``out``, atomically (a temporary, renamed). Raises RuntimeError naming
  the missing compiler or the failing command. (``benchmarks/speed/cpu_attention.py --against``
  builds another version of the source with it.)"""
  build_target = build_target or target()
  compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if compiler is None:
    raise RuntimeError("no C++ compiler (c++, g++ or $CXX) found to build the CPU attention kernel")
  folder = os.path.dirname(os.path.abspath(out))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
  os.close(fd)
  march = [f"-march={build_target}"] if build_target.startswith("x86-64") else []
  cmd = [compiler, *_FLAGS, *march, f"-I{jax.ffi.include_dir()}", source, "-o", tmp]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}): "
                         f"{done.stderr.strip()[-500:]}")
    os.replace(tmp, out)
  except (OSError, subprocess.SubprocessError) as e:
    raise RuntimeError(f"{' '.join(cmd)} failed: {e}") from e
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


@functools.cache
def available() -> bool:
  """Whether the kernel is built for this machine (:func:`build`) and registered with XLA (once
  per process; it never builds it). False, where not turned off, says why in one logged line."""
  if os.environ.get("RFT_JAX_CPU_ATTENTION", "1") == "0":
    return False
  library = library_path()
  if not os.path.exists(library):
    _log.warning("CPU decode attention kernel off: not built for %s (no %s); decoding uses XLA's "
                 "attention. Build it with `rft-jax build-kernels`", target(), library)
    return False
  try:
    register(library)
  except (OSError, AttributeError) as e:
    _log.warning("CPU decode attention kernel off: %s; decoding uses XLA's attention. Rebuild it "
                 "with `rft-jax build-kernels`", e)
    return False
  return True


KEY_TILE = 64  # slots per key tile (a multiple of the kernel's span alignment, 16)


def tile_keys(k_cache: Float[Array, "B K H S"]) -> Float[Array, "B K S/T H T"]:
  """Keys ``[B, K, H, S]`` in the tiled layout the kernel also reads, ``[B, K, S / T, H, T]``
  (``T`` = :data:`KEY_TILE`; ``S`` a multiple of it): the ``T`` slots of every feature
  contiguous, one tile after another, so that a block of slots is one stretch of memory instead
  of ``H`` rows a cache length apart."""
  b, k, h, s = k_cache.shape
  if s % KEY_TILE:
    raise ValueError(f"tile_keys: {s} slots is not a multiple of the tile, {KEY_TILE}")
  return k_cache.reshape(b, k, h, s // KEY_TILE, KEY_TILE).transpose(0, 1, 3, 2, 4)


def untile_keys(k_cache: Float[Array, "B K S/T H T"]) -> Float[Array, "B K H S"]:
  """The inverse of :func:`tile_keys`."""
  b, k, tiles, h, t = k_cache.shape
  return k_cache.transpose(0, 1, 3, 2, 4).reshape(b, k, h, tiles * t)


def tiled_slots(slots: int) -> int:
  """``slots`` rounded up to a whole number of key tiles."""
  return -(-slots // KEY_TILE) * KEY_TILE


def write_tiled_keys(k_cache: Float[Array, "B K S/T H T"], keys: Float[Array, "B K H"],
                     index: Int[Array, ""] | Int[Array, "B"]) -> Float[Array, "B K S/T H T"]:
  """:func:`~rft_jax.models.kv_cache.write_slots` of one token's ``keys`` per row into tiled
  keys at slot ``index`` (shared, or one per row); an index past the last slot writes the last
  slot, as ``write_slots`` clamps it (clamping the tile and the offset within it apart would
  write the last tile at the index's own offset)."""
  t = k_cache.shape[-1]
  index = jnp.clip(index, 0, k_cache.shape[2] * t - 1)
  update = keys[:, :, None, :, None].astype(k_cache.dtype)  # [B, K, 1, H, 1]
  if jnp.ndim(index) == 0:
    return jax.lax.dynamic_update_slice(k_cache, update, (0, 0, index // t, 0, index % t))

  def row(a, u, i):
    return jax.lax.dynamic_update_slice(a, u, (0, i // t, 0, i % t))
  return jax.vmap(row)(k_cache, update, index)


def attend(q: Float[Array, "B K G H"],
           k_cache: Float[Array, "B K H S"] | Float[Array, "B K S/T H T"],
           v_cache: Float[Array, "B K S H"], mask: Bool[Array, "B S"]) -> Float[Array, "B K G H"]:
  """:func:`~rft_jax.models.decode.feature_major.attend` by the kernel, in float32, on one CPU device
  only (XLA cannot split a custom call over a mesh; no other platform has a handler for it); where
  :func:`available` is False, an error. The keys may be tiled (:func:`tile_keys`): the same
  results, bit for bit."""
  if not available():
    raise RuntimeError("the CPU decode attention kernel is off (RFT_JAX_CPU_ATTENTION=0) or not "
                       "built (`rft-jax build-kernels`): use feature_major.attend")
  return attend_by(_TARGET, q, k_cache, v_cache, mask)


def register(library: str, name: str = _TARGET) -> None:
  """Loads the kernel's shared ``library`` and registers its handler with XLA's CPU backend as
  ``name`` (:func:`available` does so once; ``benchmarks/speed/cpu_attention.py --against``
  registers another build under another name). Raises OSError or AttributeError where the
  library does not load or lacks the handler."""
  handler = ctypes.cdll.LoadLibrary(library).RftDecodeAttention
  jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")


def attend_by(name: str, q: Float[Array, "B K G H"], k_cache: Float[Array, "B K H S"],
              v_cache: Float[Array, "B K S H"], mask: Bool[Array, "B S"]
              ) -> Float[Array, "B K G H"]:
  """:func:`attend` by the handler registered as ``name`` (:func:`register`), unchecked."""
  call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                          vmap_method="sequential")
  out = call(q.astype(jnp.float32), k_cache.astype(jnp.float32), v_cache.astype(jnp.float32), mask)
  return out.astype(q.dtype)
