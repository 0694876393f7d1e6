"""Test-wide settings. The fake device count is set here, once, before JAX loads."""

import os
import re
import shutil
import tempfile

# LLVM at -O0: the suite's programs are tiny and compiled once each, so XLA:CPU's compile time
# is most of the suite's time; at -O0 a file compiles about twice as fast (tests/
# test_entropy_target.py: 33 s instead of 72 s), and the tests check values, not speed. Runs and
# benchmarks keep XLA's optimisation levels (the sampler's -O2: sampling/loop.py).
_CPU_FLAGS = (
    " --xla_backend_optimization_level=0"
    # XLA:CPU's older elemental emitters instead of its fusion emitters: the same arithmetic,
    # compiled in about half the time (a learner step of tests/test_learner_token_batches.py:
    # 2.1-2.8 s against 3.9-5.1 s).
    " --xla_cpu_use_fusion_emitters=false"
    # A multi-device program loaded from the persistent cache deadlocks in its collectives under
    # XLA:CPU's concurrency-optimised scheduler (jax 0.10.2; tests/test_compilation_cache.py).
    " --xla_cpu_enable_concurrency_optimized_scheduler=false")
# The CPU tuning only where the tests run on CPU (the default): XLA ends the process on a flag
# its version does not know, and the single-device tests also run on a GPU's jax
# (benchmarks/accelerator/gpu.sh tests), where pytest's capture swallowed that one line.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    + (_CPU_FLAGS if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" else "")
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the suite compiles for TPU topologies, deviceless) takes a machine-wide lock file unless
# told that several processes (pytest-xdist workers) may load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The tests compare float32 math with references. On a GPU, XLA runs float32 matrix products in
# TF32 by default (logits ~4e-3 off transformers' on an H100: benchmarks/accelerator/gpu.sh
# tests); that is a speed setting, not what the tests check. (No effect on CPU.)
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# One persistent compilation cache for the whole run, shared by the xdist workers and the
# processes the tests start (JAX_* variables are inherited): many tests build the same small
# programs (the loop's sampler, learner and evaluation on one tiny config; a learner per case),
# and a program one test compiled loads in the next instead of compiling again. A run uses it
# as JAX's own cache directory unless told otherwise (rft_jax/train/compilation_cache.py); the
# tests of that choice set their caches themselves. Every program is kept (threshold 0).
# The controller makes the directory; its workers inherit the variable.
if "RFT_JAX_TESTS_TMP" not in os.environ:
  os.environ["RFT_JAX_TESTS_TMP"] = tempfile.mkdtemp(prefix="rft_jax_tests_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ["RFT_JAX_TESTS_TMP"], "jax_cache")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import hypothesis  # noqa: E402
import pytest  # noqa: E402

# JIT compilation makes the first example slow; shapes are drawn from small fixed sets.
hypothesis.settings.register_profile("rft_jax", deadline=None, max_examples=60, derandomize=True)
hypothesis.settings.load_profile("rft_jax")


@pytest.fixture(scope="session", autouse=True)
def cpu_attention_built():
  """The CPU decode attention kernel built as ``rft-jax build-kernels`` builds it (once per
  machine and kernel source; a no-op after), before any test: the sampler's tests on CPU run it,
  as runs do where it is built. Its path, or the build's error (the ``cpu_kernel`` fixture's tests
  fail with it; the others run XLA's attention)."""
  from rft_jax.models.decode import cpu_attention

  try:
    return cpu_attention.build()
  except RuntimeError as e:
    return e


@pytest.fixture
def cpu_kernel(cpu_attention_built):
  """The CPU decode attention kernel, built and registered (else the build's error)."""
  from rft_jax.models.decode import cpu_attention

  if isinstance(cpu_attention_built, Exception):
    raise cpu_attention_built
  assert cpu_attention.available()


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


def pytest_sessionfinish(session):
  if not hasattr(session.config, "workerinput"):  # the controller, once the workers are done
    shutil.rmtree(os.environ["RFT_JAX_TESTS_TMP"], ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Runs on an accelerator (benchmarks/accelerator/gpu.sh tests: JAX_PLATFORMS=cuda, one device).

ON_CPU = os.environ["JAX_PLATFORMS"] == "cpu"
# What a test that needs the CPU suite's 8 fake devices raises where fewer are available:
# make_mesh's and rft-jax plan's one-line errors.
_TOO_FEW_DEVICES = re.compile(r"make_mesh: data=\d+ x model=\d+ = (\d+) devices, but (\d+) are "
                              r"available|topology 'cpu:(\d+)': only (\d+) CPU devices")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """Off CPU, a test whose mesh needs more devices than the accelerator run has is reported
  skipped, with the reason (``-rs`` prints it), not failed: the CPU suite runs it on its fake
  mesh. Only those two errors are turned into skips; every other failure stays one."""
  outcome = yield
  report = outcome.get_result()
  if ON_CPU or call.excinfo is None or report.outcome != "failed":
    return
  match = _TOO_FEW_DEVICES.search(str(call.excinfo.value))
  if match:
    need, have = [g for g in match.groups() if g is not None]
    report.outcome = "skipped"
    report.longrepr = (str(item.path), item.location[1] or 0,
                       f"needs {need} devices, this {os.environ['JAX_PLATFORMS']} run has "
                       f"{have} (the CPU suite runs it on 8 fake devices)")


class OutcomeLog:
  """One line per test, written and flushed as each test ends (``RFT_JAX_TEST_OUTCOMES``: the
  file), so a run cut short (a device call's time limit) still names every test it finished:
  ``PASSED|FAILED|SKIPPED|ERROR nodeid seconds [first line of the reason]``."""

  def __init__(self, path: str):
    self.file = open(path, "a", buffering=1)

  def pytest_runtest_logreport(self, report):
    failed_outside_call = report.when != "call" and report.outcome == "failed"
    if report.when != "call" and not failed_outside_call and report.outcome != "skipped":
      return
    word = {"passed": "PASSED", "skipped": "SKIPPED"}.get(report.outcome, "FAILED")
    if failed_outside_call:
      word = "ERROR"
    reason = ""
    if report.outcome != "passed":
      text = (report.longrepr[2] if isinstance(report.longrepr, tuple)
              else getattr(report.longrepr, "reprcrash", None) and report.longrepr.reprcrash.message
              or str(report.longrepr))
      reason = " " + (str(text).strip().splitlines() or [""])[0][:300]
    self.file.write(f"{word} {report.nodeid} {report.duration:.2f}s{reason}\n")


def pytest_configure(config):
  path = os.environ.get("RFT_JAX_TEST_OUTCOMES")
  if path and not hasattr(config, "workerinput"):  # the controller, which sees every report
    config.pluginmanager.register(OutcomeLog(path), "rft_jax_outcome_log")
