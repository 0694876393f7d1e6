"""The sandbox holds: each escape a model's code might try is its own test, checked from the host.

Needs bubblewrap (tests/run.sh installs it); without it these tests fail, on purpose: a sandbox that
is not there must not pass as one. Each run is given a short wall clock, so a test takes about a
second.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import rft_jax
from rft_jax.tools import SandboxLimits, ToolBox, python_tool, run_python, sandbox, sandbox_missing

pytestmark = pytest.mark.timeout(60)

REPO = Path(rft_jax.__file__).resolve().parent.parent
FAST = SandboxLimits(wall_s=1.0, cpu_s=5)


def pid_namespace_processes() -> dict[str, list[int]]:
  """Host pids by PID namespace (``pid:[inode]``), for the processes whose namespace is readable."""
  found = {}
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        found.setdefault(os.readlink(f"/proc/{entry}/ns/pid"), []).append(int(entry))
      except OSError:
        pass
  return found


def wait_gone(namespace: str, within_s: float = 0.5) -> list[int]:
  """The processes left in ``namespace`` (zombies included) after waiting up to ``within_s`` for them
  to go."""
  deadline = time.monotonic() + within_s
  while True:
    left = pid_namespace_processes().get(namespace, [])
    if not left or time.monotonic() > deadline:
      return left
    time.sleep(0.05)


def uid_processes(uid: int) -> list[int]:
  """The host's processes whose real uid is ``uid``."""
  found = []
  for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{entry}/status") as f:
        if int(next(line for line in f if line.startswith("Uid:")).split()[1]) == uid:
          found.append(int(entry))
    except (OSError, StopIteration):
      pass
  return found


PRINT_NAMESPACE = "import os\nprint(os.readlink('/proc/self/ns/pid'), flush=True)\n"


def test_sandbox_is_available():
  assert sandbox_missing() is None, f"no sandbox on this machine: install {sandbox_missing()}"
  result = run_python("import sys; print(6 * 7); sys.exit(3)")
  assert (result.stdout, result.status, result.exit_code) == ("42\n", "error", 3)


def test_no_read_outside(tmp_path):
  secret = "rft-secret-" + uuid.uuid4().hex
  host_file = tmp_path / "secret.txt"
  repo_file = REPO / f".sandbox_secret_{uuid.uuid4().hex}"
  host_file.write_text(secret)
  repo_file.write_text(secret)
  try:
    targets = [str(host_file), str(repo_file), str(REPO / "pyproject.toml"), "/etc/passwd",
               os.path.expanduser("~/.bashrc")]
    code = ("for path in %r:\n"
            "  try:\n    print(path, 'READ', open(path).read())\n"
            "  except OSError as e:\n    print(path, 'refused', type(e).__name__)\n") % (targets,)
    result = run_python(code, FAST)
  finally:
    repo_file.unlink()
  assert result.status == "ok", result.stderr
  assert "READ" not in result.stdout and secret not in result.stdout
  assert result.stdout.count("refused") == len(targets)


def test_no_write_outside(tmp_path):
  name = f"sandbox_wrote_{uuid.uuid4().hex}"
  targets = [f"/etc/{name}", str(REPO / name), str(tmp_path / name), f"/tmp/{name}", f"/usr/{name}",
             os.path.join(os.path.realpath(sys.base_prefix), name)]
  code = ("import os\nfor path in %r:\n"
          "  try:\n    os.makedirs(os.path.dirname(path), exist_ok=True)\n"
          "    open(path, 'w').write('x')\n    print(path, 'written inside')\n"
          "  except OSError as e:\n    print(path, 'refused', type(e).__name__)\n") % (targets,)
  result = run_python(code, FAST)
  assert result.status == "ok", result.stderr
  for path in targets:
    assert not os.path.exists(path), f"the sandbox wrote {path} on the host"
  assert f"/tmp/{name} written inside" in result.stdout  # its own /tmp: a fresh tmpfs, gone after


def test_no_network():
  listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  listener.bind(("127.0.0.1", 0))
  listener.listen(1)
  listener.settimeout(0.2)
  port = listener.getsockname()[1]
  code = ("import socket\n"
          "for address in [('127.0.0.1', %d), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
          "  try:\n    socket.create_connection(address, timeout=0.5)\n    print(address, 'CONNECTED')\n"
          "  except OSError as e:\n    print(address, 'failed', type(e).__name__)\n"
          "try:\n  print('RESOLVED', socket.getaddrinfo('example.com', 80))\n"
          "except OSError as e:\n  print('dns failed', type(e).__name__)\n"
          "print('interfaces', [name for _, name in socket.if_nameindex()])\n") % port
  try:
    result = run_python(code, FAST)
    with pytest.raises(socket.timeout):
      listener.accept()  # nothing reached the host's port
  finally:
    listener.close()
  assert result.status == "ok", result.stderr
  assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
  assert result.stdout.count("failed") == 4
  assert "interfaces ['lo']" in result.stdout


def test_fork_bomb_is_contained():
  limits = SandboxLimits(wall_s=1.0, cpu_s=5, processes=16)
  peak, stop = {}, threading.Event()

  def watch():  # the most processes any sandbox's PID namespace held at once
    while not stop.is_set():
      for namespace, pids in pid_namespace_processes().items():
        peak[namespace] = max(peak.get(namespace, 0), len(pids))
      time.sleep(0.02)

  watcher = threading.Thread(target=watch)
  watcher.start()
  start = time.monotonic()
  try:
    bomb = "print(os.getuid(), flush=True)\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
    result = run_python(PRINT_NAMESPACE + bomb, limits)  # every child forks on
  finally:
    stop.set()
    watcher.join()
  elapsed = time.monotonic() - start
  namespace, uid = result.stdout.splitlines()[:2]
  assert result.status == "timeout" and elapsed < limits.wall_s + 2
  assert 2 <= peak[namespace] <= limits.processes + 1  # its processes (RLIMIT_NPROC) and bubblewrap's init
  assert wait_gone(namespace) == []
  if int(uid) != os.getuid():  # run as root: the code ran as a uid of its own, which has no process left
    assert uid_processes(int(uid)) == []


def test_memory_hog_is_stopped():
  limits = SandboxLimits(wall_s=2.0, memory_mb=256)
  start = time.monotonic()
  hogs = [run_python("x = bytearray(8 * 2**30)", limits),
          run_python("chunks = []\nwhile True:\n  chunks.append(bytearray(2**24))", limits)]
  assert time.monotonic() - start < 2 * limits.wall_s
  for result in hogs:
    assert result.status == "memory" and "MemoryError" in result.stderr


def test_infinite_loop_times_out():
  start = time.monotonic()
  result = run_python(PRINT_NAMESPACE + "while True:\n  pass\n", FAST)
  elapsed = time.monotonic() - start
  assert result.status == "timeout" and FAST.wall_s <= elapsed < FAST.wall_s + 2
  assert wait_gone(result.stdout.splitlines()[0]) == []  # the whole sandbox is gone, not just its leader


def test_cpu_limit_times_out():
  """RLIMIT_CPU ends a busy loop (SIGXCPU) long before the wall clock would."""
  result = run_python("while True:\n  pass\n", SandboxLimits(wall_s=30.0, cpu_s=1))
  assert result.status == "timeout" and result.exit_code == -signal.SIGXCPU


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_cut(stream):
  limits = SandboxLimits(wall_s=5.0, output_bytes=4096)
  start = time.monotonic()
  result = run_python(f"import sys\nwhile True:\n  sys.{stream}.write('x' * 1000)\n", limits)
  assert result.status == "output_limit" and time.monotonic() - start < limits.wall_s
  text = getattr(result, stream)
  assert text.startswith("x" * 4096) and text.endswith("\n[output cut at 4096 bytes]")
  assert len(text) == 4096 + len("\n[output cut at 4096 bytes]")


def test_file_size_and_disk_are_limited():
  limits = SandboxLimits(file_bytes=2**20, disk_bytes=4 * 2**20)
  big = run_python("open('big', 'wb').write(b'x' * 2**21)", limits)
  assert big.status == "error" and "File too large" in big.stderr
  many = run_python("for i in range(8):\n  open(f'part{i}', 'wb').write(b'x' * 2**20)\n", limits)
  assert many.status == "error" and "No space left on device" in many.stderr


def test_trainer_environment_is_not_visible(monkeypatch):
  secret = "rft-secret-" + uuid.uuid4().hex
  monkeypatch.setenv("RFT_SECRET", secret)
  code = ("import os\nprint(dict(os.environ))\n"
          "for pid in os.listdir('/proc'):\n  if pid.isdigit():\n"
          "    try:\n      print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
          "    except OSError as e:\n      print(pid, 'refused', type(e).__name__)\n")
  result = run_python(code, FAST)
  assert result.status == "ok", result.stderr
  assert secret not in result.stdout and "RFT_SECRET" not in result.stdout
  assert "'HOME': '/sandbox'" in result.stdout


def test_proc_of_the_host_is_not_readable(monkeypatch):
  secret = "rft-secret-" + uuid.uuid4().hex
  monkeypatch.setenv("RFT_SECRET", secret)
  code = ("for path in ['/proc/1/environ', '/proc/%d/environ', '/proc/%d/environ']:\n"
          "  try:\n    print(path, 'READ', open(path, 'rb').read())\n"
          "  except OSError as e:\n    print(path, 'refused', type(e).__name__)\n"
          ) % (os.getpid(), os.getppid())
  result = run_python(code, FAST)
  assert result.status == "ok", result.stderr
  assert secret not in result.stdout and result.stdout.count("refused") == 3


def test_python_tool_runs_sandboxed():
  python = python_tool(FAST)
  assert python.__name__ == "python"
  assert (str(python("print(sum(i * i for i in range(10)))")), python("print(1)").status) == ("285", "ok")
  failed = python("1 / 0")
  assert failed.status == "error"
  assert "ZeroDivisionError" in failed.content and failed.content.endswith("[exit status 1]")
  stopped = python("while True: pass")
  assert stopped.status == "timeout" and "[stopped: over the time limit" in stopped.content
  box = ToolBox.from_names(["python"], python_limits=FAST)
  [result] = box.run('<tool_call>{"name": "python", "arguments": {"code": "print(2**10)"}}</tool_call>')
  assert (result.content, result.status) == ("1024", "ok")


def test_python_tool_refuses_without_a_sandbox(monkeypatch):
  monkeypatch.setattr(sandbox, "sandbox_missing", lambda: sandbox.INSTALL)
  for build in (python_tool, lambda: ToolBox.from_names(["python"])):
    with pytest.raises(ValueError) as info:
      build()
    message = str(info.value)
    assert "\n" not in message and "apt-get install bubblewrap" in message
    assert "rollout.tools_allow_unsandboxed" in message
  python = python_tool(FAST, allow_unsandboxed=True)
  assert str(python("print(6 * 7)")) == "42"
  start = time.monotonic()
  assert python("while True: pass").status == "timeout" and time.monotonic() - start < FAST.wall_s + 2
  assert python("while True: print('x' * 1000)").status == "output_limit"


def test_sandbox_missing_without_bwrap_on_path(monkeypatch, tmp_path):
  monkeypatch.setenv("PATH", str(tmp_path))
  sandbox_missing.cache_clear()
  try:
    assert sandbox_missing() == "bubblewrap (apt-get install bubblewrap)"
    with pytest.raises(RuntimeError, match="install bubblewrap"):
      run_python("print(1)")
  finally:
    monkeypatch.undo()
    sandbox_missing.cache_clear()
  assert sandbox_missing() is None
