"""The driver loop of ``benchmarks/peers/peers.py`` and ``benchmarks/peers/longtail.py``: each
contender's runner started once per model, every work's first call (compile) and a warm-up call
apart, then the contenders in turns, round by round, so that all see the same machine load."""

from __future__ import annotations

import datetime
import json
import os
import tempfile

from peers.runners.contenders import CONTENDERS, Runner
from peers.runners.report import print_details
from peers.runners.spec import write_spec


# glibc (2.35 on) then advises transparent huge pages for what malloc maps, where the kernel
# gives them only on advice (``/sys/kernel/mm/transparent_hugepage/enabled``: ``madvise``): every
# contender's weights and caches then sit in 2 MiB pages. Older glibc ignores it. Off by
# default, so that the recorded figures compare (docs/results/peers.md, benchmarks/LONGTAIL.md; ``launch/local.sh``
# sets it for rft_jax's demo).
HUGE_PAGES = "glibc.malloc.hugetlb=1"


def add_common_arguments(parser, rounds: int) -> None:
  """The drivers' shared options: models, rounds, the peers' virtualenvs, threads, --keep."""
  parser.add_argument("--models", nargs="+", choices=("small", "large"), default=["small", "large"])
  parser.add_argument("--rounds", type=int, default=rounds)
  parser.add_argument("--venvs", default=os.environ.get("PEER_VENVS", "/work/peer_venvs"),
                      help="where peers_setup.sh built the peers' virtualenvs")
  parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                      help="torch threads of the torch peers (default: the core count)")
  parser.add_argument("--keep", help="keep checkpoints, runner logs and results (JSON) here")
  parser.add_argument("--huge-pages", action="store_true",
                      help=f"start every runner with GLIBC_TUNABLES={HUGE_PAGES}")


def runner_env(env: dict, huge_pages: bool) -> dict:
  """The runners' environment, the same for every contender: ``env``, with
  ``GLIBC_TUNABLES`` = :data:`HUGE_PAGES` if ``huge_pages`` (a ``GLIBC_TUNABLES`` of ``env``
  is kept)."""
  if not huge_pages or "GLIBC_TUNABLES" in env:
    return dict(env)
  return dict(env, GLIBC_TUNABLES=HUGE_PAGES)


def measure_models(args, env: dict, note: str = "", **settings) -> dict:
  """:func:`measure` of every model of ``args.models``, each one's table printed as it ends,
  with the time, the core count and the load average before and after; ``{model: results}``.
  Every runner starts with :func:`runner_env`."""
  env = runner_env(env, args.huge_pages)
  print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} "
        f"cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.rounds} "
        f"rounds{note}; GLIBC_TUNABLES={env.get('GLIBC_TUNABLES', '')}", flush=True)
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    root = args.keep or tmp
    for model in args.models:
      results[model] = measure(model, root, args, env, **settings)
      print_details(model, results[model])
      with open(os.path.join(root, f"{model}-results.json"), "w") as f:  # kept with --keep
        json.dump([[*key, value] for key, value in results[model].items()], f)
  print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  return results


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
