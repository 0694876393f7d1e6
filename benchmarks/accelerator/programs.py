"""Every program XLA compiles (or loads from the persistent compilation cache) in the first
step(s) of a run, by function: its argument shapes, its compile seconds, whether it came from
the cache; then the count by function and the total. On any backend (CPU, a GPU, a TPU).

The run is the package's own (:func:`rft_jax.train.loop.train`, in this process): by default
the demo's (``configs/demo.yaml``, its data written under the run directory, the evaluation
before training included), else ``--config PATH`` (``--no-config``: the overrides alone) with
dotted overrides as ``rft-jax train`` takes them. Run it twice with one ``--cache-dir`` to see
what the second run loads from the cache instead of compiling::

    python benchmarks/accelerator/programs.py --cache-dir /tmp/programs_cache --min-compile-seconds 0
    python benchmarks/accelerator/programs.py --cache-dir /tmp/programs_cache --min-compile-seconds 0

How the compilations are observed (jax 0.10): the ``jax.monitoring`` duration event
``/jax/core/compile/backend_compile_duration`` (``fun_name``: ``jit(f)``) spans each backend
compilation and the persistent cache's lookup; inside it, in the same thread, come
``/jax/compilation_cache/cache_hits`` on a hit or ``cache_misses`` once a compiled program is
written. Shapes and cache keys come from JAX's own debug records of the lowering and the lookup,
read with a logging filter that passes on what those loggers printed anyway.

A program's short signature is its argument shapes that differ from its function's other
programs' (what tells two length buckets or batch buckets apart), else its integer and boolean
arrays (token ids, masks, lengths); programs of the same shapes that differ in static
arguments (the learner's ``stats_from_column``, a sampler spec) show their cache keys.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

import jax
from jax import monitoring

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
CACHE_WRITE = "/jax/compilation_cache/cache_misses"  # sent once the program is written
CACHE_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
SHAPES_LOGGER = "jax._src.interpreters.pxla"  # "Compiling %s with global shapes and types %s."
KEY_LOGGER = "jax._src.compiler"  # "... cache hit for '%s' with key %r" / "... CACHE MISS ..."


@dataclasses.dataclass
class Program:
  """One backend compilation (or load from the persistent cache).

  Attributes:
    function: the jitted function, as JAX names it (``jit(_sample_pool)``).
    shapes: its arguments' ``dtype[shape]``, flattened (constants captured by the trace first).
    seconds: the backend compilation's seconds (a cache hit: the lookup and load).
    cached: loaded from the persistent cache.
    kept: written to the persistent cache (False: no cache, or under its compile-time threshold).
    key: the persistent cache's key (None: no cache in use).
    saved: a hit's compile seconds saved, as JAX counts them (the stored compile time, whole
      seconds, less the load).
    trace_lower: seconds of tracing and lowering to MLIR before it (not saved by the cache).
  """

  function: str
  shapes: tuple[str, ...]
  seconds: float
  cached: bool
  kept: bool
  key: str | None
  saved: float = 0.0
  trace_lower: float = 0.0

  @property
  def key_id(self) -> str:
    return self.key.rsplit("-", 1)[-1][:8] if self.key else "-"


def aval_str(aval: Any) -> str:
  """``f32[8,64]`` for a ``ShapedArray``; anything else as JAX prints it."""
  return aval.str_short(short_dtypes=True) if hasattr(aval, "str_short") else str(aval)


class ProgramLog(contextlib.AbstractContextManager):
  """Records every :class:`Program` compiled or loaded while inside (in :attr:`programs`)."""

  def __init__(self):
    self.programs: list[Program] = []
    self._local = threading.local()
    self._lock = threading.Lock()
    self._saved_levels: dict[str, int] = {}
    self._filter = _RecordFilter(self)

  # -- the pending compilation of this thread, closed by the backend-compile event
  def _pending(self) -> dict:
    if not hasattr(self._local, "pending"):
      self._local.pending = {"shapes": {}, "trace": {}, "lower": {}}
    return self._local.pending

  def _on_event(self, event: str, **_) -> None:
    p = self._pending()
    if event == CACHE_HIT:
      p["hit"] = True
    elif event == CACHE_WRITE:
      p["kept"] = True

  def _on_duration(self, event: str, seconds: float, **kw) -> None:
    p = self._pending()
    name = kw.get("fun_name", "")
    if event == CACHE_SAVED:
      p["saved"] = max(seconds, 0.0)
    elif event == TRACE:
      p["trace"][name] = p["trace"].get(name, 0.0) + seconds
    elif event == LOWER:
      p["lower"][name] = p["lower"].get(name, 0.0) + seconds
    elif event == BACKEND_COMPILE:
      inner = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
      program = Program(function=name, shapes=p["shapes"].pop(name, ()), seconds=seconds,
                        cached=p.pop("hit", False), kept=p.pop("kept", False),
                        key=p.pop("key", None), saved=p.pop("saved", 0.0),
                        trace_lower=p["trace"].pop(inner, 0.0) + p["lower"].pop(name, 0.0))
      with self._lock:
        self.programs.append(program)

  def _on_record(self, record: logging.LogRecord) -> None:
    msg, args = record.msg, record.args
    if not isinstance(args, tuple) or len(args) < 2:
      return
    if isinstance(msg, str) and msg.startswith("Compiling %s with global shapes"):
      self._pending()["shapes"][str(args[0])] = tuple(aval_str(a) for a in args[1])
    elif isinstance(msg, str) and "with key %r" in msg:
      self._pending()["key"] = str(args[1])

  def __enter__(self) -> ProgramLog:
    monitoring.register_event_listener(self._on_event)
    monitoring.register_event_duration_secs_listener(self._on_duration)
    for name in (SHAPES_LOGGER, KEY_LOGGER):
      logger = logging.getLogger(name)
      self._filter.levels[name] = logger.getEffectiveLevel()
      self._saved_levels[name] = logger.level
      logger.setLevel(logging.DEBUG)  # JAX logs these records only where debug is on
      logger.addFilter(self._filter)
    return self

  def __exit__(self, *exc) -> None:
    for name, level in self._saved_levels.items():
      logger = logging.getLogger(name)
      logger.removeFilter(self._filter)
      logger.setLevel(level)
    monitoring.unregister_event_listener(self._on_event)
    monitoring.unregister_event_duration_listener(self._on_duration)


class _RecordFilter(logging.Filter):
  """Reads the shape and key records; lets through only what the logger printed before."""

  def __init__(self, log: ProgramLog):
    super().__init__()
    self.log, self.levels = log, {}

  def filter(self, record: logging.LogRecord) -> bool:
    try:
      self.log._on_record(record)
    except Exception:  # never break a compilation over a record
      pass
    return record.levelno >= self.levels.get(record.name, logging.WARNING)


# ---------------------------------------------------------------------------------------------
# Short signatures and the summary


def _runs(items: Sequence[str]) -> str:
  """``a a a b`` -> ``a x3 b``."""
  runs = ((item, len(list(group))) for item, group in itertools.groupby(items))
  return " ".join(item if n == 1 else f"{item}x{n}" for item, n in runs)


def signatures(programs: Sequence[Program]) -> list[str]:
  """Each program's short signature (see the module docstring), in order."""
  by_function: dict[str, list[int]] = collections.defaultdict(list)
  for i, p in enumerate(programs):
    by_function[p.function].append(i)
  out = [""] * len(programs)
  for indices in by_function.values():
    group = [programs[i] for i in indices]
    arity = {len(p.shapes) for p in group}
    if len(group) > 1 and len(arity) == 1:
      varying = [k for k in range(arity.pop()) if len({p.shapes[k] for p in group}) > 1]
    else:
      varying = None
    seen: collections.Counter = collections.Counter()
    for i, p in zip(indices, group):
      if varying:
        text = _runs([p.shapes[k] for k in varying])
      else:
        data = [s for s in p.shapes if re.match(r"(i32|i64|u32|u8|i8|bool)\[\d", s)]
        text = _runs(data) if data else _runs(p.shapes[:4]) + (" ..." if len(p.shapes) > 4 else "")
      seen[text] += 1
      out[i] = text or "()"
    for i, p in zip(indices, group):  # same shapes: static arguments differ
      if seen[out[i]] > 1:
        out[i] += f" #{p.key_id}"
  return out


def distinct(programs: Sequence[Program]) -> list[Program]:
  """One entry per distinct program (a cache key, else a function and its shapes): a program
  compiled again in the same run (a new jit object of the same code) counts once."""
  seen, out = set(), []
  for p in programs:
    ident = p.key or (p.function, p.shapes)
    if ident not in seen:
      seen.add(ident)
      out.append(p)
  return out


def by_function(programs: Sequence[Program]) -> dict[str, dict]:
  """``{function: {programs, seconds, cached, kept, signatures}}``, largest compile time first."""
  sigs = signatures(programs)
  table: dict[str, dict] = {}
  for p, sig in zip(programs, sigs):
    row = table.setdefault(p.function, {"programs": 0, "seconds": 0.0, "cached": 0, "kept": 0,
                                        "trace_lower": 0.0, "signatures": []})
    row["programs"] += 1
    row["seconds"] += p.seconds
    row["trace_lower"] += p.trace_lower
    row["cached"] += p.cached
    row["kept"] += p.kept
    row["signatures"].append(sig)
  return dict(sorted(table.items(), key=lambda kv: -kv[1]["seconds"]))


def report(programs: Sequence[Program], min_seconds: float = 0.0, out=sys.stdout) -> None:
  """Prints the programs that compiled in, or saved, at least ``min_seconds`` (the others in one
  line), then the count by function and the totals."""
  programs = distinct(programs)
  sigs = signatures(programs)
  shown = [(p, s) for p, s in zip(programs, sigs) if max(p.seconds, p.saved) >= min_seconds]
  width = max([len(p.function) for p, _ in shown] + [8])
  print(f"{'function':<{width}}  {'compile s':>9}  {'trace+lower s':>13}  {'source':<18}  "
        "signature", file=out)
  for p, sig in sorted(shown, key=lambda ps: (ps[0].function, ps[1])):
    source = ("cache (saved %.0f s)" % p.saved if p.cached else
              "compiled, kept" if p.kept else "compiled" + (", not kept" if p.key else ""))
    print(f"{p.function:<{width}}  {p.seconds:>9.2f}  {p.trace_lower:>13.2f}  {source:<18}  {sig}",
          file=out)
  if len(shown) < len(programs):
    rest = [p for p in programs if max(p.seconds, p.saved) < min_seconds]
    print(f"... and {len(rest)} programs under {min_seconds:g} s ({sum(p.seconds for p in rest):.2f} s; "
          f"{len({p.function for p in rest})} functions: eager operations and small helpers)", file=out)
  print("\nby function:", file=out)
  for name, row in by_function(programs).items():
    sig = ", ".join(row["signatures"]) if row["programs"] <= 6 else \
        ", ".join(row["signatures"][:6]) + ", ..."
    print(f"  {name}: {row['programs']} program{'s' * (row['programs'] != 1)} "
          f"({row['seconds']:.2f} s; {row['cached']} from the cache, {row['kept']} kept) [{sig}]",
          file=out)
  total = sum(p.seconds for p in programs)
  cached = [p for p in programs if p.cached]
  print(f"\ntotal: {len(programs)} distinct programs of {len({p.function for p in programs})} "
        f"functions, {total:.2f} s in backend compilation (cache lookups and loads included), "
        f"{sum(p.trace_lower for p in programs):.2f} s tracing and lowering; "
        f"{len(cached)} loaded from the persistent cache ({sum(p.saved for p in cached):.0f} s "
        f"saved), {sum(p.kept for p in programs)} compiled and kept", file=out)


# ---------------------------------------------------------------------------------------------
# The run


class _FirstStep(logging.Handler):
  """The loop's "first step done in %.0f s" seconds, unrounded."""

  def __init__(self):
    super().__init__()
    self.seconds: float | None = None
    self.loaded: tuple[int, float] | None = None  # programs loaded, seconds saved

  def emit(self, record: logging.LogRecord) -> None:
    if isinstance(record.msg, str) and record.msg.startswith("first step done in"):
      self.seconds = float(record.args[0])
      self.loaded = (int(record.args[1]), float(record.args[2]))


def run_config(args: argparse.Namespace, work: str):
  """The run's :class:`~rft_jax.train.config.TrainConfig`: the demo's, ``--config``'s, or the
  overrides alone, with ``steps``, the run directory and the cache directory set."""
  import dataclasses as dc

  from rft_jax.train.config import load_config

  run_dir = args.run_dir or os.path.join(work, "run")
  common = [f"steps={args.steps}", f"run_dir={run_dir}", "progress=false"]
  if args.cache_dir is not None:
    common.append(f"compilation_cache_dir={os.path.abspath(args.cache_dir)}")
  if args.no_config or args.config:
    return load_config(None if args.no_config else args.config, [*args.overrides, *common])
  from rft_jax.demo.paths import load_demo_config
  from rft_jax.demo.run import write_demo_data

  train_path, heldout_path = write_demo_data(os.path.join(work, "data"))
  cfg = load_demo_config(None, [f"data.train_path={train_path}", *args.overrides, *common])
  cfg.eval.sets = [dc.replace(s, path=heldout_path) for s in cfg.eval.sets]
  return cfg


def run(args: argparse.Namespace) -> dict:
  """Runs the first ``args.steps`` steps under a :class:`ProgramLog`; prints and returns the
  listing (``programs``: one dict per distinct program; ``functions``: :func:`by_function`)."""
  from rft_jax.train.compilation_cache import run_cache_dir
  from rft_jax.train.loop import train
  from rft_jax.train.status import configure_logging, logger

  configure_logging(0)  # the loop's info lines reach _FirstStep; --quiet: none printed
  if args.quiet:
    for handler in logger.handlers:
      handler.setLevel(logging.WARNING)
  if args.min_compile_seconds is not None:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", args.min_compile_seconds)
  work = tempfile.mkdtemp(prefix="rft_jax_programs_")
  first = _FirstStep()
  logger.addHandler(first)
  try:
    cfg = run_config(args, work)
    started = time.perf_counter()
    with ProgramLog() as log:
      metrics = train(cfg, resume=False, overwrite=True)
    wall = time.perf_counter() - started
  finally:
    logger.removeHandler(first)
    if not args.run_dir:
      shutil.rmtree(work, ignore_errors=True)
  programs = distinct(log.programs)
  print(f"\n{jax.default_backend()} ({jax.device_count()} devices), {cfg.model.path}: "
        f"{metrics.get('steps_done')} steps of {cfg.data.prompts_per_step} prompts x {cfg.sampling.n} "
        f"samples, max {cfg.sampling.max_new_tokens} new tokens; compilation cache "
        f"{run_cache_dir(cfg.run_dir, cfg.compilation_cache_dir) or 'none'}")
  report(programs, args.min_seconds)
  loaded = first.loaded or (0, 0.0)
  print(f"first step {first.seconds:.2f} s (the loop's figure: {loaded[0]} programs loaded from the "
        f"compilation cache, {loaded[1]:.0f} s saved); the whole run {wall:.2f} s"
        if first.seconds is not None else f"the whole run {wall:.2f} s (no step ran)")
  result = {"backend": jax.default_backend(), "devices": jax.device_count(),
            "first_step_s": first.seconds, "run_s": wall, "loop_cache_hits": loaded[0],
            "programs": [dict(dataclasses.asdict(p), signature=s)
                         for p, s in zip(programs, signatures(programs))],
            "functions": by_function(programs)}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", help="YAML config (default: the demo's, its data written here)")
  p.add_argument("--no-config", action="store_true", help="no YAML: the overrides alone, as "
                 "`rft-jax train` without --config")
  p.add_argument("--steps", type=int, default=1, help="steps to run (default 1)")
  p.add_argument("--cache-dir", help="the persistent compilation cache (default: the run's own: "
                 "JAX_COMPILATION_CACHE_DIR, else RUN_DIR/.jax_cache); run twice with one to see the "
                 "second run's hits")
  p.add_argument("--min-compile-seconds", type=float, help="keep only programs that compile in "
                 "at least this long (default: JAX's jax_persistent_cache_min_compile_time_secs, 1 s)")
  p.add_argument("--run-dir", help="the run directory (default: a temporary one, removed after)")
  p.add_argument("--min-seconds", type=float, default=0.05, help="list programs of at least this "
                 "many compile seconds one by one (the rest in one line; all are counted)")
  p.add_argument("--json", help="also write the listing to this JSON file")
  p.add_argument("--quiet", action="store_true", help="the run's warnings only")
  p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sampling.max_new_tokens=64")
  return p


def main(argv: list[str] | None = None) -> int:
  args, extra = parser().parse_known_args(argv)
  if extra and all("=" in e and not e.startswith("-") for e in extra):
    args.overrides = [*args.overrides, *extra]
  elif extra:
    parser().error(f"unrecognized arguments: {' '.join(extra)}")
  run(args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
