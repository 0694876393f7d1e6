"""The second time a user runs it (issue 60, point 5): each trap they met, checked fixed.

One short finished run (2 steps, with a checkpoint, the completions and an evaluation after
each, so that every file holds step numbers) serves the checks: the step numbers agree, a
rerun of a finished run says so and changes nothing, a run written when steps counted from 0 is
renumbered when resumed, and outputs whose place a file takes (or a non-empty export directory)
are refused in one line before anything is written. The demo's rerun: tests/test_demo.py; the
launch scripts' arguments: tests/test_setup_disk.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import pytest

from loop_fixtures import make_loop_files, overrides
from rft_jax import cli
from rft_jax.train.metrics_log import read_jsonl, read_metrics


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  return make_loop_files(tmp_path_factory.mktemp("second_run"))


def args(setup, run_dir, steps, *extra):
  """A short run: a checkpoint, the completions and an evaluation of the held-out split after
  each of its steps."""
  return ["train", *overrides(setup, run_dir, steps, "learner.forecast_every=0", "eval.every=1",
                              "checkpoint_every=1", "log_rollouts_every=1", *extra)]


def run_cli(argv) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(argv)
  return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def finished(setup, tmp_path_factory):
  """``(run_dir, stderr)`` of a finished 2-step run."""
  run_dir = tmp_path_factory.mktemp("runs") / "run"
  code, _, err = run_cli(args(setup, run_dir, 2))
  assert code == 0, err
  return run_dir, err


def copy_of(run_dir, to):
  shutil.copytree(run_dir, to)
  return to


def one_line_error(err: str, command: str) -> str:
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"rft-jax {command}: error: "), err
  return lines[0]


# --- e. one step numbering: from 1, "after step N" = N steps done ------------------------------


def test_every_file_and_line_numbers_the_steps_alike(finished):
  run_dir, err = finished
  assert [r["step"] for r in read_metrics(str(run_dir))] == [1, 2]
  assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [1, 2]
  for step in (1, 2):
    assert f"evaluation after step {step}: eval/val/avg@2" in err
    assert f"checkpoint of step {step} saved" in err
    record = read_metrics(str(run_dir))[step - 1]
    assert record["step"] == step and "eval/val/avg@2" in record
  assert [r["step"] for r in read_jsonl(str(run_dir / "rollouts.jsonl"))] == [1] * 8 + [2] * 8
  assert [r["step"] for r in read_jsonl(str(run_dir / "eval_completions.jsonl"))] == [1] * 4 + [2] * 4


def test_a_run_counted_from_zero_reads_back_and_is_renumbered_when_resumed(finished, setup, tmp_path):
  """Runs written before the convention: step -1 the start, 0 the first update."""
  run_dir = copy_of(finished[0], tmp_path / "old")
  for name in ("metrics.jsonl", "rollouts.jsonl", "eval_completions.jsonl"):
    records = read_jsonl(str(run_dir / name))
    (run_dir / name).write_text("".join(json.dumps({**r, "step": r["step"] - 1}) + "\n" for r in records))
  assert [r["step"] for r in read_metrics(str(run_dir))] == [1, 2]  # read under today's numbering
  code, _, err = run_cli(args(setup, run_dir, 3))
  assert code == 0, err
  assert f"renumbered the steps of {run_dir}'s metrics" in err and "resumed from step 2" in err
  assert [r["step"] for r in read_jsonl(str(run_dir / "metrics.jsonl"))] == [1, 2, 3]
  assert [r["step"] for r in read_jsonl(str(run_dir / "rollouts.jsonl"))] == [1] * 8 + [2] * 8 + [3] * 8
  assert [r["step"] for r in read_jsonl(str(run_dir / "eval_completions.jsonl"))] == [1] * 4 + [2] * 4 + [3] * 4


# --- d. a finished run rerun: what is true, in one line, and nothing rewritten -----------------


@pytest.mark.parametrize("steps", [1, 2])
def test_a_finished_run_rerun_says_it_has_its_steps_and_changes_nothing(finished, setup, tmp_path, monkeypatch,
                                                                      steps):
  from rft_jax.train import loop

  run_dir = copy_of(finished[0], tmp_path / "run")
  before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.iterdir()
            if p.is_file() and p.name not in ("trainer.lock", "debug.log")}  # (the lock is taken, the log kept)
  monkeypatch.setattr(loop, "train_step", lambda *a, **k: pytest.fail("trained a step"))
  code, out, err = run_cli(args(setup, run_dir, steps))
  assert code == 0, err
  assert out.strip() == (f"{run_dir} already holds 2 steps (steps={steps}): nothing to do; set steps above 2 "
                         f"to train on, or pass --overwrite to start over")
  assert "ran out" not in out + err
  assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in before} == before  # config.yaml too
  assert not list(run_dir.glob("config.*.yaml"))
  # a config that changes what the run computes is still refused, as on any resume
  code, _, err = run_cli(args(setup, run_dir, steps, "seed=3"))
  assert code == 1 and "seed: 0 -> 3" in err and "--allow-config-change" in err


# --- c. outputs taken by a file, a non-empty export directory, a missing step -----------------


def test_a_run_dir_taken_by_a_file_is_refused_before_anything_runs(setup, tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("mine\n")
  for run_dir, named in ((blocker, f"{blocker} is a file"), (blocker / "run", f"{blocker} (a directory above it)")):
    for dry in (["--dry-run"], []):
      code, out, err = run_cli([*args(setup, run_dir, 1)[:1], *dry, *args(setup, run_dir, 1)[1:]])
      assert code == 2, err
      assert f"run_dir {run_dir}: {named}" in one_line_error(err, "train") and "config OK" not in out
  code, _, err = run_cli(["demo", f"run_dir={blocker}"])  # the demo's runs, before its data is written
  assert code == 2 and f"run_dir {blocker}: {blocker} is a file" in one_line_error(err, "demo")
  assert blocker.read_text() == "mine\n"


def test_plot_out_under_a_file_is_refused_in_one_line(finished, tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("mine\n")
  code, _, err = run_cli(["plot", str(finished[0]), "--out", str(blocker / "x.png")])
  assert code == 2 and f"--out {blocker / 'x.png'}: {blocker} (a directory above it) is a file" in one_line_error(
      err, "plot")
  code, _, err = run_cli(["plot", str(finished[0]), "--out", str(tmp_path)])
  assert code == 2 and "a directory, not a file" in one_line_error(err, "plot")


def test_export_refuses_a_file_a_non_empty_directory_and_a_missing_step(finished, tmp_path):
  run_dir = str(finished[0])
  blocker = tmp_path / "file"
  blocker.write_text("mine\n")
  full = tmp_path / "full"
  full.mkdir()
  (full / "notes.txt").write_text("mine\n")
  cases = [([str(blocker)], f"OUT {blocker}: {blocker} is a file, not a directory"),
           ([str(full)], f"OUT {full}: not empty (holds notes.txt); pass --overwrite"),
           ([str(tmp_path / "hf"), "--step", "7"], f"--step 7: {run_dir} has checkpoints of steps [1, 2]")]
  for extra, message in cases:
    code, _, err = run_cli(["export", run_dir, *extra])
    assert code == 2 and message in one_line_error(err, "export"), err
  assert blocker.read_text() == "mine\n" and os.listdir(full) == ["notes.txt"] and not (tmp_path / "hf").exists()
  code, out, err = run_cli(["export", run_dir, str(full), "--overwrite", "--step", "1"])
  assert code == 0, err
  assert out.strip() == f"exported step 1 of {run_dir} to {full} (float32)"
  assert "model.safetensors" in os.listdir(full) and "notes.txt" not in os.listdir(full)
  assert not os.path.exists(f"{full}.exporting")


def test_eval_attribute_and_filter_outputs_under_a_file_are_refused_before_loading(finished, setup, tmp_path,
                                                                                   monkeypatch):
  """``eval --histogram / --save-completions``, ``attribute --out`` and ``filter --out`` whose place a
  file takes: one line, exit 2, before the model loads (it would fail the test if it did)."""
  from rft_jax.train import policy

  monkeypatch.setattr(policy, "load_policy", lambda *a, **k: pytest.fail("loaded the model before the check"))
  blocker = tmp_path / "file"
  blocker.write_text("mine\n")
  data = str(setup[2])
  for command, option, extra in (("eval", "--histogram", []), ("eval", "--save-completions", []),
                                 ("attribute", "--out", []), ("filter", "--out", ["--low", "0.1", "--high", "0.9"])):
    target = blocker / "x" if command != "filter" else blocker
    code, _, err = run_cli([command, "--model", str(finished[0]), "--data", data, option, str(target), *extra])
    line = one_line_error(err, command)
    assert code == 2 and line.startswith(f"rft-jax {command}: error: {option} {target}: ") and "is a file" in line, line
