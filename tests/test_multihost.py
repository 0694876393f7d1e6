"""Two real processes (4 CPU devices each, joined by ``jax.distributed``) on one 2 x 4 mesh give
what one process with 8 devices gives: the same rollouts from ``generate`` (also on a paged KV
cache, one pool per data shard: here one per process) and the same learner
step (metrics and updated parameters), read back in full on every process; an orbax checkpoint
written by both processes restores to the same state.

All three processes run ``multihost_worker.py`` with the same XLA flags (optimisation level 0
halves the compile time, which is most of the test's time), the two-process group and the
one-process reference side by side.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent
WORKER_TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(tmp_path: Path, name: str, processes: int, devices: int) -> list:
  """Starts ``processes`` workers with ``devices`` CPU devices each; joined when more than one."""
  python_path = os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=python_path,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                       "--xla_backend_optimization_level=0")
  for key in ("RFT_JAX_COORDINATOR", "RFT_JAX_NUM_PROCESSES", "RFT_JAX_PROCESS_ID"):
    env.pop(key, None)
  coordinator = f"127.0.0.1:{_free_port()}"
  launched = []
  for i in range(processes):
    if processes > 1:
      env.update(RFT_JAX_COORDINATOR=coordinator, RFT_JAX_NUM_PROCESSES=str(processes),
                 RFT_JAX_PROCESS_ID=str(i))
    out, log = tmp_path / f"{name}{i}.npz", tmp_path / f"{name}{i}.log"
    with open(log, "w") as f:
      proc = subprocess.Popen([sys.executable, str(TESTS / "multihost_worker.py"), str(out),
                               str(tmp_path / f"{name}_checkpoints")],
                              env=dict(env), stdout=f, stderr=subprocess.STDOUT)
    launched.append((proc, out, log))
  return launched


def _results(launched: list) -> list[dict[str, np.ndarray]]:
  """Waits for every worker; a failure shows the end of its log."""
  results = []
  try:
    for proc, out, log in launched:
      try:
        rc = proc.wait(timeout=WORKER_TIMEOUT_S)
      except subprocess.TimeoutExpired:
        rc = f"nothing after {WORKER_TIMEOUT_S} s"
      assert rc == 0, f"worker {out.stem} exited with {rc}:\n{log.read_text()[-4000:]}"
      with np.load(out) as f:
        results.append(dict(f))
  finally:
    for proc, _, _ in launched:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return results


def test_global_and_host_arrays_on_one_process():
  from jax.sharding import NamedSharding, PartitionSpec as P

  from rft_jax.parallel import global_array, host_array, make_mesh

  mesh = make_mesh(data=4, model=2)
  rows = NamedSharding(mesh, P("data"))
  x = np.arange(24, dtype=np.int64).reshape(8, 3)
  g = global_array(x, rows)
  assert g.sharding == rows and g.dtype == np.int32 and global_array(g, rows) is g
  np.testing.assert_array_equal(host_array(g), x)
  moved = global_array(g, NamedSharding(mesh, P(None, None)))  # a jax.Array, resharded
  assert moved.is_fully_replicated
  np.testing.assert_array_equal(host_array(moved), x)
  assert host_array(3.5) == 3.5


def test_two_processes_equal_one_process(tmp_path):
  launched = _launch(tmp_path, "two", processes=2, devices=4)
  launched += _launch(tmp_path, "one", processes=1, devices=8)
  *results, reference = _results(launched)
  assert int(reference["process_count"]) == 1 and not reference["spans_processes"]
  assert reference["restored_equal"]
  assert np.isfinite(reference["metric/loss"]) and reference["metric/grad_norm"] > 0
  assert reference["metric/response_tokens"] > 0
  assert reference["paged/evictions"] > 0  # 16 pages of 4 tokens a shard: samples wait and re-enter
  np.testing.assert_array_equal(reference["paged/completion_ids"], reference["completion_ids"])
  for i, got in enumerate(results):
    assert int(got["process_count"]) == 2 and got["spans_processes"], i
    assert got["restored_equal"], f"process {i}: the orbax round trip changed the state"
    assert sorted(got) == sorted(reference), i
    np.testing.assert_array_equal(got["completion_ids"], reference["completion_ids"])
    np.testing.assert_array_equal(got["completion_lengths"], reference["completion_lengths"])
    np.testing.assert_allclose(got["logprobs"], reference["logprobs"], atol=1e-5)
    np.testing.assert_array_equal(got["paged/completion_ids"], reference["completion_ids"])
    np.testing.assert_allclose(got["paged/logprobs"], reference["logprobs"], atol=1e-5)
    assert got["paged/evictions"] == reference["paged/evictions"], i
    for key in reference:
      if key.startswith("metric/"):
        np.testing.assert_allclose(got[key], reference[key], rtol=1e-5, atol=1e-6,
                                   err_msg=f"process {i}: {key}")
      elif key.startswith("param/"):
        # Cross-process sums add in another order; Adam's g / sqrt(v) magnifies that noise on
        # near-zero gradients, so allow 1% of one step (lr = 3e-3) per parameter.
        np.testing.assert_allclose(got[key], reference[key], rtol=1e-5, atol=3e-5,
                                   err_msg=f"process {i}: {key}")
