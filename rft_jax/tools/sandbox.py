"""Run a model's Python code in a bubblewrap sandbox under hard limits, and the ``python`` tool on it.

A policy that learns to call Python will, sooner or later, write code that reads files, opens sockets,
forks, allocates, loops or prints without end -- by accident or because the reward pays for it.
``python -c`` with a timeout (skyrl-gym's tool) stops only the loop. Here each run gets:

- **namespaces** (bubblewrap): a network namespace with only its own loopback, its own PID, IPC and UTS
  namespaces, and a root of read-only binds of ``/usr`` (``/lib*``, ``/bin``, ``/sbin``) and of the
  Python install the trainer's interpreter comes from (``sys.base_prefix``, its ``site-packages``
  hidden: the standard library only). The repository, the virtual environment, ``/work``, ``/root``,
  ``/home`` and the host's ``/tmp`` are not there. ``/tmp`` and the working directory ``/sandbox`` are
  fresh tmpfs mounts of ``disk_bytes``; ``/proc`` shows the sandbox's processes; the environment is
  ``PATH``, ``HOME=/sandbox`` and ``LANG``, and bubblewrap itself starts with no more, so the trainer's
  variables are nowhere inside. ``--die-with-parent``, ``--new-session``.
- **an unprivileged user**. The kernel never applies ``RLIMIT_NPROC`` to root, and a user namespace
  made by root maps its user back to root. So where the trainer is root (containers) the sandbox makes
  no user namespace: the code drops to a fresh uid/gid (random in ``[40000, 65000)``, so concurrent
  runs rarely share a process count) without capabilities, under ``no_new_privs``. Run by another
  user, bubblewrap makes a user namespace, in which the process limit counts.
- **limits** (:class:`SandboxLimits`), set by a bootstrap inside before the code starts: address space
  (``RLIMIT_AS``), CPU seconds (``RLIMIT_CPU``), processes and threads (``RLIMIT_NPROC``), the size of a
  file (``RLIMIT_FSIZE``), no core dumps. The wall clock is the parent's: past ``wall_s`` it kills the
  sandbox's init, and the PID namespace with it. Standard output and error are read concurrently, each
  capped at ``output_bytes``: a flood is killed, its output kept, truncated, with a marker.

The code is the interpreter's standard input (``python3 -I -``, isolated mode). Without bubblewrap
(:func:`sandbox_missing`), ``run_python(..., sandboxed=False)`` applies the same limits and clock
without namespaces: the code sees the host's files and network (not the trainer's environment
variables), and as root its process count is not limited. :func:`python_tool` takes that mode only
when told ``rollout.tools_allow_unsandboxed``.

Nothing here imports the rest of the project but :mod:`rft_jax.tools.calls`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
from typing import Callable, Optional

from rft_jax.tools.calls import ToolResult

INSTALL = "bubblewrap (apt-get install bubblewrap)"
ALLOW_UNSANDBOXED_KEY = "rollout.tools_allow_unsandboxed"
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
_UIDS = (40000, 65000)  # the unprivileged uids a sandbox run as root drops to
_PATH = "/usr/local/bin:/usr/bin:/bin"
# Runs inside the sandbox as `python -I -c _BOOTSTRAP cpu_s memory_bytes processes file_bytes uid`:
# sets the limits, drops to `uid` (when >= 0), then becomes the interpreter reading the code on stdin.
_BOOTSTRAP = (
    "import os, resource, sys\n"
    "cpu, memory, processes, file_bytes, uid = map(int, sys.argv[1:6])\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))\n"
    "resource.setrlimit(resource.RLIMIT_AS, (memory, memory))\n"
    "resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))\n"
    "if uid >= 0:\n"
    "  os.setgroups([])\n"
    "  os.setresgid(uid, uid, uid)\n"
    "  os.setresuid(uid, uid, uid)\n"
    "os.execv(sys.executable, [sys.executable, '-I', '-'])\n"
)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Limits of one run.

  Attributes:
    wall_s: wall-clock seconds before the run is killed (status ``timeout``).
    cpu_s: CPU seconds of each process (``RLIMIT_CPU``; ``SIGXCPU``, status ``timeout``).
    memory_mb: address space of each process in MiB (``RLIMIT_AS``; status ``memory``).
    processes: processes and threads the run's user may have at once (``RLIMIT_NPROC``).
    output_bytes: bytes kept of standard output and of standard error each; more is killed
      (status ``output_limit``).
    file_bytes: largest file the code may write (``RLIMIT_FSIZE``).
    disk_bytes: size of each of the sandbox's tmpfs mounts, ``/sandbox`` and ``/tmp``.
  """

  wall_s: float = 5.0
  cpu_s: int = 5
  memory_mb: int = 512
  processes: int = 32
  output_bytes: int = 16384
  file_bytes: int = 2**20
  disk_bytes: int = 16 * 2**20

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not getattr(self, field.name) > 0:
        raise ValueError(f"SandboxLimits.{field.name} must be positive, got {getattr(self, field.name)!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What a run printed and how it ended.

  Attributes:
    stdout / stderr: decoded output (invalid UTF-8 replaced), each cut at ``output_bytes`` with a marker.
    status: one of :data:`STATUSES`: ``ok`` (exit 0), ``error`` (another exit status), ``timeout`` (wall
      clock or CPU time), ``memory`` (a ``MemoryError``), ``output_limit``, ``killed`` (another signal).
    exit_code: the exit status; minus the signal's number when a signal ended it.
  """

  stdout: str
  stderr: str
  status: str
  exit_code: Optional[int]


def _interpreter() -> str:
  """The base install's interpreter (not the virtual environment's link to it)."""
  return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _inside(path: str, directory: str) -> bool:
  return os.path.commonpath([path, directory]) == directory


def _filesystem_args() -> list[str]:
  """bubblewrap's arguments for the read-only system and Python directories."""
  args = ["--ro-bind", "/usr", "/usr"]
  for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
    if os.path.islink(top):
      args += ["--symlink", os.readlink(top), top]
    elif os.path.isdir(top):
      args += ["--ro-bind", top, top]
  prefix = os.path.realpath(sys.base_prefix)
  binds = [] if _inside(prefix, "/usr") else [prefix]
  interpreter_dir = os.path.dirname(_interpreter())
  if not any(_inside(interpreter_dir, d) for d in ["/usr", *binds]):
    binds.append(interpreter_dir)
  made = set()
  for directory in binds:  # parents 0755 (bubblewrap's own are 0700: closed to the sandbox's user)
    parts = directory.strip("/").split("/")
    for parent in ("/" + "/".join(parts[:i]) for i in range(1, len(parts))):
      if parent not in made:
        args += ["--perms", "0755", "--dir", parent]
        made.add(parent)
    args += ["--ro-bind", directory, directory]
  paths = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})
  for packages in sorted({paths["purelib"], paths["platlib"]}):  # the base install's packages, hidden
    if os.path.isdir(packages):
      args += ["--perms", "0755", "--tmpfs", packages, "--remount-ro", packages]
  return args


def _bwrap_command(bwrap: str, limits: SandboxLimits, uid: int) -> list[str]:
  as_root = uid >= 0
  return [
      bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
      *([] if as_root else ["--unshare-user"]),
      "--die-with-parent", "--new-session",
      *_filesystem_args(),
      "--proc", "/proc", "--dev", "/dev",
      "--size", str(limits.disk_bytes), "--perms", "1777", "--tmpfs", "/tmp",
      "--size", str(limits.disk_bytes), "--perms", "1777", "--tmpfs", "/sandbox",
      "--remount-ro", "/", "--chdir", "/sandbox",
      "--clearenv", "--setenv", "PATH", _PATH, "--setenv", "HOME", "/sandbox", "--setenv", "LANG", "C.UTF-8",
      # glibc reserves 64 MiB of address space per thread's malloc arena: under RLIMIT_AS, 2 arenas
      # let a run start dozens of threads instead of about ten.
      "--setenv", "MALLOC_ARENA_MAX", "2",
      "--", _interpreter(), *_bootstrap_args(limits, uid)]


def _bootstrap_args(limits: SandboxLimits, uid: int) -> list[str]:
  return ["-I", "-c", _BOOTSTRAP, str(limits.cpu_s), str(limits.memory_mb * 2**20), str(limits.processes),
          str(limits.file_bytes), str(uid)]


class _Capture:
  """Reads one pipe in a thread, keeping at most ``cap`` bytes; calls ``on_overflow`` past it."""

  def __init__(self, stream, cap: int, on_overflow: Callable[[], None]):
    self.data = bytearray()
    self.overflowed = False
    self._cap = cap
    self._on_overflow = on_overflow
    self.thread = threading.Thread(target=self._read, args=(stream.fileno(),), daemon=True)
    self.thread.start()

  def _read(self, fd: int) -> None:
    while True:
      try:
        chunk = os.read(fd, 65536)
      except OSError:
        return
      if not chunk:
        return
      room = self._cap - len(self.data)
      self.data += chunk[:room]
      if len(chunk) > room:
        self.overflowed = True
        self._on_overflow()
        return

  def text(self) -> str:
    text = self.data.decode("utf-8", errors="replace")
    return text + f"\n[output cut at {self._cap} bytes]" if self.overflowed else text


def _children(pid: int) -> list[int]:
  """The processes whose parent is ``pid`` (empty where the kernel does not list them)."""
  try:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      return [int(child) for child in f.read().split()]
  except OSError:
    return []


def _stop(proc: subprocess.Popen, in_bwrap: bool) -> None:
  """Kills the run (callable from any thread). In bubblewrap, the sandbox's init (bubblewrap's child)
  is killed, which ends its PID namespace; bubblewrap then reaps it and exits. Killing bubblewrap
  first would leave that init a zombie for the host's PID 1 to reap, which in a container may never
  happen."""
  for target in (_children(proc.pid) if in_bwrap else []) or [-proc.pid]:  # -pid: its process group
    try:
      os.kill(target, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass


def _run(command: list[str], code: str, cwd: str, limits: SandboxLimits, env: dict,
         in_bwrap: bool) -> SandboxResult:
  """Runs ``command`` with ``code`` on its standard input, under the wall clock and output caps
  (``in_bwrap``: the command is bubblewrap, which reports a signal as 128 + its number)."""
  with tempfile.TemporaryFile() as stdin:
    stdin.write(code.encode("utf-8", errors="replace"))
    stdin.seek(0)
    proc = subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cwd, env=env, start_new_session=True, close_fds=True)
  stop = functools.partial(_stop, proc, in_bwrap)
  out = _Capture(proc.stdout, limits.output_bytes, stop)
  err = _Capture(proc.stderr, limits.output_bytes, stop)
  timed_out = False
  try:
    returncode = proc.wait(timeout=limits.wall_s)
  except subprocess.TimeoutExpired:
    timed_out = True
    stop()
    try:
      returncode = proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:  # bubblewrap did not follow its sandbox: end its group
      _stop(proc, in_bwrap=False)
      returncode = proc.wait()
  for capture in (out, err):  # the pipes close when the last process holding them is gone
    capture.thread.join(timeout=2.0)
  proc.stdout.close()
  proc.stderr.close()
  if in_bwrap and returncode > 128:
    returncode = -(returncode - 128)
  stdout, stderr = out.text(), err.text()
  if out.overflowed or err.overflowed:
    status = "output_limit"
  elif timed_out or returncode == -signal.SIGXCPU:
    status = "timeout"
  elif returncode == 0:
    status = "ok"
  elif "MemoryError" in stderr[-2000:]:
    status = "memory"
  elif returncode < 0:
    status = "killed"
  else:
    status = "error"
  return SandboxResult(stdout=stdout, stderr=stderr, status=status, exit_code=returncode)


def _sandboxed(code: str, limits: SandboxLimits, bwrap: str) -> SandboxResult:
  uid = random.randrange(*_UIDS) if os.geteuid() == 0 else -1
  env = {"PATH": _PATH, "LANG": "C.UTF-8"}
  return _run(_bwrap_command(bwrap, limits, uid), code, "/", limits, env, in_bwrap=True)


@functools.lru_cache(maxsize=None)
def sandbox_missing() -> Optional[str]:
  """None when runs can be sandboxed here, else one line saying what to install.

  Probed once per process (``sandbox_missing.cache_clear()`` probes again): ``bwrap`` on ``PATH``, and a
  sandboxed run of ``print(1)`` that must print 1 (bubblewrap may be installed where namespaces cannot
  be made: a container without the privilege, unprivileged user namespaces turned off).
  """
  bwrap = shutil.which("bwrap")
  if bwrap is None:
    return INSTALL
  try:
    probe = _sandboxed("print(1)", SandboxLimits(wall_s=30.0), bwrap)
  except OSError as e:
    return f"{INSTALL} that runs here ({bwrap}: {e})"
  if probe.status != "ok" or probe.stdout.strip() != "1":
    reason = (probe.stderr.strip().splitlines() or [f"status {probe.status}"])[-1]
    return f"{INSTALL} able to make namespaces here ({bwrap} failed: {reason})"
  return None


def run_python(code: str, limits: Optional[SandboxLimits] = None, *, sandboxed: bool = True) -> SandboxResult:
  """Runs ``code`` in a fresh interpreter (``python3 -I``, the code on standard input) under ``limits``.

  Args:
    code: Python source.
    limits: the run's limits (:class:`SandboxLimits` by default).
    sandboxed: in bubblewrap's namespaces (the default), or only under the limits and the clock, in a
      throwaway working directory of the host (for hosts without a sandbox, explicitly).

  Returns:
    The output and how the run ended (:class:`SandboxResult`).

  Raises:
    RuntimeError: ``sandboxed`` where :func:`sandbox_missing` says what is missing.
  """
  limits = limits or SandboxLimits()
  if sandboxed:
    missing = sandbox_missing()
    if missing is not None:
      raise RuntimeError(f"no sandbox for Python code: install {missing}")
    return _sandboxed(code, limits, shutil.which("bwrap"))
  workdir = tempfile.mkdtemp(prefix="rft_jax_python_")
  try:
    command = [_interpreter(), *_bootstrap_args(limits, -1)]
    env = {"PATH": _PATH, "HOME": workdir, "LANG": "C.UTF-8", "MALLOC_ARENA_MAX": "2"}
    return _run(command, code, workdir, limits, env, in_bwrap=False)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def _tail(text: str, chars: int = 2000) -> str:
  return text if len(text) <= chars else "..." + text[-chars:]


def result_text(result: SandboxResult, limits: SandboxLimits) -> str:
  """What the model reads: standard output, the end of standard error when the run failed, and a
  line saying which limit stopped it."""
  parts = [result.stdout]
  if result.status != "ok" and result.stderr.strip():
    parts.append(_tail(result.stderr))
  ends = {"timeout": f"[stopped: over the time limit ({limits.wall_s:g} s wall, {limits.cpu_s} s CPU)]",
          "memory": f"[stopped: out of memory (limit {limits.memory_mb} MiB)]",
          "output_limit": f"[stopped: printed more than {limits.output_bytes} bytes]",
          "killed": f"[stopped: killed by signal {-(result.exit_code or 0)}]",
          "error": f"[exit status {result.exit_code}]"}
  if result.status in ends:
    parts.append(ends[result.status])
  text = "\n".join(part.rstrip("\n") for part in parts if part)
  return text or "(no output: print the values you need)"


def python_tool(limits: Optional[SandboxLimits] = None,
                allow_unsandboxed: bool = False) -> Callable[[str], ToolResult]:
  """The ``python`` tool: runs the model's code with :func:`run_python` and returns what it printed.

  Args:
    limits: each run's limits (:class:`SandboxLimits` by default).
    allow_unsandboxed: where :func:`sandbox_missing` finds no sandbox, run under the limits alone
      instead of refusing (the config key ``rollout.tools_allow_unsandboxed``).

  Returns:
    ``python(code: str)``, whose schema comes from its docstring (:func:`~rft_jax.tools.schema.tool_schema`).
    It returns a :class:`~rft_jax.tools.calls.ToolResult` (``str()`` of it is the text): the status is
    the run's, ``ok``, ``timeout`` or ``output_limit``, or ``error`` for any other failure.

  Raises:
    ValueError: no sandbox here and ``allow_unsandboxed`` is False (one line: what to install, or the key).
  """
  limits = limits or SandboxLimits()
  missing = sandbox_missing()
  if missing is not None and not allow_unsandboxed:
    raise ValueError(f"the python tool runs model code in a sandbox: install {missing}, or set "
                     f"{ALLOW_UNSANDBOXED_KEY}=true to run it under resource limits alone")
  sandboxed = missing is None

  def python(code: str):
    """Runs Python code and returns its standard output (and the end of its standard error if it fails).

    Each call starts a fresh Python interpreter with the standard library only: nothing is kept
    between calls, and time, memory and output are limited. Print the values you need.

    Args:
      code: The Python program to run, e.g. "print(sum(i * i for i in range(10)))".

    Returns:
      What the program printed, then the error and a line saying why if it failed or hit a limit.
    """
    result = run_python(code, limits, sandboxed=sandboxed)
    status = result.status if result.status in ("ok", "timeout", "output_limit") else "error"
    return ToolResult(result_text(result, limits), status)

  return python
