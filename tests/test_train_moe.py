"""A short training run of a tiny Qwen3-MoE (8 experts, top-2) on the fake 8-device mesh with
rollout routing replay: the sampler's recorded routing reaches the learner through the loop, and
the run logs the router's metrics (``router/*``)."""

import shutil

import numpy as np
import pytest

from hf_fixtures import make_tiny_tokenizer
from loop_fixtures import make_loop_files, overrides
from moe_fixtures import make_tiny_moe
from rft_jax import cli
from rft_jax.train.metrics_log import read_metrics


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root, _, data = make_loop_files(tmp_path_factory.mktemp("moe_loop"))
  model_dir = make_tiny_moe(root, "qwen3_moe", vocab=128)
  (root / "moe_tokenizer").mkdir()
  for f in make_tiny_tokenizer(root / "moe_tokenizer").iterdir():
    shutil.copy(f, model_dir / f.name)
  return root, model_dir, data


def test_a_run_with_routing_replay_logs_the_router_metrics(setup, tmp_path):
  run_dir = tmp_path / "run"
  assert cli.main(["train", *overrides(setup, run_dir, 2, "learner.routing_replay=true",
                                        "learner.router_z_loss_coef=0.001", "eval.every=0",
                                        "learner.forecast_every=0")]) == 0
  records = [r for r in read_metrics(str(run_dir)) if r["step"] >= 1]  # step 0: the start
  assert [r["step"] for r in records] == [1, 2]
  for r in records:
    for key in ("router/load_balancing_loss", "router/z_loss", "router/expert_load_max",
                "router/routing_mismatch", "actor/loss", "actor/logp_mismatch_max"):
      assert np.isfinite(r[key]), key
    assert r["actor/logp_mismatch_max"] < 1e-4  # replayed: the sampler's log-probs to float32 rounding
