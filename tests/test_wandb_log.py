"""The optional Weights & Biases mirror: offline mode writes the run without a network and a
resumed training run continues the same W&B run; without wandb installed, one line says so."""

import importlib.util
import os

import pytest

from rft_jax.train.config import ConfigError, LoggingConfig
from rft_jax.train.metrics_log import MetricsLog
from rft_jax.train.wandb_log import RUN_ID_FILE, WandbLog


def test_offline_mode_writes_the_run_and_a_resume_continues_it(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_SILENT", "true")
  settings = LoggingConfig(wandb=True, wandb_mode="offline")
  log = MetricsLog(str(tmp_path), tensorboard=False, mirror=WandbLog(str(tmp_path), settings, {"seed": 0}, resume=False))
  log.write(-1, {"eval_val_avg@4": 0.5})
  log.write(0, {"loss": 1.0, "entropy": 0.3})
  log.close()
  run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
  runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
  assert len(runs) == 1 and runs[0].endswith(run_id)
  assert (tmp_path / "wandb" / runs[0] / f"run-{run_id}.wandb").stat().st_size > 0
  again = WandbLog(str(tmp_path), settings, {"seed": 0}, resume=True)  # the training run resumed
  again.write(1, {"actor/loss": 0.9})
  again.close()
  assert (tmp_path / RUN_ID_FILE).read_text().strip() == run_id
  assert sum(d.endswith(run_id) for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")) == 2


def test_wandb_mode_is_checked_and_a_missing_package_is_named(monkeypatch):
  with pytest.raises(ConfigError, match="logging.wandb_mode='ofline'"):
    LoggingConfig(wandb=True, wandb_mode="ofline")
  from rft_jax.train import preflight

  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))

  class Config:  # only what the check reads
    logging = LoggingConfig(wandb=True)

  with pytest.raises(ConfigError, match=r"logging.wandb=true needs the wandb package: pip install 'rft_jax\[wandb\]'"):
    preflight.check_logging(Config())
