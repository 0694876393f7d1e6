"""The training runs that ``rft-jax figures`` needs, and running them (or reusing finished ones).

Every run starts from the demo's checkpoint on the demo's task (``configs/demo.yaml``) and
differs from plain GRPO only in its entropy mask and seed:

* Table 1 and Figures 3-5: GRPO, Clip_B and Clip_V (the released cuts) with seeds ``0..S-1``;
* Figure 1: the sign masks (``entropy_mask.kind=sign``) on positive or negative samples, with
  ``action=only`` (train on those tokens alone) and ``action=drop`` (GRPO without them), for
  :math:`S_* > 0` and :math:`S_* < 0` (eight runs, seed 0);
* Figure 2: Clip_B and Clip_V at further cuts :math:`\\mu^-` (seed 0).

A run lives in ``OUT/runs/NAME``. One that finished with the same config (the same
``config.yaml`` apart from where it logs) is reused as it is; any other is trained again from
the start. Every run is evaluated once, after its last step, on the held-out problems; the
first GRPO run also evaluates the start, which every run shares.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import time
from typing import Sequence

from rft_jax.demo.methods import METHODS as DEMO_METHODS
from rft_jax.train.metrics_log import read_metrics


@dataclasses.dataclass(frozen=True)
class FigureSettings:
  """How long and how many runs: ``--quick`` or the full set.

  Attributes:
    steps: training steps of every run.
    heldout: held-out problems evaluated (of the demo's 256).
    seeds: seeds of the GRPO / Clip_B / Clip_V runs (Table 1's confidence intervals).
    clip_b_mus / clip_v_mus: the cuts of Figure 2 (each method's released cut among them).
  """

  steps: int
  heldout: int
  seeds: int
  clip_b_mus: tuple[float, ...]
  clip_v_mus: tuple[float, ...]


QUICK = FigureSettings(steps=12, heldout=64, seeds=2, clip_b_mus=(1.0, 2.5), clip_v_mus=(4.0, 8.5))
FULL = FigureSettings(steps=60, heldout=256, seeds=3, clip_b_mus=(1.0, 1.5, 2.5, 4.0),
                      clip_v_mus=(4.0, 6.0, 8.5, 12.0))

# The released cuts (rft_jax.entropy.clipping) and the demo's Clip_V cap: the demo's overrides.
METHODS = {name: DEMO_METHODS[name] for name in ("grpo", "clip_b", "clip_v")}
DEFAULT_MU = {"clip_b": 2.5, "clip_v": 8.5}
SIGNS = {"pos": "positive", "neg": "negative"}


@dataclasses.dataclass(frozen=True)
class FigureRun:
  """One training run: its directory name under ``OUT/runs``, overrides and seed."""

  name: str
  overrides: tuple[str, ...]
  seed: int = 0


def method_run(method: str, seed: int) -> FigureRun:
  return FigureRun(f"{method}_s{seed}", METHODS[method], seed)


def mu_run(method: str, mu: float) -> FigureRun:
  """A Figure 2 run; the released cut is the seed-0 run of the method itself."""
  if mu == DEFAULT_MU[method]:
    return method_run(method, 0)
  return FigureRun(f"{method}_mu{mu:g}", (*METHODS[method], f"learner.entropy_mask.mu_low={mu}"))


def sign_run(action: str, samples: str, sign: str) -> FigureRun:
  """A Figure 1 run: ``action`` (only / drop) the ``sign`` (pos / neg) S_* tokens of the
  ``samples`` (pos / neg) samples."""
  return FigureRun(f"sign_{action}_{samples}_s{sign}",
                   ("learner.entropy_mask.kind=sign", f"learner.entropy_mask.action={action}",
                    f"learner.entropy_mask.samples={SIGNS[samples]}", f"learner.entropy_mask.sign={SIGNS[sign]}"))


SIGN_PANELS = [(action, samples) for action in ("only", "drop") for samples in ("pos", "neg")]


def planned_runs(settings: FigureSettings) -> list[FigureRun]:
  """Every run the figures need, each once, GRPO seed 0 first (it evaluates the start)."""
  runs = [method_run(m, s) for s in range(settings.seeds) for m in METHODS]
  runs += [mu_run("clip_b", mu) for mu in settings.clip_b_mus] + [mu_run("clip_v", mu) for mu in settings.clip_v_mus]
  runs += [sign_run(a, samples, sign) for a, samples in SIGN_PANELS for sign in SIGNS]
  return list(dict.fromkeys(runs))


def run_overrides(run: FigureRun, settings: FigureSettings, out_dir: str, train_path: str) -> list[str]:
  """The demo config's overrides that make ``run``."""
  first = run == method_run("grpo", 0)
  return [*run.overrides, f"seed={run.seed}", f"steps={settings.steps}", f"data.train_path={train_path}",
          f"run_dir={os.path.join(out_dir, 'runs', run.name)}", f"eval.every={settings.steps}",
          f"eval.at_start={str(first).lower()}", "learner.forecast_every=0", "progress=false"]


def run_config(run: FigureRun, settings: FigureSettings, out_dir: str, train_path: str, heldout_path: str,
               overrides: Sequence[str] = (), config_path: str | None = None):
  """The run's whole config: the demo's (``config_path``, default ``configs/demo.yaml``) with
  ``overrides`` and then :func:`run_overrides`, evaluated on ``heldout_path``, compiling into the
  cache all the runs share."""
  from rft_jax.demo.paths import load_demo_config

  cfg = load_demo_config(config_path, [*overrides, *run_overrides(run, settings, out_dir, train_path)])
  cfg.compilation_cache_dir = os.path.join(out_dir, "runs", ".jax_cache")
  cfg.eval.sets = [dataclasses.replace(s, path=heldout_path) for s in cfg.eval.sets]
  return cfg


def finished(cfg) -> bool:
  """Whether ``cfg.run_dir`` holds a finished run of ``cfg``: the same config (apart from what
  does not change the run) and metrics up to the last step, with its evaluation."""
  from omegaconf import OmegaConf

  from rft_jax.train.run_dir import config_changes

  path = os.path.join(cfg.run_dir, "config.yaml")
  if not os.path.exists(path):
    return False
  changes = [c for c in config_changes(OmegaConf.to_container(OmegaConf.load(path)), cfg)
             if c[0] not in ("progress", "compilation_cache_dir")]
  last = [r for r in read_metrics(cfg.run_dir) if r["step"] == cfg.steps]
  return not changes and any(any(k.startswith("eval/") for k in r) for r in last)


def _train(cfg) -> float:
  """Trains one run from the start (in a worker process); returns its wall time in seconds."""
  from rft_jax.train.loop import train

  start = time.time()
  train(cfg, resume=False, overwrite=True)
  return time.time() - start


def run_all(runs: Sequence[FigureRun], settings: FigureSettings, out_dir: str, train_path: str,
            heldout_path: str, overrides: Sequence[str] = (), config_path: str | None = None,
            workers: int = 2) -> dict[str, dict]:
  """Trains the runs that are not finished, ``workers`` at a time (each in its own process: one
  run keeps about one core busy), and returns, per run name, ``{"dir", "seconds", "reused",
  "overrides"}`` (``seconds``: its training time, also when an earlier call trained it, as
  ``OUT/runs/runs.json`` recorded it). ``overrides`` apply to every run, before the run's own.
  A run that fails, or a signal, ends the command with its error once the runs under way have
  ended (a signal makes them stop after their current step); no further run starts."""
  configs = {run: run_config(run, settings, out_dir, train_path, heldout_path, overrides, config_path)
             for run in runs}
  pending = [run for run in runs if not finished(configs[run])]
  print(f"{len(runs) - len(pending)} of {len(runs)} runs finished already in {out_dir}/runs; training "
        f"{len(pending)}, {workers} at a time", flush=True)
  seconds = {}
  context = multiprocessing.get_context("spawn")  # JAX does not survive a fork
  with concurrent.futures.ProcessPoolExecutor(max(workers, 1), mp_context=context) as pool:
    futures = {pool.submit(_train, configs[run]): run for run in pending}
    try:
      for future in concurrent.futures.as_completed(futures):
        run = futures[future]
        seconds[run.name] = future.result()
        print(f"[{len(seconds)}/{len(pending)}] {run.name} ({' '.join(run.overrides)}, seed {run.seed}): "
              f"{seconds[run.name]:.0f} s", flush=True)
    except BaseException:
      pool.shutdown(wait=True, cancel_futures=True)  # no new run starts; those under way end
      raise
  path = os.path.join(out_dir, "runs", "runs.json")
  before = {}  # a reused run keeps the training time it was recorded with
  if os.path.exists(path):
    with open(path) as f:
      before = json.load(f)
  done = {run.name: {"dir": configs[run].run_dir, "reused": run.name not in seconds,
                     "seconds": seconds.get(run.name, before.get(run.name, {}).get("seconds", float("nan"))),
                     "overrides": [*overrides, *run.overrides, f"seed={run.seed}"]}
          for run in runs}
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(done, f, indent=1)
  return done
