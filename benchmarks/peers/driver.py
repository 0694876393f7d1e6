"""The driver loop of ``benchmarks/peers.py`` and ``benchmarks/longtail.py``: each contender's
runner started once per model, every work's first call (compile) and a warm-up call apart, then
the contenders in turns, round by round, so that all see the same machine load."""

from __future__ import annotations

import os

from peers.contenders import CONTENDERS, Runner
from peers.spec import write_spec


def measure(model: str, root: str, args, env: dict, **settings) -> dict:
  """Runs ``args.work`` of rft_jax and ``args.peers`` on ``model`` (``settings``: more of the
  work spec, see ``peers.spec.write_spec``); returns
  ``{(contender, work): {"first": s, "runs": [(s, tokens)], "error": str}}``."""
  spec = write_spec(model, os.path.join(root, model), threads=args.threads, **settings)
  results = {}
  runners = {}
  for name in dict.fromkeys(["rft_jax", *args.peers]):
    works = [w for w in args.work if w in CONTENDERS[name].works]
    if not works:
      continue
    runner = Runner(name, spec, args.venvs, os.path.join(root, f"{model}-{name}.log"), env)
    print(f"[{model}] {name}: {runner.describe()}", flush=True)
    for w in works:
      results[name, w] = {"runs": [], "error": runner.error}
    runners[name] = runner
  for work in args.work:
    active = [n for n in runners if (n, work) in results and not results[n, work]["error"]]
    for name in active:  # first call: compile; second: warm-up (tunix recompiles once more)
      out = runners[name].run(work, seed=0)
      results[name, work].update(first=out.get("seconds"), error=out.get("error"))
      if not results[name, work]["error"]:
        results[name, work]["error"] = runners[name].run(work, seed=10**6).get("error")
    for r in range(args.rounds):
      for name in active:
        if results[name, work]["error"]:
          continue
        out = runners[name].run(work, seed=r + 1)
        if "error" in out:
          results[name, work]["error"] = out["error"]
        else:
          results[name, work]["runs"].append((out["seconds"], out["tokens"]))
      print(f"[{model}] {work} round {r + 1}/{args.rounds} done", flush=True)
  for runner in runners.values():
    runner.close()
  return results
