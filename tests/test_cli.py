"""The ``rft-jax`` command line."""

from rft_jax import cli


def test_verify_passes_and_prints_every_identity(capsys):
  assert cli.main(["verify", "--cases", "64", "--vocab", "16"]) == 0
  out = capsys.readouterr().out
  for name in cli.VERIFY_TOLERANCES:
    assert name in out
  assert " NO" not in out


def test_unknown_subcommand_is_an_error(capsys):
  try:
    cli.main(["no-such-command"])
  except SystemExit as exc:
    assert exc.code == 2
  else:
    raise AssertionError("argparse accepted an unknown subcommand")
  assert "no-such-command" in capsys.readouterr().err


def demo_overrides(tmp_path, *extra):
  """The demo config with its shipped checkpoint and a small training file of ``tmp_path``."""
  import os

  from rft_jax.demo.paths import REPO_ROOT
  from rft_jax.demo.task import RL_SEED, addition_problems, write_problems

  train = write_problems(addition_problems(40, seed=RL_SEED), str(tmp_path / "train.jsonl"))
  return ["--config", os.path.join(REPO_ROOT, "configs", "demo.yaml"), f"run_dir={tmp_path / 'run'}",
          f"data.train_path={train}", "eval.every=0", "eval.at_start=false", *extra]


def test_print_config_prints_the_effective_config_and_leaves_the_run_dir_alone(tmp_path, monkeypatch, capsys):
  import yaml

  monkeypatch.chdir(tmp_path)
  assert cli.main(["train", "--print-config", "learner.optim.lr=3e-6", "model.path=m"]) == 0
  printed = yaml.safe_load(capsys.readouterr().out)
  assert printed["learner"]["optim"]["lr"] == 3e-6 and printed["sampling"]["n"] == 16  # defaults filled in
  assert printed["model"]["path"] == str(tmp_path / "m")  # paths absolute
  assert printed["run_dir"] == str(tmp_path / "runs" / "default")
  assert printed["learner"]["temperature"] == 1.0  # derived from sampling.temperature
  assert not (tmp_path / "runs").exists()


def test_dry_run_checks_files_and_devices_without_the_model(tmp_path, capsys):
  assert cli.main(["train", "--dry-run", *demo_overrides(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert out.startswith("config OK: ") and "8 devices" in out
  assert not (tmp_path / "run").exists()  # the run directory is not touched
  assert cli.main(["train", "--dry-run", *demo_overrides(tmp_path, f"data.train_path={tmp_path / 'no.jsonl'}")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("rft-jax train: error: data.train_path") and len(err.strip().splitlines()) == 1
  assert cli.main(["train", "--dry-run", *demo_overrides(tmp_path, "mesh.model=3")]) == 2
  assert "mesh.model=3" in capsys.readouterr().err
  assert not (tmp_path / "run").exists()


def test_train_help_lists_the_config_keys_with_their_defaults(capsys):
  import pytest

  from rft_jax.train.config import config_keys

  with pytest.raises(SystemExit) as exc:
    cli.main(["train", "--help"])
  assert exc.value.code == 0
  out = capsys.readouterr().out
  for line in ("learner.optim.lr = 1e-06", "learner.entropy_mask.kind = 'none'", "rewards.scheme = 'binary'",
               "sampling.n = 16", "model.path = ''", "eval.sets[i].k = 8", "mesh.data = -1",
               "data.system_prompt = null", "progress = true", "--print-config", "--dry-run",
               # the keys of model.lora, a section that is null by default
               "model.lora.rank = 16", "model.lora.alpha = 32.0", "model.lora.targets = ['q_proj', "):
    assert line in out, line
  assert len(config_keys()) > 60 and all(f"  {key} = " in out for key, _ in config_keys())
  assert "learner.objective = 'ppo'  (one of: ppo, gspo)" in out
  assert "(one of: continuous, static)" in out  # sampling.scheduler


def test_every_subcommand_help_shows_its_defaults(capsys):
  import pytest

  expected = {"verify": "(default: 256)", "sft": "(default: 1000)", "eval": "(default: 0.7)",
              "filter": "(default: 16)", "demo": "configs/demo.yaml)", "plot": "plots.png in the first run"}
  for command, text in expected.items():
    with pytest.raises(SystemExit):
      cli.main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # help lines wrap
    assert text in out, (command, out)
