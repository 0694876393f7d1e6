"""The suite's accelerator run (``benchmarks/accelerator/gpu.sh tests``): every finished test is
on disk at once, and a test that needs the CPU suite's 8 fake devices is skipped with its reason,
while every other failure stays a failure."""

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))

CASES = '''
import pytest

def test_needs_a_mesh():
  raise ValueError("make_mesh: data=4 x model=2 = 8 devices, but 1 are available")

def test_needs_a_cpu_topology():
  raise RuntimeError("topology 'cpu:8': only 1 CPU devices; start with XLA_FLAGS=...")

def test_fails_otherwise():
  raise ValueError("make_mesh: data=0 x model=1 = 0 devices, but 1 were given")

def test_passes():
  pass

@pytest.mark.skip(reason="a reason of its own")
def test_skipped():
  pass
'''


def _run(tmp_path, platform: str) -> list[str]:
  (tmp_path / "test_cases.py").write_text(CASES)
  outcomes = tmp_path / f"outcomes_{platform}.txt"
  env = dict(os.environ, JAX_PLATFORMS=platform, RFT_JAX_TEST_OUTCOMES=str(outcomes),
             PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
  subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider",
                  "-p", "no:xdist", "test_cases.py"], cwd=tmp_path, env=env, timeout=300,
                 capture_output=True, text=True)
  return outcomes.read_text().splitlines()


def test_an_accelerator_run_logs_each_test_and_skips_only_mesh_tests_with_the_reason(tmp_path):
  lines = {line.split()[1].split("::")[1]: line for line in _run(tmp_path, "cuda")}
  assert sorted(lines) == ["test_fails_otherwise", "test_needs_a_cpu_topology", "test_needs_a_mesh",
                           "test_passes", "test_skipped"]
  assert lines["test_needs_a_mesh"].startswith("SKIPPED")
  assert "needs 8 devices, this cuda run has 1" in lines["test_needs_a_mesh"]
  assert lines["test_needs_a_cpu_topology"].startswith("SKIPPED")
  assert lines["test_fails_otherwise"].startswith("FAILED")
  assert "data=0 x model=1" in lines["test_fails_otherwise"]
  assert lines["test_passes"].startswith("PASSED")
  assert lines["test_skipped"].startswith("SKIPPED") and "a reason of its own" in lines["test_skipped"]


def test_on_cpu_a_test_short_of_devices_fails(tmp_path):
  lines = {line.split()[1].split("::")[1]: line.split()[0] for line in _run(tmp_path, "cpu")}
  assert lines["test_needs_a_mesh"] == "FAILED" and lines["test_needs_a_cpu_topology"] == "FAILED"


def test_the_accelerator_run_names_test_files_that_exist():
  import re
  with open(os.path.join(TESTS, "..", "benchmarks", "accelerator", "gpu.sh")) as f:
    listed = re.search(r"^gpu_test_files=\((.*?)\)", f.read(), re.M | re.S).group(1).split()
  assert len(listed) > 20
  missing = [name for name in listed if not os.path.isfile(os.path.join(TESTS, "..", name))]
  assert not missing
