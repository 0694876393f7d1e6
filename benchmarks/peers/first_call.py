"""The rollout sampler's first call in fresh processes: rft_jax against google-tunix (issue 17.3).

A process's first rollout compiles its programs, so one process gives one first-call figure;
``benchmarks/peers/peers.py`` reports that one figure per contender. Here each round starts fresh
runners (``benchmarks/peers/runners/*_runner.py``, the peers' work on the same checkpoint: 32
prompts, 128 new tokens, float32) one after the other and times their first and second rollout:

* ``rft_jax cold``: an empty persistent compilation cache (what a new ``rft-jax train`` run
  pays: it compiles, and writes the programs to ``RUN_DIR/.jax_cache``);
* ``rft_jax warm``: a second process on the cache the cold one left (what a resumed run, or a
  rerun of the same shapes, pays);
* ``tunix``: google-tunix's ``Sampler`` (it keeps no compiled programs across processes).

Medians and spread over the rounds; the second call is the steady time, for scale.

    bash benchmarks/peers/peers_setup.sh           # once: tunix's virtualenv in /work/peer_venvs
    python benchmarks/peers/first_call.py [--model small] [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
CHILD_ENV = dict(os.environ)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process's JAX only builds the spec

from peers.runners.contenders import Runner  # noqa: E402
from peers.runners.spec import write_spec  # noqa: E402

# label -> (runner, uses the round's compilation cache)
CASES = {"rft_jax cold": ("rft_jax", True), "rft_jax warm": ("rft_jax", True),
         "tunix": ("tunix", False)}


def first_two(name: str, spec: str, venvs: str, log: str, env: dict) -> tuple[float, float]:
  """Seconds of a fresh runner's first and second rollout."""
  runner = Runner(name, spec, venvs, log, env)
  try:
    times = [runner.run("rollout", seed=seed) for seed in (0, 1)]
  finally:
    runner.close()
  for out in times:
    if "error" in out:
      raise SystemExit(f"{name}: {out['error']} (log: {log})")
  return times[0]["seconds"], times[1]["seconds"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=("small", "large"), default="small")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--venvs", default=os.environ.get("PEER_VENVS", "/work/peer_venvs"))
  args = parser.parse_args()
  print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} "
        f"cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.model} "
        f"model, {args.rounds} rounds", flush=True)
  results = {case: [] for case in CASES}
  with tempfile.TemporaryDirectory() as root:
    spec = write_spec(args.model, root, threads=os.cpu_count() or 1)
    for r in range(args.rounds):
      cache = os.path.join(root, f"cache{r}")  # empty for the round's cold run
      for case, (name, cached) in CASES.items():
        env = dict(CHILD_ENV, JAX_COMPILATION_CACHE_DIR=cache) if cached else CHILD_ENV
        log = os.path.join(root, f"{case.replace(' ', '-')}-{r}.log")
        results[case].append(first_two(name, spec, args.venvs, log, env))
      print(f"round {r + 1}/{args.rounds}: " + ", ".join(
          f"{case} {results[case][-1][0]:.2f} s" for case in CASES), flush=True)
  print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  print("| contender | first call s, median (min-max) | second call s, median |")
  print("|---|---|---|")
  for case, runs in results.items():
    first = [f for f, _ in runs]
    print(f"| {case} | {statistics.median(first):.2f} ({min(first):.2f}-{max(first):.2f}) | "
          f"{statistics.median(s for _, s in runs):.2f} |")
  tunix = [f for f, _ in results["tunix"]]
  for case in ("rft_jax cold", "rft_jax warm"):
    ratios = [t / f for t, (f, _) in zip(tunix, results[case])]
    print(f"tunix / {case}: {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
  main()
