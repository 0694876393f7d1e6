"""Relative paths of a config are made absolute when it is loaded, so that a run's config.yaml
reads the same from any directory; the demo finds its config and checkpoint from any directory."""

import os

import pytest
import yaml

from rft_jax import cli
from rft_jax.demo.paths import DEFAULT_CONFIG, REPO_ROOT, load_demo_config
from rft_jax.train.compilation_cache import persistent_compilation_cache
from rft_jax.train.config import PATH_KEYS, load_config, to_yaml


@pytest.fixture
def no_jax_cache():
  """JAX told of no cache directory (the suite sets one: tests/conftest.py)."""
  with persistent_compilation_cache(None):
    yield


def test_relative_paths_are_resolved_against_the_current_directory(tmp_path, monkeypatch):
  config_dir = tmp_path / "configs"
  config_dir.mkdir()
  (config_dir / "c.yaml").write_text(
      "run_dir: runs/a\ncompilation_cache_dir: cache\nmodel:\n  path: models/m\n  ref_path: ../ref\n"
      "data:\n  train_path: ~/d.jsonl\neval:\n  sets:\n    - {name: aime, path: data/aime.jsonl}\n")
  work = tmp_path / "work"
  work.mkdir()
  monkeypatch.chdir(work)
  cfg = load_config(os.path.join("..", "configs", "c.yaml"), ["learner.optim.lr=2e-6", "model.critic_path=critic"])
  written = yaml.safe_load(to_yaml(cfg))  # what RUN_DIR/config.yaml holds
  assert written["run_dir"] == str(work / "runs" / "a")
  assert written["compilation_cache_dir"] == str(work / "cache")
  assert written["model"]["path"] == str(work / "models" / "m")
  assert written["model"]["ref_path"] == str(tmp_path / "ref")
  assert written["model"]["critic_path"] == str(work / "critic")  # an override: the current directory too
  assert written["data"]["train_path"] == os.path.expanduser(os.path.join("~", "d.jsonl"))
  assert written["eval"]["sets"][0]["path"] == str(work / "data" / "aime.jsonl")
  # read back from elsewhere (rft-jax export of the run), the paths stay those of the run
  (tmp_path / "config.yaml").write_text(to_yaml(cfg))
  monkeypatch.chdir(tmp_path)
  again = load_config("config.yaml")
  for key in PATH_KEYS:
    section, _, field = key.rpartition(".")
    owner = getattr(again, section) if section else again
    assert os.path.isabs(getattr(owner, field))
  assert to_yaml(again) == to_yaml(cfg)


def test_unset_paths_and_urls_are_kept(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  cfg = load_config(None, ["model.path=m", "data.train_path=gs://bucket/d.jsonl"])
  assert cfg.model.ref_path == "" and cfg.compilation_cache_dir is None  # unset: RUN_DIR/.jax_cache
  assert cfg.data.train_path == "gs://bucket/d.jsonl"
  assert cfg.model.path == str(tmp_path / "m")


def test_demo_config_resolves_from_another_directory(tmp_path, monkeypatch, no_jax_cache):
  monkeypatch.chdir(tmp_path)
  assert cli.build_parser().parse_args(["demo"]).config == DEFAULT_CONFIG
  cfg = load_demo_config()
  assert cfg.model.path == os.path.join(REPO_ROOT, "rft_jax", "demo", "checkpoint")
  assert os.path.isfile(os.path.join(cfg.model.path, "config.json"))
  assert cfg.run_dir == str(tmp_path / "runs" / "demo")  # outputs go where the demo is run
  assert cfg.compilation_cache_dir == str(tmp_path / "runs" / "demo" / ".jax_cache")  # not ./runs


def test_demo_overrides_are_relative_to_the_current_directory(tmp_path, monkeypatch, no_jax_cache):
  monkeypatch.chdir(tmp_path)
  cfg = load_demo_config(DEFAULT_CONFIG, ["run_dir=out", "model.path=mine"])
  assert cfg.run_dir == str(tmp_path / "out") and cfg.model.path == str(tmp_path / "mine")
  assert cfg.compilation_cache_dir == str(tmp_path / "out" / ".jax_cache")
  assert load_demo_config(None, ["compilation_cache_dir="]).compilation_cache_dir == ""
  assert load_demo_config(None, ["compilation_cache_dir=c"]).compilation_cache_dir == str(tmp_path / "c")
