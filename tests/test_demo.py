"""A shortened run of the embedded demo (the README's main job) on the shipped checkpoint."""

import functools
import os

import numpy as np
import pytest

from loop_fixtures import compilation_cache
from rft_jax.demo import run as demo_run
from rft_jax.demo.methods import METHODS
from rft_jax.demo.run import DEFAULT_VARIANTS, run_demo, split_variants
from rft_jax.models import load_hf
from rft_jax.train.config import load_config
from rft_jax.train.metrics_log import read_metrics

ROOT = os.path.join(os.path.dirname(__file__), "..")
CHECKPOINT = os.path.join(ROOT, "rft_jax", "demo", "checkpoint")


def test_shipped_checkpoint_loads_through_load_hf():
  model = load_hf(CHECKPOINT)
  assert model.config.model_type == "qwen3" and model.config.qk_norm
  assert os.path.exists(os.path.join(CHECKPOINT, "tokenizer.json"))
  size = sum(os.path.getsize(os.path.join(CHECKPOINT, f)) for f in os.listdir(CHECKPOINT))
  assert size < 12 * 2**20  # a few MB in the repository


def test_short_demo_prints_a_table_and_draws_plots(tmp_path, capsys, monkeypatch):
  """Two variants of 2 steps, evaluated at the end on 32 held-out problems (of 256: the table
  and plots do not depend on how many), sharing one compilation cache."""
  monkeypatch.setattr(demo_run, "write_demo_data", functools.partial(demo_run.write_demo_data, heldout_size=32))
  cache = tmp_path / "jax_cache"
  overrides = [f"run_dir={tmp_path}", f"model.path={CHECKPOINT}", "steps=2", "eval.every=2",
               "progress=false", "data.prompts_per_step=8", "learner.micro_batch_size=64", "eval.at_start=false",
               f"compilation_cache_dir={cache}"]
  # Process-wide: later tests compile without it. Every program is kept (threshold 0), so the
  # second variant compiles nothing the first did.
  with compilation_cache(cache, min_compile_seconds=0):
    variants, overrides = split_variants([*overrides, "variants=clip_b,unlikely"])
    summaries = run_demo(os.path.join(ROOT, "configs", "demo.yaml"), overrides, variants=variants)
  assert len(os.listdir(cache)) >= 3  # sampler, learner and evaluation programs were kept
  out = capsys.readouterr().out
  assert "variant" in out and "clip_b" in out and "unlikely" in out and "Avg@" in out
  for s in summaries.values():
    assert 0 <= s["heldout_avg"] <= s["heldout_pass"] <= 1 and np.isfinite(s["entropy_final"])
  assert os.path.getsize(tmp_path / "demo.png") > 10_000
  # Run again, the demo trains nothing and prints the same table from the saved runs (it once
  # refused: "runs/demo/grpo holds checkpoints of steps [2] ... pass --overwrite").
  from rft_jax.train import loop

  with monkeypatch.context() as patched:
    patched.setattr(loop, "train_step", lambda *a, **k: pytest.fail("trained a finished variant again"))
    np.testing.assert_equal(run_demo(os.path.join(ROOT, "configs", "demo.yaml"), overrides, variants=variants),
                            summaries)  # (NaN where the run has none: equal here)
  again = capsys.readouterr().out
  for name in variants:
    assert f"{name}: finished earlier (2 steps in {tmp_path / name}); its row is read from its metrics.jsonl" in again
  assert _table(again) == _table(out)
  # With more steps (as after Ctrl-C) a variant resumes from its checkpoint
  longer = run_demo(os.path.join(ROOT, "configs", "demo.yaml"), [*overrides, "steps=3"], variants=("clip_b",))
  assert [r["step"] for r in read_metrics(str(tmp_path / "clip_b"))] == [1, 2, 3]
  assert longer["clip_b"]["acc_start"] == summaries["clip_b"]["acc_start"]  # step 1's, kept


def _table(out: str) -> list[str]:
  lines = out.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("variant "))
  return lines[start:start + 3]


def test_the_table_says_n_a_for_a_forecast_correlation_it_has_none_of():
  row = {"heldout_avg_start": 0.853, "heldout_avg": 0.907, "heldout_pass": 0.98, "entropy_start": 0.0291,
         "entropy_final": 0.0267, "mask_frac": 0.0, "mask_frac_negative": 0.0, "acc_start": 0.734,
         "acc_end": 0.906, "forecast_r": 0.97, "routing_mismatch": float("nan"), "load_balancing_loss": float("nan")}
  lines = demo_run.table({"grpo": row, "clip_b": {**row, "forecast_r": float("nan")}}, k=4)
  assert lines[1] == ("grpo                  0.853 -> 0.907   0.980                0.0291 -> 0.0267    0.000      "
                      "0.000                   0.734 -> 0.906       0.97")  # as the demo always printed it
  assert lines[2].endswith("       n/a") and "nan" not in lines[2] and len(lines) == 3


def test_demo_variants_are_chosen_by_name():
  assert split_variants(["steps=3"]) == (DEFAULT_VARIANTS, ["steps=3"])
  assert split_variants(["variants=grpo,kl_cov", "steps=3"]) == (("grpo", "kl_cov"), ["steps=3"])
  with pytest.raises(ValueError, match="unknown variant.*'klcov'.*choose from grpo, clip_b"):
    split_variants(["variants=grpo,klcov"])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_demo_variant_configures_on_the_demo(method):
  """Each variant's overrides make a valid run config of ``configs/demo.yaml`` whose batch splits
  into its mini-batches and micro-batches (a variant that does not is found before a run)."""
  cfg = load_config(os.path.join(ROOT, "configs", "demo.yaml"), list(METHODS[method]))
  rows = cfg.data.prompts_per_step * cfg.sampling.n
  assert rows % (cfg.learner.micro_batch_size * cfg.learner.mini_batches) == 0
  if method == "gspo":
    # its own clip, though the schema was built before the override chose the objective
    assert (cfg.learner.resolved_eps_low, cfg.learner.resolved_eps_high) == (3e-4, 4e-4)
  if method == "clip_cov":
    assert (cfg.learner.resolved_eps_low, cfg.learner.resolved_eps_high) == (1.0, 1.0)


def test_demo_takes_overwrite_and_lists_every_variant_in_its_help(monkeypatch, capsys):
  """``rft-jax demo --overwrite`` was refused as an unrecognized argument although the demo's
  refusal offered it; its help listed 11 of the variants, by hand."""
  from rft_jax import cli

  calls = []
  monkeypatch.setattr(demo_run, "run_demo", lambda *a, **k: calls.append(k))
  assert cli.main(["demo", "--overwrite", "steps=2"]) == 0
  assert cli.main(["demo", "steps=2", "--allow-config-change"]) == 0
  assert calls == [{"overwrite": True, "allow_config_change": False}, {"overwrite": False, "allow_config_change": True}]
  with pytest.raises(SystemExit):
    cli.main(["demo", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert text.split(" among ", 1)[1].split(" options:")[0].split(", ") == list(METHODS), text
