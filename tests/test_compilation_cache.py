"""A run keeps its compiled programs in RUN_DIR/.jax_cache by default and a resumed run loads
them; several runs in one process each use their own cache."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from loop_fixtures import make_loop_files, overrides
from rft_jax.train.compilation_cache import CacheUse, persistent_compilation_cache, run_cache_dir
from rft_jax.train.errors import WriteError

LOADED = re.compile(r"(\d+) programs loaded from the compilation cache, (\d+) s of compiling saved")


def test_a_resumed_run_loads_the_programs_its_first_process_compiled(tmp_path):
  """Two ``rft-jax train`` processes on one run directory, nothing about caches configured: the
  first compiles and keeps its programs in RUN_DIR/.jax_cache, the resumed one loads them and
  runs them on the 4 x 2 mesh, the entropy-change measurement included. With XLA:CPU's
  concurrency-optimised scheduler on (its default), that loaded program deadlocks in its
  collectives and XLA aborts after 40 s (jax 0.10.2); the workaround of docs/training.md turns it off."""
  setup = make_loop_files(tmp_path)
  run_dir = tmp_path / "run"
  env = dict(os.environ, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # keep every program
  env.pop("JAX_COMPILATION_CACHE_DIR")  # the suite's (tests/conftest.py): nothing about caches
  env["XLA_FLAGS"] += " --xla_cpu_enable_concurrency_optimized_scheduler=false"

  def train(steps):
    cmd = ["train", *overrides(setup, run_dir, steps, "eval.every=0", "learner.forecast_every=1")]
    out = subprocess.run([sys.executable, "-m", "rft_jax.cli", *cmd], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = LOADED.search(out.stderr)
    assert loaded, out.stderr[-2000:]
    return int(loaded.group(1))

  assert train(1) == 0
  kept = os.listdir(run_dir / ".jax_cache")
  assert len(kept) >= 3  # at least the sampler, the learner step and the entropy change
  assert train(2) >= 3  # step 1 compiled nothing that step 0 had not kept


def test_a_run_uses_the_configured_cache_else_the_one_jax_is_told_of_else_its_own(tmp_path):
  assert run_cache_dir("/r", "") is None and run_cache_dir("/r", "/c") == "/c"
  with persistent_compilation_cache(None):  # JAX told of no cache: the run's own
    assert run_cache_dir("/r", None) == "/r/.jax_cache"
  with persistent_compilation_cache(str(tmp_path / "shared")):  # JAX_COMPILATION_CACHE_DIR, say
    assert run_cache_dir("/r", None) == str(tmp_path / "shared")
    assert run_cache_dir("/r", "") is None and run_cache_dir("/r", "/c") == "/c"


def test_runs_in_one_process_each_use_their_own_cache(tmp_path):
  before = jax.config.jax_compilation_cache_dir
  with persistent_compilation_cache(str(tmp_path / "a"), min_compile_seconds=0) as use:
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "a")
    with persistent_compilation_cache(None):
      assert jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "a")
    x = jnp.arange(7.0)
    jax.jit(lambda v: jnp.cumsum(v) * 17.25)(x).block_until_ready()  # compiled, kept
    assert use.hits == 0 and os.listdir(tmp_path / "a")
    jax.jit(lambda v: jnp.cumsum(v) * 17.25)(x).block_until_ready()  # a new function: loaded
    assert use.hits == 1 and CacheUse().hits == 0
  assert jax.config.jax_compilation_cache_dir == before


def test_a_cache_directory_that_cannot_be_made_is_named(tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(WriteError, match=f"compilation cache {tmp_path}/file/cache cannot be created"):
    with persistent_compilation_cache(str(tmp_path / "file" / "cache")):
      pass
