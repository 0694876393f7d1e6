"""End-to-end runs of the training loop on a tiny random Qwen and a synthetic dataset."""

import json

import numpy as np
import pytest

from loop_fixtures import QUESTIONS, make_loop_files, overrides
from rft_jax import cli
from rft_jax.train.config import load_config
from rft_jax.train.loop import train
from rft_jax.train.metrics_log import read_jsonl, read_metrics


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  return make_loop_files(tmp_path_factory.mktemp("loop"))


VOLATILE = ("time", "timing/sample_s", "timing/reward_s", "timing/learner_s", "timing/eval_s",
            "timing/sample_tokens_per_s")


def test_end_to_end_run_writes_metrics_checkpoint_and_plots(setup, tmp_path, monkeypatch, capsys):
  run_dir = tmp_path / "run"
  assert cli.main(["train", *overrides(setup, run_dir, 3, "checkpoint_every=2", "log_rollouts_every=2",
                                        "eval.at_start=true", "data.instruction=be brief")]) == 0
  start, *records = read_metrics(str(run_dir))
  assert [r["step"] for r in records] == [1, 2, 3]
  assert start["step"] == 0 and 0.0 <= start["eval/val/avg@2"] <= 1.0 and start["timing/eval_s"] > 0
  assert "actor/loss" not in start  # the evaluation before any update, nothing else
  assert 0 < start["eval/val/entropy"] < np.log(128) and np.isfinite(records[-1]["eval/val/entropy"])
  # one namespaced scheme for every metric (rft_jax/train/metric_names.py)
  assert {k.split("/")[0] for r in records for k in r} == {
      "step", "time", "train", "actor", "entropy", "mask", "eval", "timing", "data"}
  for key in ("actor/loss", "actor/entropy", "train/reward_mean", "train/accuracy",
              "train/response_length_mean", "train/truncated_frac", "train/zero_variance_group_frac",
              "timing/sample_s", "timing/learner_s", "entropy/forecast", "actor/pg_clipfrac_low", "mask/frac"):
    assert key in records[-1] and np.isfinite(records[-1][key]), key
  assert "entropy/measured" in records[0]
  assert 0.0 <= records[-1]["eval/val/avg@2"] <= 1.0 and 0.0 <= records[-1]["eval/val/pass@2"] <= 1.0
  assert records[-1]["timing/eval_s"] > 0 and "timing/eval_s" not in records[0]  # eval on step 2 only
  assert records[0]["data/prompts_too_long"] == 0 and records[0]["data/train_prompts"] == 6
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]
  # TensorBoard carries the JSONL's names as they are ("@" included)
  assert any(b"eval/val/avg@2" in f.read_bytes() for f in (run_dir / "tensorboard").iterdir())
  # completions of steps 1 and 3 (2 prompts x 4 samples each), with the learner's per-completion stats
  rollouts = read_jsonl(str(run_dir / "rollouts.jsonl"))
  assert [r["step"] for r in rollouts] == [1] * 8 + [3] * 8
  assert {r["answer"] for r in rollouts} <= {"0", "1", "2"} and all("be brief" in r["prompt"] for r in rollouts)
  for r in rollouts:
    assert 0 < r["entropy_mean"] < np.log(128) and np.isfinite(r["s_star_mean"]) and r["masked_tokens"] == 0
    assert np.isfinite(r["reward"]) and 1 <= r["length"] <= 6 and isinstance(r["completion"], str)
  for step in (1, 3):
    group = [r for r in rollouts if r["step"] == step]
    # advantages are the group z-scores of the logged rewards (4 samples per prompt)
    for g in range(2):
      rewards = np.array([r["reward"] for r in group[4 * g:4 * g + 4]])
      expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
      np.testing.assert_allclose([r["advantage"] for r in group[4 * g:4 * g + 4]], expected, atol=1e-5)
    logged = next(r for r in records if r["step"] == step)
    assert np.mean([r["reward"] for r in group]) == pytest.approx(logged["train/reward_mean"])
  # every evaluation's answers (2 held-out problems x 2 samples), before training and after step 3
  answers = read_jsonl(str(run_dir / "eval_completions.jsonl"))
  assert [(r["step"], r["set"]) for r in answers] == [(0, "val")] * 4 + [(3, "val")] * 4
  assert np.mean([r["correct"] for r in answers if r["step"] == 3]) == pytest.approx(records[-1]["eval/val/avg@2"])
  assert cli.main(["plot", str(run_dir), "--out", str(tmp_path / "plots.png")]) == 0
  assert (tmp_path / "plots.png").stat().st_size > 10_000
  out = tmp_path / "hf"
  assert cli.main(["export", str(run_dir), str(out)]) == 0
  assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
  # the source checkpoint's dtype (float32 here) and its generation_config.json, as they were
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
  assert (out / "generation_config.json").read_text() == (setup[1] / "generation_config.json").read_text()

  # `rft-jax eval` on the run prompts as the run did (its instruction), unless told otherwise
  from rft_jax.models import chat_token_ids, load_tokenizer
  from rft_jax.train import evaluate as evaluate_module

  prompts, real = [], evaluate_module.evaluate
  monkeypatch.setattr(evaluate_module, "evaluate", lambda *a, prompt_fn, **kw: prompts.append(prompt_fn("what is ?"))
                      or real(*a, prompt_fn=prompt_fn, **kw))
  common = ["eval", "--model", str(run_dir), "--data", str(setup[2]), "--k", "1", "--max-new-tokens", "2"]
  saved = tmp_path / "answers.jsonl"
  assert cli.main([*common, "--save-completions", str(saved)]) == 0 and cli.main([*common, "--instruction", ""]) == 0
  assert [r["question"] for r in read_jsonl(str(saved))] == QUESTIONS and all(r["length"] <= 2 for r in read_jsonl(str(saved)))
  tokenizer = load_tokenizer(str(out))
  assert prompts == [chat_token_ids(tokenizer, "what is ? be brief"), chat_token_ids(tokenizer, "what is ?")]
  # without --max-new-tokens / --format: the run's (sampling.max_new_tokens=6, data.format=jsonl)
  assert cli.main([*common[:-2], "--save-completions", str(saved)]) == 0
  assert 2 < max(r["length"] for r in read_jsonl(str(saved))) <= 6  # not 2, not the HF default 1024
  capsys.readouterr()
  assert cli.main([*common, "--format", "dapo"]) == 2
  assert "--format 'dapo' is not one of dapo_math_17k" in capsys.readouterr().err


def test_kill_and_resume_across_an_epoch_boundary_matches_an_uninterrupted_run(setup, tmp_path):
  """6 train prompts, 2 per step: an epoch is 3 steps. 4 steps straight vs 3 (stopped exactly at
  the epoch boundary), then resumed into the second epoch."""
  straight = train(load_config(None, overrides(setup, tmp_path / "a", 4)))
  train(load_config(None, overrides(setup, tmp_path / "b", 3)))
  resumed = train(load_config(None, overrides(setup, tmp_path / "b", 4)))
  a, b = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
  assert [r["step"] for r in b] == list(range(1, 5))
  for ra, rb in zip(a, b):
    for key in ra:
      if key not in VOLATILE:
        assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), (ra["step"], key)
  assert straight["loss"] == pytest.approx(resumed["loss"], rel=1e-6, abs=1e-9)


def test_bad_inputs_give_one_line_errors(setup, tmp_path, capsys):
  assert cli.main(["train", *overrides(setup, tmp_path / "r", 1, "learner.lrr=1")]) == 2
  assert "lrr" in capsys.readouterr().err
  root, model_dir, data = setup
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"question": "what", "answer": ""}) + "\n")
  args = overrides(setup, tmp_path / "r", 1) + [f"data.train_path={bad}", "data.val_size=0"]
  assert cli.main(["train", *args]) == 2
  assert "row 0: field 'answer'" in capsys.readouterr().err
  args = overrides(setup, tmp_path / "r", 1) + [f"data.train_path={tmp_path / 'missing.jsonl'}"]
  assert cli.main(["train", *args]) == 2
  assert "no such file" in capsys.readouterr().err


def test_pass_rate_filter_bounds():
  from rft_jax.data import MathExample
  from rft_jax.data.filter import pass_rate_filter

  problems = [MathExample(f"q{i}", "1", str(i)) for i in range(4)]
  correct = np.zeros((4, 16), bool)
  correct[1, :1] = True   # 1/16: dropped (<= low)
  correct[2, :8] = True   # 8/16: kept
  correct[3, :15] = True  # 15/16: dropped (>= high)
  kept, rates = pass_rate_filter(problems, correct)
  assert [p.id for p in kept] == ["2"] and rates.tolist() == [0, 1 / 16, 0.5, 15 / 16]
  with pytest.raises(ValueError, match="low < high"):
    pass_rate_filter(problems, correct, low=0.9, high=0.1)


def test_eval_and_filter_commands_on_an_hf_directory(setup, tmp_path, capsys):
  root, model_dir, data = setup
  common = ["--model", str(model_dir), "--data", str(data), "--k", "2", "--max-new-tokens", "4"]
  assert cli.main(["eval", *common, "--histogram", str(tmp_path / "hist.png")]) == 0
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert 0 <= summary["avg@2"] <= summary["pass@2"] <= 1 and summary["problems"] == len(QUESTIONS)
  assert (tmp_path / "hist.png").stat().st_size > 1000
  assert cli.main(["filter", *common, "--out", str(tmp_path / "filtered")]) == 0
  rates = [json.loads(l) for l in (tmp_path / "filtered" / "pass_rates.jsonl").read_text().splitlines()]
  assert len(rates) == len(QUESTIONS) and all(r["pass_rate"] in (0.0, 0.5, 1.0) for r in rates)
  kept = (tmp_path / "filtered" / "kept.jsonl").read_text().splitlines()
  assert len(kept) == sum(r["pass_rate"] == 0.5 for r in rates)


def test_dynamic_sampling_refills_and_still_fills_the_batch(setup, tmp_path):
  """An untrained model scores 0 everywhere: every group has zero variance, so each step
  refills up to max_refills and then trains on the flat groups it has (advantages 0)."""
  metrics = train(load_config(None, overrides(setup, tmp_path / "d", 1, "dynamic_sampling=true",
                                              "max_refills=2", "eval.every=0")))
  assert metrics["refills"] == 2.0 and metrics["zero_variance_group_frac"] == 1.0
  assert metrics["response_tokens"] > 0


def test_answer_entropy_equals_a_full_forward_in_any_block_size():
  import jax.numpy as jnp

  from rft_jax.rl.learner import learner_batch
  from rft_jax.sampling import SamplingParams, generate
  from rft_jax.train.evaluate import answer_entropy
  from test_learner import tiny_model

  model = tiny_model()
  rollouts = generate(model, [[1, 2, 3], [4, 5], [6]], SamplingParams(n=3, max_new_tokens=6), seed=0)
  batch = learner_batch(rollouts)
  total, count = answer_entropy(model, batch, 0.7, rows=4)  # 9 answers: blocks of 4, 4, 1 (+3 padding)
  z = np.asarray(model(jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask)),
                 np.float64)[:, :-1] / 0.7
  logp = z - np.logaddexp.reduce(z, axis=-1, keepdims=True)
  entropy = -(np.exp(logp) * logp).sum(-1)
  mask = batch.response_mask[:, 1:]
  assert count == mask.sum() == rollouts.completion_lengths.sum()
  np.testing.assert_allclose(total, (entropy * mask).sum(), rtol=1e-5)
  np.testing.assert_allclose(answer_entropy(model, batch, 0.7, rows=16), (total, count), rtol=1e-6)


def test_running_mean_of_the_plots():
  from rft_jax.analysis.plots import running_mean
  np.testing.assert_allclose(running_mean([1, 3, 5, 7], 2), [1, 2, 4, 6])
  np.testing.assert_allclose(running_mean([1, 3, 5, 7], 1), [1, 3, 5, 7])
  np.testing.assert_allclose(running_mean([2, 4], 10), [2, 3])


def test_forecast_correlation_pairs_forecast_and_measured_of_the_same_step():
  from rft_jax.analysis.plots import forecast_correlation
  rng = np.random.default_rng(0)
  forecast = rng.normal(size=20)
  records = [{"step": i, "entropy/forecast": f, "entropy/measured": 1e4 * f + 0.1 * rng.normal()}
             for i, f in enumerate(forecast)]
  records += [{"step": 3, "eval/val/avg@2": 0.5}, {"step": 20, "entropy/forecast": 1.0}]  # unpaired
  assert forecast_correlation(records) > 0.99  # scale-free: 1e4 apart, still r ~ 1
  flipped = [{**r, "entropy/measured": -r["entropy/measured"]} for r in records[:20]]
  assert forecast_correlation(flipped) < -0.99
  assert np.isnan(forecast_correlation(records[:2]))
  assert np.isnan(forecast_correlation([{**r, "entropy/forecast": 0.0} for r in records[:5]]))


def test_steps_after_the_first_compile_nothing_new(setup, tmp_path, monkeypatch):
  """No silent recompiles: with prompts of one length, steps 0 and 1 compile every program a step
  needs (sampler, rewards' bookkeeping, learner, forecast on even steps, metrics); steps 2-4
  compile none (the final checkpoint's programs come after them)."""
  import jax

  from rft_jax.train import loop

  same_length = tmp_path / "same.jsonl"
  same_length.write_text("".join(json.dumps({"question": "what is 1+1 ?", "answer": str(i % 3)}) + "\n"
                                 for i in range(8)))
  compiles, after_step = [], {}
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, _, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
  step_fn = loop.train_step

  def counted(run, state, step, *args, **kwargs):
    out = step_fn(run, state, step, *args, **kwargs)
    after_step[step] = len(compiles)
    return out

  monkeypatch.setattr(loop, "train_step", counted)
  jax.clear_caches()
  start = len(compiles)
  train(load_config(None, overrides(setup, tmp_path / "run", 5, f"data.train_path={same_length}",
                                    "eval.every=0", "checkpoint_every=0", "data.val_size=0")), resume=False)
  assert sorted(after_step) == [0, 1, 2, 3, 4]
  assert after_step[0] > start and after_step[4] == after_step[1], (start, after_step)


def test_a_run_with_a_kl_penalty_logs_kl_from_zero(setup, tmp_path):
  """kl_coef > 0: the learner's reference is the starting policy (or model.ref_path): KL is 0
  on the first, on-policy step and grows as the policy moves."""
  cfg = load_config(None, overrides(setup, tmp_path / "kl", 3, "eval.every=0", "learner.kl_coef=0.1",
                                    "learner.optim.lr=3e-2", "learner.ref_dtype=bfloat16"))
  train(cfg)
  kl = [r["actor/kl"] for r in read_metrics(str(tmp_path / "kl"))]
  assert abs(kl[0]) < 1e-3 and kl[-1] > 1e-3, kl
  cfg = load_config(None, overrides(setup, tmp_path / "ref", 1, "eval.every=0", "learner.kl_coef=0.1",
                                    f"model.ref_path={setup[1]}"))
  assert np.isfinite(train(cfg)["kl"])
