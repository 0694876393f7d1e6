"""Checks that run before the model loads: new config fields, load-time value checks, and
``validate_for_training`` (paths, row counts, the data-parallel split) against files and devices."""

import json
import os

import pytest

from rft_jax.models import CheckpointError
from rft_jax.train.config import ConfigError, load_config
from rft_jax.train.preflight import data_parallel_devices, validate_for_training

MODEL = os.path.join(os.path.dirname(__file__), "..", "rft_jax", "demo", "checkpoint")


def write_jsonl(path, n):
  path.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(n)))
  return str(path)


@pytest.fixture
def files(tmp_path):
  return {"train": write_jsonl(tmp_path / "train.jsonl", 20), "aime": write_jsonl(tmp_path / "aime.jsonl", 3)}


def config(files, *overrides, required=("model.path", "data.train_path")):
  base = [f"model.path={MODEL}", f"data.train_path={files['train']}", "data.val_size=4",
          "data.prompts_per_step=4", "sampling.n=4", "learner.micro_batch_size=8",
          "eval.every=5", f"eval.sets=[{{name: aime, path: '{files['aime']}', k: 2}}]"]
  return load_config(None, base + list(overrides), required=required)


# ----------------------------------------------------------------------------- load time

def test_max_nonfinite_steps_defaults_to_three_and_must_be_positive(files):
  assert config(files).max_nonfinite_steps == 3
  assert config(files, "max_nonfinite_steps=1").max_nonfinite_steps == 1
  with pytest.raises(ConfigError, match="max_nonfinite_steps must be > 0, got 0"):
    config(files, "max_nonfinite_steps=0")


@pytest.mark.parametrize("override,message", [
    ("data.prompts_per_step=0", r"data\.prompts_per_step must be > 0, got 0"),
    ("data.val_size=-1", r"data\.val_size must be >= 0, got -1"),
    ("mesh.data=0", r"mesh\.data=0 must be -1"),
    ("mesh.model=0", r"mesh\.model=0 must be >= 1"),
    ("eval.val_k=0", r"eval\.val_k=0 must be >= 1"),
    ("sampling.kv_pages=0", r"sampling\.kv_pages=0 must be >= 1"),
    ("sampling.page_size=0", r"sampling\.page_size=0 must be >= 1"),
])
def test_value_checks_at_load_time_name_the_key(files, override, message):
  with pytest.raises(ConfigError, match=message):
    config(files, override)


def test_plan_style_loading_does_not_touch_data_files(tmp_path):
  """``rft-jax plan`` loads configs whose data files need not exist: load_config checks no path."""
  cfg = load_config(None, [f"model.path={MODEL}", f"data.train_path={tmp_path / 'absent.jsonl'}"],
                    required=("model.path",))
  assert cfg.data.train_path.endswith("absent.jsonl")


# ----------------------------------------------------------------------------- preflight

def test_a_runnable_config_passes(files):
  validate_for_training(config(files), n_devices=8)


def test_routing_replay_on_a_dense_model_is_refused_naming_the_key(files):
  with pytest.raises(ConfigError, match=r"learner\.routing_replay=true needs a mixture-of-experts model; "
                                        r"model\.path=.* is model_type 'qwen"):
    validate_for_training(config(files, "learner.routing_replay=true"), 8)


def test_model_path_must_be_a_model_directory(files, tmp_path):
  with pytest.raises(ConfigError, match=r"model\.path='.*nowhere': no such directory"):
    validate_for_training(config(files, f"model.path={tmp_path / 'nowhere'}"), 8)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ConfigError, match=r"model\.path='.*empty': no config\.json"):
    validate_for_training(config(files, f"model.path={tmp_path / 'empty'}"), 8)
  (tmp_path / "broken").mkdir()
  (tmp_path / "broken" / "config.json").write_text('{"model_type": "qwen2",\n')
  with pytest.raises(CheckpointError, match=r"broken/config\.json: not valid JSON: line 2"):
    validate_for_training(config(files, f"model.path={tmp_path / 'broken'}"), 8)


def test_missing_training_file_names_the_key(files, tmp_path):
  with pytest.raises(ConfigError, match=r"data\.train_path: .*absent\.jsonl: no such file"):
    validate_for_training(config(files, f"data.train_path={tmp_path / 'absent.jsonl'}"), 8)


def test_missing_eval_set_fails_before_the_run_not_at_its_first_evaluation(files, tmp_path):
  bad = f"eval.sets=[{{name: aime, path: '{tmp_path / 'aime25.jsonl'}', k: 2}}]"
  with pytest.raises(ConfigError, match=r"eval\.sets\[0\] \('aime'\) path: .*aime25\.jsonl: no such file"):
    validate_for_training(config(files, bad), 8)
  validate_for_training(config(files, bad, "eval.every=0"), 8)  # never evaluated: not needed


def test_val_size_is_checked_against_the_rows_of_the_training_file(files):
  with pytest.raises(ConfigError, match=r"data\.val_size=20 must be below .* has 20 rows"):
    validate_for_training(config(files, "data.val_size=20"), 8)
  with pytest.raises(ConfigError, match=r"has 20 rows; holding out data\.val_size=18 leaves 2, fewer "
                                        r"than one batch of data\.prompts_per_step=4"):
    validate_for_training(config(files, "data.val_size=18"), 8)


@pytest.mark.parametrize("overrides,n_devices,data", [
    ((), 8, 8), (("mesh.model=2",), 8, 4), (("mesh.data=2",), 8, 2), (("learner.micro_batch_size=4",), 4, 4),
])
def test_data_parallel_size(files, overrides, n_devices, data):
  assert data_parallel_devices(config(files, *overrides), n_devices) == data


@pytest.mark.parametrize("overrides,n_devices,message", [
    (("learner.micro_batch_size=4",), 8,
     r"learner\.micro_batch_size=4 is not a multiple of the 8 data-parallel devices \(mesh\.data=-1: "
     r"8 devices / mesh\.model=1\)"),
    (("mesh.data=4", "mesh.model=4"), 8, r"mesh\.data=4 x mesh\.model=4 = 16 devices, but 8 are available"),
    (("mesh.model=3",), 8, r"mesh\.model=3 does not divide the 8 devices"),
])
def test_mesh_and_batch_split_on_the_devices(files, overrides, n_devices, message):
  with pytest.raises(ConfigError, match=message):
    validate_for_training(config(files, *overrides), n_devices)
