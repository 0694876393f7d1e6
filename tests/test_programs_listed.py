"""``benchmarks/accelerator/programs.py`` lists the programs of a run's first step: the sampler's
and the learner step's compiled (with their compile seconds) on a first run, and loaded from the
persistent compilation cache on a second run with the same cache directory."""

import json
import os
import subprocess
import sys

from loop_fixtures import make_loop_files, overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "accelerator", "programs.py")
SAMPLER = ("jit(_sample_pool)", "jit(_sample_loop)")
LEARNER = "jit(_train_step_fn)"


def _listing(setup, tmp_path, name: str) -> dict:
  """One fresh process of the command on the tiny run (one step, one device, no evaluation), with
  the cache in ``tmp_path/cache``: its JSON listing."""
  out = tmp_path / f"{name}.json"
  run = overrides(setup, tmp_path / name, 1, "mesh.data=1", "mesh.model=1", "eval.every=0",
                  "eval.at_start=false", "learner.forecast_every=0", "checkpoint_every=0")
  cmd = [sys.executable, SCRIPT, "--no-config", "--cache-dir", str(tmp_path / "cache"),
         "--min-compile-seconds", "0", "--json", str(out), "--quiet", *run]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "by function:" in done.stdout and "total:" in done.stdout, done.stdout[-3000:]
  return json.loads(out.read_text())


def test_a_second_run_loads_every_program_the_first_compiled(tmp_path):
  setup = make_loop_files(tmp_path)
  first = _listing(setup, tmp_path, "first")
  programs = first["programs"]
  sampler = [p for p in programs if p["function"] in SAMPLER]
  learner = [p for p in programs if p["function"] == LEARNER]
  assert sampler and learner, sorted({p["function"] for p in programs})
  for p in sampler + learner:  # compiled here, with their shapes, and kept
    assert p["seconds"] > 0 and not p["cached"] and p["kept"] and p["key"], p
    assert any(s.startswith("i32[") for s in p["shapes"]), p
  assert first["functions"][LEARNER]["programs"] == len(learner)
  kept = {p["key"] for p in programs if p["kept"]}

  second = _listing(setup, tmp_path, "second")
  hits = {p["key"] for p in second["programs"] if p["cached"]}
  assert len(hits) >= len(kept) and kept <= hits, sorted(kept - hits)
  again = [p for p in second["programs"] if p["function"] in SAMPLER + (LEARNER,)]
  assert len(again) == len(sampler + learner) and all(p["cached"] for p in again), again
  assert {p["key"] for p in again} == {p["key"] for p in sampler + learner}
  assert second["loop_cache_hits"] >= len(again)  # the loop's own count agrees
