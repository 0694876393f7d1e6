"""The logged metric names: one namespaced scheme, idempotent, readable from older runs' files."""

import json

from rft_jax.train.metric_names import NAMES, logged_name, logged_names
from rft_jax.train.metrics_log import MetricsLog, read_metrics


def test_names_map_into_their_namespaces_once():
  assert logged_name("reward_mean") == "train/reward_mean" and logged_name("clip_frac_low") == "actor/pg_clipfrac_low"
  assert logged_name("eval_aime_2024_avg@32") == "eval/aime_2024/avg@32"  # a set name with underscores
  assert logged_name("eval_val_entropy") == "eval/val/entropy" and logged_name("data_rows") == "data/rows"
  assert logged_name("something_new") == "other/something_new"
  for name in (*NAMES, "eval_val_pass@4", "step", "time"):
    assert logged_name(logged_name(name)) == logged_name(name)  # idempotent
  assert len(set(NAMES.values())) == len(NAMES)  # no two metrics share a logged name


def test_a_run_logged_with_flat_names_reads_back_namespaced(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": 1.0, "entropy": 0.5, "eval_val_avg@4": 0.25}) + "\n")
  # (and with the steps counted from 1: the file counted them from 0, as runs then did)
  assert read_metrics(str(tmp_path)) == [{"step": 1, "time": 1.0, "actor/entropy": 0.5, "eval/val/avg@4": 0.25}]
  log = MetricsLog(str(tmp_path / "new"), tensorboard=False)
  log.write(3, {"entropy": 0.5, "eval_val_avg@4": 0.25})
  log.close()
  (record,) = read_metrics(str(tmp_path / "new"))
  assert {k: v for k, v in record.items() if k != "time"} == {"step": 3, **logged_names({"entropy": 0.5, "eval_val_avg@4": 0.25})}
  assert "actor/entropy" in (tmp_path / "new" / "metrics.jsonl").read_text()  # as written, not only as read
