"""A run meets its faults and ends or recovers cleanly: a full disk, --no-resume on an earlier
run, non-finite steps, a second trainer, signals, data that runs out, a failing evaluation, a
changed config on resume, torn and corrupt files."""

import errno
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from loop_fixtures import compilation_cache, make_loop_files, overrides
from rft_jax import cli
from rft_jax.train.metrics_log import read_jsonl, read_metrics
from rft_jax.train.run_dir import RunDirLock


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """The loop's files, and one compilation cache for the module's runs (in-process and the
  subprocess trainers'): the runs share a config, so only the first one compiles."""
  files = make_loop_files(tmp_path_factory.mktemp("faults"))
  with compilation_cache(cache_dir(files)):
    yield files


def cache_dir(setup):
  return setup[0] / "jax_cache"


def args(setup, run_dir, steps, *extra):
  """A short run without evaluation on a 2-device mesh (quick to compile)."""
  return ["train", *overrides(setup, run_dir, steps, "eval.every=0", "mesh.data=2", "mesh.model=1",
                              "learner.forecast_every=0", f"compilation_cache_dir={cache_dir(setup)}",
                              *extra)]


def steps_of(run_dir):
  return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def trainer(cmd, **kwargs):
  """``rft-jax`` in a subprocess (with this suite's environment: 8 fake CPU devices)."""
  return subprocess.Popen([sys.executable, "-m", "rft_jax.cli", *cmd], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, **kwargs)


def wait_for_records(run_dir, count, proc, timeout=300):
  path = run_dir / "metrics.jsonl"
  deadline = time.time() + timeout
  while time.time() < deadline:
    if path.exists() and len(path.read_text().splitlines()) >= count:
      return
    assert proc.poll() is None, proc.communicate()[1]
    time.sleep(0.2)
  raise AssertionError(f"no {count} records in {path} after {timeout} s")


# --- 1. a full disk ends the run at once, naming the file and the cause --------------------------


def test_a_write_that_fails_ends_the_run_with_the_file_and_the_cause(setup, tmp_path, monkeypatch, capsys):
  from tensorboardX.event_file_writer import EventsWriter

  real = EventsWriter.write_event
  calls = []

  def full_after_first_step(self, event):
    calls.append(event.step)
    if event.step >= 2:  # the second step's
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(self, event)

  monkeypatch.setattr(EventsWriter, "write_event", full_after_first_step)
  started = time.time()
  assert cli.main(args(setup, tmp_path / "tb", 4)) == 1
  err = capsys.readouterr().err
  assert f"cannot write {tmp_path / 'tb' / 'tensorboard'}: No space left on device" in err, err
  assert time.time() - started < 120 and [r["step"] for r in read_metrics(str(tmp_path / "tb"))] == [1, 2]

  # a checkpoint saved in the background that fails is reported after the step in progress, in one
  # line naming the step, the directory and the OS error; it is never reported as saved
  monkeypatch.undo()
  import orbax.checkpoint as ocp

  saves = []  # "started", then "done" once orbax's save call has returned (the rest is in the background)
  real_save, real_wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished

  def save(self, *a, **k):
    saves.append("started")
    result = real_save(self, *a, **k)
    saves.append("done")
    return result

  def failed_in_the_background(self):
    real_wait(self)
    if saves[-1:] == ["done"]:
      raise ValueError("RESOURCE_EXHAUSTED: Error writing \"params\": Failed to write 1410122 bytes to file 4: "
                       "No space left on device [os_error_code='28']")

  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", failed_in_the_background)
  assert cli.main(args(setup, tmp_path / "ckpt", 6, "checkpoint_every=2")) == 1
  err = capsys.readouterr().err
  assert err.splitlines()[-1] == (f"rft-jax train: error: cannot save step 2 to {tmp_path / 'ckpt' / 'checkpoints'}: "
                                  "No space left on device (errno 28)"), err
  assert "checkpoint of step 2 saved" not in err and "Traceback" not in err and "while stopping" not in err
  assert [r["step"] for r in read_metrics(str(tmp_path / "ckpt"))] == [1, 2]  # step 3 ran, then it stopped
  assert "RESOURCE_EXHAUSTED" in (tmp_path / "ckpt" / "debug.log").read_text()  # the details: in the debug log


# The drivers' shared part: write ``path`` until its file system is full, to the last byte.
FILL_DISK = textwrap.dedent("""
    def fill_disk(path):
      with open(path, "wb", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1):
          try:
            while True:
              f.write(b"x" * size)
          except OSError:
            pass
""")

FULL_DISK_DRIVER = FILL_DISK + textwrap.dedent("""
    import json, os, subprocess, sys, time
    mount, cmd = sys.argv[1], sys.argv[2:]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", mount], check=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(mount, "run", "metrics.jsonl")
    while not (os.path.exists(metrics) and open(metrics).read().count("\\n") >= 1):
      if proc.poll() is not None:
        break
      time.sleep(0.2)
    fill_disk(os.path.join(mount, "filler"))
    filled = time.time()
    try:
      err = proc.communicate(timeout=180)[1]
    except subprocess.TimeoutExpired:
      proc.kill()
      err = "HUNG"
    print(json.dumps({"rc": proc.returncode, "stderr": err, "seconds": time.time() - filled}))
""")


def _can_mount_tmpfs():
  probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                         capture_output=True)
  return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="no unprivileged mount namespace for a small tmpfs "
                    "(the failing-writer test above covers the same paths)")
def test_a_real_full_disk_ends_the_run_promptly(setup, tmp_path):
  mount = tmp_path / "disk"
  mount.mkdir()
  cmd = [sys.executable, "-m", "rft_jax.cli", *args(setup, mount / "run", 40, "checkpoint_every=1")]
  out = subprocess.run(["unshare", "-rm", sys.executable, "-c", FULL_DISK_DRIVER, str(mount), *cmd],
                       capture_output=True, text=True, timeout=600)
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["stderr"] != "HUNG", "the run hung on a full disk"
  assert result["rc"] == 1 and result["seconds"] < 120, result
  assert "No space left on device" in result["stderr"] and str(mount / "run") in result["stderr"], result


CHECKPOINT_DISK_DRIVER = FILL_DISK + textwrap.dedent("""
    import json, os, shutil, signal, subprocess, sys, time
    mount, copy, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", mount], check=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    committed = os.path.join(mount, "run", "checkpoints", "3")
    while not os.path.isdir(committed) and proc.poll() is None:
      time.sleep(0.02)
    proc.send_signal(signal.SIGSTOP)  # fill the disk while the trainer is between checkpoints
    fill_disk(os.path.join(mount, "filler"))
    os.truncate(os.path.join(mount, "filler"), os.path.getsize(os.path.join(mount, "filler")) - (64 << 10))
    proc.send_signal(signal.SIGCONT)  # 64 KiB free: room for metrics, not for a checkpoint
    try:
      err = proc.communicate(timeout=180)[1]
    except subprocess.TimeoutExpired:
      proc.kill()
      err = "HUNG"
    shutil.copytree(os.path.join(mount, "run"), copy, symlinks=True)
    print(json.dumps({"rc": proc.returncode, "stderr": err}))
""")


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="no unprivileged mount namespace for a small tmpfs "
                    "(the failing-writer test above covers the same paths)")
def test_a_checkpoint_that_fails_on_a_full_disk_stops_the_run_and_it_resumes_exactly(setup, tmp_path, capsys):
  """The disk fills between checkpoints 3 and 6 (keep_checkpoints=1): the save of step 6 fails in
  the background, the run stops after step 6 in one line, never having said step 6 was saved,
  with orbax's traceback in the debug log; the run resumes from step 3 with the same metrics."""
  mount, copy = tmp_path / "disk", tmp_path / "copy"
  mount.mkdir()
  extra = ("checkpoint_every=3", "keep_checkpoints=1")
  cmd = [sys.executable, "-m", "rft_jax.cli", *args(setup, mount / "run", 8, *extra)]
  out = subprocess.run(["unshare", "-rm", sys.executable, "-c", CHECKPOINT_DISK_DRIVER, str(mount), str(copy), *cmd],
                       capture_output=True, text=True, timeout=600)
  result = json.loads(out.stdout.strip().splitlines()[-1])
  err = result["stderr"]
  assert result["rc"] == 1, err
  assert err.splitlines()[-1] == (f"rft-jax train: error: cannot save step 6 to {mount / 'run' / 'checkpoints'}: "
                                  "No space left on device (errno 28)"), err
  assert "checkpoint of step 3 saved" in err and "checkpoint of step 6" not in err and "Traceback" not in err
  assert "absl" not in err and len(err.splitlines()) < 12, err  # orbax's log: in the debug log only
  debug = (copy / "debug.log").read_text()
  assert "saving step 6" in debug and "Traceback" in debug and "No space left on device" in debug
  assert steps_of(copy) == [3] and not [p for p in (copy / "checkpoints").iterdir() if p.name.startswith("6")]
  failed = read_metrics(str(copy))
  assert [r["step"] for r in failed] == [1, 2, 3, 4, 5, 6]
  assert cli.main(args(setup, copy, 8, *extra)) == 0  # the disk has room again (a copy of the run)
  assert f"resumed from step 3 of {copy}" in capsys.readouterr().err
  resumed = read_metrics(str(copy))
  assert [r["step"] for r in resumed] == list(range(1, 9))
  for before, after in zip(failed[3:], resumed[3:6]):
    for key in before:
      if key != "time" and not key.startswith("timing/"):
        assert before[key] == pytest.approx(after[key], rel=1e-6, abs=1e-9), (before["step"], key)


# --- 2. --no-resume never mixes two runs --------------------------------------------------------


def tensorboard_scalars(run):
  """``(step, tag)`` of every scalar in a run's TensorBoard event files."""
  from tensorboardX.proto.event_pb2 import Event

  scalars = []
  for f in (run / "tensorboard").iterdir():
    data = f.read_bytes()
    while data:  # TFRecord: length (8), its crc (4), the event, its crc (4)
      n = int.from_bytes(data[:8], "little")
      event = Event.FromString(data[12:12 + n])
      scalars += [(event.step, v.tag) for v in event.summary.value]
      data = data[16 + n:]
  return scalars


class FakeWandbRun:
  """What ``wandb.init`` returns, recording the calls (the network is not needed)."""

  def __init__(self, **kwargs):
    self.init_kwargs, self.logged, self.finished = kwargs, [], False

  def define_metric(self, *args, **kwargs):
    pass

  def log(self, record):
    self.logged.append(record)

  def finish(self):
    self.finished = True


def test_no_resume_refuses_an_earlier_run_and_overwrite_replaces_it(setup, tmp_path, capsys, monkeypatch):
  import wandb

  runs = []
  monkeypatch.setattr(wandb, "init", lambda **kw: runs.append(FakeWandbRun(**kw)) or runs[-1])
  run = tmp_path / "run"
  assert cli.main(args(setup, run, 2, "checkpoint_every=1", "logging.wandb=true")) == 0
  # TensorBoard and W&B hold every scalar of every step, under metrics.jsonl's names
  expected = [(r["step"], k) for r in read_metrics(str(run)) for k, v in r.items()
              if k not in ("step", "time") and v is not None and np.isfinite(v)]
  assert sorted(tensorboard_scalars(run)) == sorted(expected)
  (wandb_run,) = runs
  assert sorted((r["step"], k) for r in wandb_run.logged for k, v in r.items()
                if k != "step" and v is not None and np.isfinite(v)) == sorted(expected)
  assert wandb_run.finished and wandb_run.init_kwargs["id"] == (run / "wandb_run_id").read_text().strip()
  before = (run / "metrics.jsonl").read_text()
  cmd = args(setup, run, 1)
  assert cli.main([*cmd[:3], "--no-resume", *cmd[3:]]) == 1  # a flag among the overrides
  err = capsys.readouterr().err
  assert str(run) in err and "checkpoints of steps [1, 2]" in err and "--overwrite" in err
  assert steps_of(run) == [1, 2] and (run / "metrics.jsonl").read_text() == before
  events = set((run / "tensorboard").iterdir())
  assert cli.main([*cmd[:2], "--overwrite", *cmd[2:], "seed=5"]) == 0
  assert steps_of(run) == [1] and [r["step"] for r in read_metrics(str(run))] == [1]
  assert not events & set((run / "tensorboard").iterdir())
  assert "seed: 5" in (run / "config.yaml").read_text() and not list(run.glob("config.*.yaml"))


# --- 3. non-finite steps are skipped, counted, and stop the run ---------------------------------


def test_nonfinite_steps_are_skipped_then_stop_the_run_and_are_never_saved(setup, tmp_path, capsys):
  from safetensors.numpy import load_file, save_file

  root, model_dir, data = setup
  assert cli.main(args(setup, tmp_path / "lr", 1, "learner.optim.lr=1e39")) == 2
  assert "learner.optim.lr" in capsys.readouterr().err

  nan_model = tmp_path / "nan_model"
  nan_model.mkdir()
  for f in model_dir.iterdir():
    (nan_model / f.name).write_bytes(f.read_bytes())
  weights = load_file(str(nan_model / "model.safetensors"))
  name = next(k for k in weights if "mlp.down_proj" in k)
  weights[name][0, 0] = np.nan
  save_file(weights, str(nan_model / "model.safetensors"), metadata={"format": "pt"})
  run = tmp_path / "nan"
  assert cli.main(args(setup, run, 6, f"model.path={nan_model}")) == 1
  err = capsys.readouterr().err
  assert "steps 1-3: the loss or gradient norm was not finite 3 times in a row" in err, err
  assert "the parameters are the starting ones" in err
  assert "could not save step 3 before stopping: not saving step 3" in err
  records = read_metrics(str(run))
  assert [r["actor/nonfinite_skipped"] for r in records] == [1.0, 1.0, 1.0]
  assert records[-1]["actor/nonfinite_skipped_total"] == 3.0
  assert not (run / "checkpoints").exists() or steps_of(run) == []  # never saved


# --- 4. one trainer per run directory -----------------------------------------------------------


def test_a_second_trainer_is_refused_with_the_holders_pid_and_export_checks_the_run(setup, tmp_path, capsys):
  run = tmp_path / "run"
  with RunDirLock(str(run)):
    assert cli.main(args(setup, run, 1)) == 1
  err = capsys.readouterr().err
  assert f"{run} is in use by another trainer (process {os.getpid()} on" in err
  assert not (run / "metrics.jsonl").exists()
  (run / "trainer.lock").write_text("999999 on a-dead-host\n")  # a lock left by a killed trainer
  assert cli.main(args(setup, run, 1)) == 0
  capsys.readouterr()
  export_refuses_nonfinite_parameters(run, tmp_path, capsys, setup)


def export_refuses_nonfinite_parameters(run, tmp_path, capsys, setup):
  """``rft-jax export`` of a run whose latest checkpoint (written past the checks, as an older or
  foreign one could be) holds NaN parameters: refused, naming the step; nothing written. A resume
  of the run refuses it too, naming the checkpoint."""
  import jax

  from rft_jax.train.checkpoint import RunCheckpointer

  checkpointer = RunCheckpointer(str(run / "checkpoints"))
  from rft_jax.models import load_hf
  from rft_jax.rl.learner import Learner
  from rft_jax.train.config import load_config

  cfg = load_config(str(run / "config.yaml"))
  learner = Learner(load_hf(cfg.model.path), cfg.learner)
  state, meta, _ = checkpointer.restore(learner.init(load_hf(cfg.model.path)))
  poisoned = state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
  import orbax.checkpoint as ocp  # bypass RunCheckpointer.save's refusal: an older or foreign checkpoint

  checkpointer._manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(poisoned),
                                                        meta=ocp.args.JsonSave(meta)))
  checkpointer.close()
  assert cli.main(["export", str(run), str(tmp_path / "hf")]) == 1
  assert "step 2" in capsys.readouterr().err and not (tmp_path / "hf").exists()
  # a resume names the checkpoint at once, instead of blaming the NaN on the steps after it
  records = (run / "metrics.jsonl").read_text()
  assert cli.main(args(setup, run, 3)) == 1
  err = capsys.readouterr().err
  assert (f"rft-jax train: error: checkpoint {run / 'checkpoints' / '2'} (step 2) holds NaN or infinite "
          f"parameters in ") in err and "e.g. params[" in err and "not finite" not in err, err
  assert (run / "metrics.jsonl").read_text() == records and steps_of(run) == [1, 2]


# --- 5. SIGTERM / SIGINT checkpoint the step and stop; a second signal exits at once -----------


def test_sigterm_finishes_the_step_saves_and_the_run_resumes(setup, tmp_path, capsys):
  run = tmp_path / "run"
  proc = trainer(args(setup, run, 50))
  wait_for_records(run, 1, proc)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signal.SIGTERM, err
  done = len(read_metrics(str(run)))
  assert f"stopped by SIGTERM after step {done}" in err and steps_of(run) == [done]
  assert cli.main(args(setup, run, done + 1)) == 0
  assert f"resumed from step {done} of {run}" in capsys.readouterr().err
  assert [r["step"] for r in read_metrics(str(run))] == list(range(1, done + 2))


def test_a_second_signal_exits_at_once(setup, tmp_path):
  run = tmp_path / "run"
  proc = trainer(args(setup, run, 50))
  wait_for_records(run, 1, proc)
  proc.send_signal(signal.SIGINT)
  while "received SIGINT" not in proc.stderr.readline():  # (two signals at once are one for Python)
    pass
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGINT and "second signal (SIGINT): exiting now" in err, err


# --- 6. the end of the data and a failing evaluation leave a checkpoint -------------------------


def test_running_out_of_data_ends_with_a_checkpoint_and_a_message(setup, tmp_path, capsys):
  run = tmp_path / "run"  # 7 training questions, 2 per step: one epoch is 3 steps, and 1 left over
  assert cli.main(args(setup, run, 10, "data.epochs=1", "data.val_size=1")) == 0
  out = capsys.readouterr()
  dropped = ("data: 7 training prompts x data.epochs=1 make 3 steps of data.prompts_per_step=2; the last 1 "
             "prompt(s), too few for another step, are dropped")
  assert out.err.count(dropped) == 1, out.err  # said once, not per step
  assert "the training data ran out (data.epochs=1) after step 3" in out.err
  assert "stopped after 3 of 10 steps (the training data ran out)" in out.out
  assert steps_of(run) == [3] and len(read_metrics(str(run))) == 3
  assert read_metrics(str(run))[0]["data/dropped_prompts"] == 1
  # the same command again has nothing left to do, and says so (no "reward nan")
  assert cli.main(args(setup, run, 10, "data.epochs=1", "data.val_size=1")) == 0
  out = capsys.readouterr().out
  assert out.strip().endswith("in {}: nothing left to do (its latest checkpoint is of step 3)".format(run)), out
  assert "nan" not in out and len(read_metrics(str(run))) == 3


def test_an_evaluation_that_fails_leaves_a_checkpoint_of_the_steps_before_it(setup, tmp_path, monkeypatch):
  from rft_jax.train import loop

  def broken(run, state, completions=None):
    raise RuntimeError("evaluation set vanished")

  monkeypatch.setattr(loop, "evaluate_problems", broken)
  run = tmp_path / "run"
  with pytest.raises(RuntimeError, match="vanished"):
    cli.main(args(setup, run, 4, "eval.every=2"))
  assert steps_of(run) == [2] and [r["step"] for r in read_metrics(str(run))] == [1, 2]


# --- 7. a resume says what it resumed and refuses a config that changes the run -----------------


def test_resume_refuses_config_changes_unless_allowed_and_keeps_the_old_config(setup, tmp_path, capsys):
  run = tmp_path / "run"
  assert cli.main(args(setup, run, 1)) == 0
  original = (run / "config.yaml").read_text()
  assert cli.main(args(setup, run, 2, "seed=3", "data.prompts_per_step=3")) == 1
  err = capsys.readouterr().err
  assert "seed: 0 -> 3" in err and "data.prompts_per_step: 2 -> 3" in err and "--allow-config-change" in err
  assert (run / "config.yaml").read_text() == original and len(read_metrics(str(run))) == 1
  assert cli.main([*args(setup, run, 2, "learner.lrr=1")]) == 2  # fails validation: config untouched
  assert (run / "config.yaml").read_text() == original
  assert cli.main([*args(setup, run, 2, "seed=3"), "--allow-config-change"]) == 0
  assert f"resumed from step 1 of {run}" in capsys.readouterr().err
  assert (run / "config.1.yaml").read_text() == original and "seed: 3" in (run / "config.yaml").read_text()
  assert cli.main(args(setup, run, 3, "seed=3", "checkpoint_every=5")) == 0  # how long / how often: fine


# --- 8. reward functions that fail: counted, logged once, and stop a run they dominate -----------


def test_failing_reward_functions_are_counted_and_stop_the_run_before_it_trains_on_zeros(setup, tmp_path, capsys):
  run = tmp_path / "nan"
  assert cli.main(args(setup, run, 2, "rewards.functions=[reward_fixtures:nan_for_odd_length]",
                       "rewards.function_per_sample=true", "rewards.max_error_fraction=1.0")) == 0
  err = capsys.readouterr().err
  assert err.count("reward function reward_fixtures:nan_for_odd_length failed on") == 1, err  # once
  assert "returned a non-finite reward (nan)" in err
  rollouts = read_jsonl(str(run / "rollouts.jsonl"))  # step 1's 8 completions
  odd = [r for r in rollouts if len(r["completion"]) % 2]
  records = read_metrics(str(run))
  assert records[0]["train/reward_errors"] == len(odd) and all(r["reward"] == 0 for r in odd)
  assert all(r["reward"] == 1 for r in rollouts if r not in odd)
  assert (1, "train/reward_errors") in tensorboard_scalars(run)

  run = tmp_path / "raises"  # a function that always fails: stopped at step 1 with its traceback
  assert cli.main(args(setup, run, 2, "rewards.functions=[reward_fixtures:divides_by_zero]")) == 1
  err = capsys.readouterr().err
  assert ("reward function reward_fixtures:divides_by_zero failed on 8 completion(s): ZeroDivisionError: "
          "division by zero") in err and "in divides_by_zero" in err and "Traceback" in err
  assert err.splitlines()[-1] == (
      "rft-jax train: error: step 1: the rewards of 8 of 8 completions (100%) could not be computed (8 errors: "
      "raised, or returned NaN, inf or the wrong count; 0 timeouts), above rewards.max_error_fraction=0.5; "
      "stopping rather than training on zero rewards: see the first failure of each kind logged above, in "
      "rewards.functions=['reward_fixtures:divides_by_zero']"), err
  assert not (run / "metrics.jsonl").read_text() and steps_of(run) == []


# --- 9. torn metrics and corrupt checkpoints ----------------------------------------------------


def test_a_torn_metrics_line_is_dropped_with_a_warning(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
  with pytest.warns(UserWarning, match="line 3: dropped a torn last record"):
    assert [r["step"] for r in read_metrics(str(path))] == [1, 2]
  path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
  with pytest.raises(ValueError, match="line 2: not a JSON record"):
    read_metrics(str(path))


def _data_files(step_dir):
  return sorted((p for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size > 0
                 and "ocdbt.process" in str(p) and "/d/" in str(p)), key=lambda p: -p.stat().st_size)


def test_corrupt_latest_checkpoints_fall_back_to_the_last_good_one(setup, tmp_path, capsys):
  """Step 4's largest array file is cut in half, step 3's has 8 flipped bytes, step 2's arrays
  no longer match their recorded checksum (as a flip the storage layer misses would): all three
  are moved aside with a warning naming them, and the run resumes from step 1."""
  run = tmp_path / "run"
  assert cli.main(args(setup, run, 4, "checkpoint_every=1", "keep_checkpoints=4")) == 0
  metrics = run / "metrics.jsonl"
  metrics.write_text("".join(metrics.read_text().splitlines(True)[:3]) + '{"step": 4, "lo')  # torn
  for step in (4, 3):
    target = _data_files(run / "checkpoints" / str(step))[0]
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    if step == 4:
      del data[middle:]
    else:
      data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    target.write_bytes(data)
  meta = run / "checkpoints" / "2" / "meta" / "metadata"
  record = json.loads(meta.read_text())
  key = next(iter(record["checksums"]))
  record["checksums"][key] ^= 1
  meta.write_text(json.dumps(record))
  with pytest.warns(UserWarning, match="dropped a torn last record"):
    assert cli.main(args(setup, run, 4, "checkpoint_every=1", "keep_checkpoints=4")) == 0
  gc.collect()  # orbax's abandoned reads of the corrupt files report when collected: to debug.log
  err = capsys.readouterr().err
  assert "Exception ignored" not in err
  for step in (4, 3, 2):  # one short line each (not TensorStore's multi-line spec)
    (line,) = [line for line in err.splitlines() if f"checkpoint {run / 'checkpoints' / str(step)} (step {step})" in line]
    assert line.endswith(f"moved it to {run / 'checkpoints'}.corrupt/, trying the previous checkpoint"), line
    assert len(line) - 2 * len(str(run)) < 300 and "TensorStore" not in line and "spec" not in line, line
    assert (run / "checkpoints.corrupt" / str(step)).is_dir()
  assert "(step 4) does not restore: OUT_OF_RANGE: Error reading" in err  # the truncated file
  assert "(step 2) fails its checksum in 1 array(s)" in err and "resumed from step 1" in err
  assert "Traceback" not in err and "does not restore" in (run / "debug.log").read_text()  # the details
  assert steps_of(run) == [1, 2, 3, 4] and [r["step"] for r in read_metrics(str(run))] == [1, 2, 3, 4]


def test_a_checksum_changes_with_one_flipped_bit_or_moved_values():
  import jax.numpy as jnp

  from rft_jax.train.checkpoint import state_checksums

  a = np.arange(12, dtype=np.float32).reshape(3, 4)
  flipped = a.copy()
  flipped.view(np.uint32)[2, 1] ^= 1 << 7
  b = jnp.ones((5,), jnp.bfloat16)
  sums = state_checksums({"a": jnp.asarray(a), "b": b})
  flipped_sums = state_checksums({"a": jnp.asarray(flipped), "b": b})
  assert flipped_sums["['a']"] != sums["['a']"] and flipped_sums["['b']"] == sums["['b']"]
  assert state_checksums({"a": jnp.asarray(a[::-1].copy()), "b": b})["['a']"] != sums["['a']"]  # moved


def test_after_a_failed_save_orbaxs_unawaited_coroutines_go_to_the_debug_log(tmp_path):
  """Orbax's writes abandoned by a failed save warn "coroutine ... was never awaited" when they
  are collected, at exit, after the run's one error line: those go to the debug log, not the
  console; other warnings, and the same warning before a save failed, are shown as before."""
  import warnings

  from rft_jax.train.debug_log import debug_log, linger

  unawaited = "coroutine 'async_serialize_from_host.<locals>.write_fragment' was never awaited"
  with warnings.catch_warnings(record=True) as shown:  # what would reach the console
    warnings.simplefilter("always")
    with debug_log(str(tmp_path)) as path:
      warnings.warn(unawaited, RuntimeWarning)  # no save has failed: shown
      linger()
    warnings.warn(unawaited, RuntimeWarning)  # lingering after the failure: the debug log's
    warnings.warn("something else", RuntimeWarning)
    with debug_log(str(tmp_path / "next")):  # the next run releases the lingering one
      pass
  assert [str(w.message) for w in shown] == [unawaited, "something else"]
  assert "RuntimeWarning: " + unawaited in open(path).read()
