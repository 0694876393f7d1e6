"""Test-wide settings. The fake device count is set here, once, before JAX loads."""

import os

# LLVM at -O0: the suite's programs are tiny and compiled once each, so XLA:CPU's compile time
# is most of the suite's time; at -O0 a file compiles about twice as fast (tests/
# test_entropy_target.py: 33 s instead of 72 s), and the tests check values, not speed. Runs and
# benchmarks keep XLA's optimisation levels (the sampler's -O2: sampling/loop.py).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the suite compiles for TPU topologies, deviceless) takes a machine-wide lock file unless
# told that several processes (pytest-xdist workers) may load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The tests compare float32 math with references. On a GPU, XLA runs float32 matrix products in
# TF32 by default (logits ~4e-3 off transformers' on an H100: benchmarks/gpu.sh tests); that is a
# speed setting, not what the tests check. (No effect on CPU.)
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# A run uses JAX's own cache directory where one is set (rft_jax/train/compilation_cache.py); the
# tests choose their caches themselves, whatever the developer's shell says.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import hypothesis  # noqa: E402

# JIT compilation makes the first example slow; shapes are drawn from small fixed sets.
hypothesis.settings.register_profile("rft_jax", deadline=None, max_examples=60, derandomize=True)
hypothesis.settings.load_profile("rft_jax")


# The files that take a minute or more, slowest first (`bash tests/run.sh --durations=60`). With
# `--dist loadfile` each worker takes the next whole file, in collection order: started first,
# the long files do not leave one worker running alone at the end while the other idles.
SLOW_FILES = ("test_learner.py", "test_learner_token_batches.py", "test_train_loop.py",
              "test_faults.py", "test_demo.py", "test_sampling.py", "test_plan.py",
              "test_ppo_run.py", "test_attention.py", "test_compilation_cache.py",
              "test_multihost.py", "test_sampling_continuous.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOW_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: file order kept
