"""Test-wide settings. The fake device count is set here, once, before JAX loads."""

import os
import shutil
import tempfile

# The concurrency-optimised scheduler of XLA:CPU can start one program's collectives in different
# orders on the fake devices of a 4 x 2 mesh: the rendezvous never completes and XLA aborts after
# 40 s ("Termination timeout for all gather ... only 3 of them arrived"). It happened every time
# a second process ran the learner's cached entropy-change program (jax 0.10.2, two cores;
# tests/test_compilation_cache.py), and never with this scheduler off.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the suite compiles for TPU topologies, deviceless) takes a machine-wide lock file unless
# told that several processes (pytest-xdist workers) may load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The tests compare float32 math with references. On a GPU, XLA runs float32 matrix products in
# TF32 by default (logits ~4e-3 off transformers' on an H100: benchmarks/gpu.sh tests); that is a
# speed setting, not what the tests check. (No effect on CPU.)
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# One persistent compilation cache for the session, made by the process that starts it and
# inherited by the xdist workers and the subprocesses they start (`rft-jax train` uses JAX's
# setting where set): most tests compile the same tiny-model sampler and learner step, and XLA's
# compiling is most of the suite's time. A size limit turns on JAX's file lock (two workers
# write to it). Tests of the cache itself set their own directories.
_OWN_CACHE = "RFT_JAX_TESTS_JAX_CACHE" not in os.environ
if _OWN_CACHE:
  os.environ["RFT_JAX_TESTS_JAX_CACHE"] = tempfile.mkdtemp(prefix="rft_jax_tests_jax_cache_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["RFT_JAX_TESTS_JAX_CACHE"]
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)

import hypothesis  # noqa: E402

# JIT compilation makes the first example slow; shapes are drawn from small fixed sets.
hypothesis.settings.register_profile("rft_jax", deadline=None, max_examples=60, derandomize=True)
hypothesis.settings.load_profile("rft_jax")


def pytest_unconfigure(config):
  if _OWN_CACHE:
    shutil.rmtree(os.environ["RFT_JAX_TESTS_JAX_CACHE"], ignore_errors=True)
