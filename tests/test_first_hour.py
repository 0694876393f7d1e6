"""A new user's first hour, as the README leads them: each trap they met, checked fixed.

One short run (a reward that never matches, no evaluation sets) serves the run-level checks: the
"no learning signal" warning, no blank evaluation, the exported weights' mode, ``rft-jax eval``
refusing a reward it cannot import before it loads anything.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import yaml

from loop_fixtures import make_loop_files, overrides
from rft_jax import cli
from rft_jax.train.metrics_log import read_metrics


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  return make_loop_files(tmp_path_factory.mktemp("first_hour"))


@pytest.fixture(scope="module")
def flat_run(setup, tmp_path_factory):
  """3 steps whose rewards are all 0, with evaluation on (every step, and at the start) but
  nothing to evaluate: no validation split, ``eval.sets=[]``. Returns ``(run_dir, stderr)``."""
  run_dir = tmp_path_factory.mktemp("project") / "runs" / "flat"
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    code = cli.main(["train", *overrides(setup, run_dir, 3, "rewards.functions=[reward_fixtures:never_matches]",
                                         "data.val_size=0", "eval.sets=[]", "eval.every=1", "eval.at_start=true",
                                         "log_rollouts_every=1")])
  assert code == 0, err.getvalue()
  return run_dir, err.getvalue()


def test_a_run_without_reward_variance_warns_once_naming_the_steps(flat_run):
  run_dir, err = flat_run
  warnings = [line for line in err.splitlines() if "no learning signal" in line]
  assert len(warnings) == 1, err  # once, not at every step
  line = warnings[0]
  # a 3-step run: all of its steps (the threshold is NO_SIGNAL_STEPS, or a shorter run's length)
  assert "steps 1-3" in line and "mean reward 0" in line
  assert "rewards.functions=['reward_fixtures:never_matches']" in line and "data.instruction" in line
  assert str(run_dir / "rollouts.jsonl") in line
  assert all(r["train/zero_variance_group_frac"] == 1.0 for r in read_metrics(str(run_dir)))


def test_no_signal_warning_is_said_once_per_stretch(capsys):
  from rft_jax.train.config import load_config
  from rft_jax.train.learning_signal import NO_SIGNAL_STEPS, NoSignalWarning
  from rft_jax.train.status import configure_logging

  configure_logging(0)
  flat, varied = {"zero_variance_group_frac": 1.0, "reward_mean": 1.0}, {"zero_variance_group_frac": 0.5}
  watch = NoSignalWarning(load_config(None, ["steps=100", "log_rollouts_every=0"], required=()), start=0)
  for step, m in enumerate([flat] * (NO_SIGNAL_STEPS - 1) + [varied] + [flat] * (2 * NO_SIGNAL_STEPS)):
    watch.update(step, m)
  lines = [line for line in capsys.readouterr().err.splitlines() if "no learning signal" in line]
  # the first stretch ended one step short; the second is named once, at its 5th step
  assert len(lines) == 1 and f"steps {NO_SIGNAL_STEPS}-{2 * NO_SIGNAL_STEPS - 1}" in lines[0], lines
  assert "mean reward 1" in lines[0] and "the math check" in lines[0] and "rollouts.jsonl" not in lines[0]
  # a resumed run with 2 steps left names them both
  watch = NoSignalWarning(load_config(None, ["steps=10"], required=()), start=8)
  watch.update(8, flat)
  assert "no learning signal" not in capsys.readouterr().err
  watch.update(9, flat)
  assert "steps 8-9" in capsys.readouterr().err


def test_nothing_to_evaluate_logs_no_evaluation_and_writes_no_file(flat_run):
  run_dir, err = flat_run
  assert "evaluation after step" not in err
  assert not (run_dir / "eval_completions.jsonl").exists()
  records = read_metrics(str(run_dir))
  assert [r["step"] for r in records] == [1, 2, 3]  # no step 0 (eval.at_start)
  assert not any(k.startswith("eval/") or k == "timing/eval_s" for r in records for k in r)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_weights_have_the_mode_of_the_other_files(flat_run, tmp_path, umask):
  run_dir, _ = flat_run
  previous = os.umask(umask)
  try:
    assert cli.main(["export", str(run_dir), str(tmp_path / "hf")]) == 0
  finally:
    os.umask(previous)
  modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
  assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_eval_refuses_a_reward_it_cannot_import_before_loading_the_model(flat_run, setup, tmp_path, monkeypatch,
                                                                         capsys):
  """The run's reward module, not on this shell's module path: one line with the PYTHONPATH to
  set (the directory holding it, found beside the run directory), before the model loads."""
  project = tmp_path / "project"  # PROJECT/runs/flat, as `rft-jax train` run from PROJECT
  run_dir = _copy_run(flat_run[0], project / "runs" / "flat")
  (project / "first_hour_task.py").write_text("def score(completions, answers, rows):\n"
                                             "  return [0.0] * len(completions)\n")
  config = yaml.safe_load((run_dir / "config.yaml").read_text())
  config["rewards"]["functions"] = ["first_hour_task:score"]
  (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
  from rft_jax.train import policy

  monkeypatch.setattr(policy, "load_policy", lambda *a, **k: pytest.fail("loaded the model before the check"))
  (tmp_path / "elsewhere").mkdir()
  monkeypatch.chdir(tmp_path / "elsewhere")
  assert cli.main(["eval", "--model", str(run_dir), "--data", str(setup[2]), "--k", "1"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert err.startswith(f"rft-jax eval: error: {run_dir / 'config.yaml'}: rewards.functions: cannot import "
                        "'first_hour_task'")
  assert f"first_hour_task.py is in {project}" in err and f"PYTHONPATH={project} rft-jax" in err


def _copy_run(run_dir, to, **config_changes):
  """A copy of a run directory, its config.yaml's sections updated with ``config_changes``."""
  import shutil

  shutil.copytree(run_dir, to, ignore=shutil.ignore_patterns(".jax_cache", "trainer.lock"))
  config = yaml.safe_load((to / "config.yaml").read_text())
  for section, values in config_changes.items():
    config[section].update(values)
  (to / "config.yaml").write_text(yaml.safe_dump(config))
  return to


@pytest.mark.parametrize("kind, marked", [(None, None), ("clip_v", "Clip_V")])
def test_the_attribution_page_names_the_mask_the_run_used(flat_run, setup, tmp_path, monkeypatch, kind, marked):
  """Not Clip_B on a run without masks: the run's own mask, or none."""
  from rft_jax.analysis import attribution

  masks = []
  monkeypatch.setattr(attribution, "attribute", lambda *a, mask, **k: masks.append(mask.kind) or [])
  learner = yaml.safe_load((flat_run[0] / "config.yaml").read_text())["learner"]
  if kind is not None:
    learner["entropy_mask"]["kind"] = kind
  run_dir = _copy_run(flat_run[0], tmp_path / "run", learner=learner)
  out = tmp_path / "page.html"
  assert cli.main(["attribute", "--model", str(run_dir), "--data", str(setup[2]), "--out", str(out)]) == 0
  page = out.read_text()
  assert masks == [kind or "none"] and "are those Clip_B" not in page and "Clip_B masks" not in page
  if marked is None:
    assert "No entropy mask is marked: the run used none" in page
  else:
    assert f"Outlined tokens are those {marked} would take out of the loss" in page
  # --mask marks another one on any run
  assert cli.main(["attribute", "--model", str(run_dir), "--data", str(setup[2]), "--out", str(out),
                   "--mask", "clip_b"]) == 0
  assert masks[-1] == "clip_b" and "Outlined tokens are those Clip_B would" in out.read_text()


def test_train_names_the_pythonpath_of_a_reward_module_in_the_current_directory(setup, tmp_path, monkeypatch, capsys):
  (tmp_path / "my_task.py").write_text("def score(completions, answers, rows):\n  return [0.0] * len(completions)\n")
  monkeypatch.chdir(tmp_path)
  args = overrides(setup, tmp_path / "run", 1, "rewards.functions=[my_task:score]")
  assert cli.main(["train", "--dry-run", *args]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "cannot import 'my_task'" in err and "PYTHONPATH=. rft-jax" in err, err
  # nowhere to be found: the generic hint
  assert cli.main(["train", "--dry-run", *args[:-1], "rewards.functions=[nowhere_task:score]"]) == 2
  assert "PYTHONPATH=/path/to/that/directory" in capsys.readouterr().err
  # a module that is found but fails inside: its own error, no PYTHONPATH hint
  (tmp_path / "broken_task.py").write_text("import not_installed_package\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  assert cli.main(["train", "--dry-run", *args[:-1], "rewards.functions=[broken_task:score]"]) == 2
  err = capsys.readouterr().err
  assert "No module named 'not_installed_package'" in err and "PYTHONPATH" not in err


@pytest.mark.parametrize("override, message", [
    ("learner.entropy_mask.kind=clipb", "learner.entropy_mask.kind='clipb' is not one of"),
    ("learner.entropy_method.kind=clipb", "learner.entropy_method.kind='clipb' is not one of"),
    ("learner.entropy_mask.max_frac=2", "learner.entropy_mask.max_frac must be in [0, 1], got 2.0"),
    ("learner.advantage=foo", "learner.advantage='foo' is not one of"),
])
def test_every_config_error_names_its_source_and_its_full_key(override, message):
  from rft_jax.train.config import ConfigError, load_config

  with pytest.raises(ConfigError) as raised:
    load_config(None, [override], required=())
  assert str(raised.value).startswith(f"the command line ({override}): {message}"), str(raised.value)


def test_invalid_options_exit_2_before_anything_loads(setup, tmp_path, monkeypatch, capsys):
  from rft_jax.train import policy

  monkeypatch.setattr(policy, "load_policy", lambda *a, **k: pytest.fail("loaded a model"))
  _, model_dir, data = setup
  common = ["--model", str(model_dir), "--data", str(data)]
  cases = [(["demo", "variants=nope"], "unknown variant(s) ['nope']"),
           (["filter", *common, "--low", "0.9", "--high", "0.1", "--out", str(tmp_path / "f")],
            "need 0 <= low < high <= 1"),
           (["eval", *common, "--k", "0"], "--k 0: must be >= 1"),
           (["eval", *common, "--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0"),
           (["eval", *common, "--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
           (["attribute", *common, "--mask", "clipb"], "--mask 'clipb': learner.entropy_mask.kind='clipb'"),
           (["plot", str(tmp_path)], "no metrics.jsonl there")]
  for argv, message in cases:
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"rft-jax {argv[0]}: error: ") and message in err, err


def test_the_help_says_which_exit_status_means_what():
  text = cli.build_parser().format_help()
  assert "exit status" in text
  for line in ("  0       done", "  1       refused or stopped", "  2       invalid input",
               "  128+N   stopped by signal"):
    assert line in text, line
  train = cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help()
  assert "learner.optim.lr" in train and "2       invalid input" in train


def test_the_forecast_panel_says_n_a_for_a_correlation_of_one_point(tmp_path):
  from rft_jax.analysis.plots import correlation_label, draw_runs

  assert correlation_label(float("nan")) == "r = n/a" and correlation_label(0.8312) == "r = 0.83"
  run = tmp_path / "one_point"
  run.mkdir()
  record = {"step": 1, "time": 0.0, "actor/entropy": 1.0, "entropy/forecast": -1e-4, "entropy/measured": -2e-4}
  (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
  fig = draw_runs([str(run)])
  labels = [t.get_text() for t in fig.axes[3].get_legend().get_texts()]
  assert labels == ["one_point (r = n/a)"]
