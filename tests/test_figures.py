"""``rft-jax figures``: the runs it plans, the verdicts on the paper's claims, and its page in a browser.

The verdicts and the page are checked on runs written here (the training itself is the loop's,
tested in test_train_loop.py and test_demo.py); the page is opened in headless Chromium.
"""

import dataclasses
import html
import json
import os

import numpy as np
import pytest

from browser import open_page, problems
from rft_jax.analysis.attribution import Completion, attribution_html
from rft_jax.cli import main
from rft_jax.data import MathExample
from rft_jax.demo.paths import load_demo_config
from rft_jax.figures import FULL, QUICK, claims, draw
from rft_jax.figures.claims import HELD, NOT_HELD, UNCLEAR
from rft_jax.figures.page import FigureSection, write_page
from rft_jax.figures.results import RunResult, load_run
from rft_jax.figures.runs import finished, method_run, planned_runs, run_all, run_config, run_overrides, sign_run
from rft_jax.train.config import to_yaml


def result(name="r", *, entropy=0.02, frac=0.0, s_star=1e-2, centered=1e-5, forecast=-1e-8, lr=1e-4, steps=6,
           correct=None, avg=0.9, passed=0.95, start=None) -> RunResult:
  records = [{"step": i, "actor/entropy": entropy + 1e-4 * i, "mask/frac": frac, "entropy/s_star_mean": s_star,
              "entropy/s_centered_mean": centered, "entropy/forecast": forecast, "actor/lr": lr} for i in range(steps)]
  correct = np.ones((8, 4), bool) if correct is None else correct
  return RunResult(name, records, start, {"avg": avg, "pass": passed, "entropy": entropy}, correct)


def sign_results(base: float, scale: float) -> dict:
  """The eight Figure 1 runs: in each panel the S_* > 0 run ``scale`` from the S_* < 0 run, on
  the expected side."""
  return {(action, samples, sign): result(entropy=base + (0.5 if sign == "pos" else -0.5) * expected * scale)
          for (action, samples), expected in claims.SIGN_EXPECTED.items() for sign in ("pos", "neg")}


def test_sign_mask_verdicts_follow_the_expected_directions():
  grpo = result(entropy=0.018)
  verdict, panels = claims.sign_masks(sign_results(0.02, 0.003), grpo, 0.025, noise=0.001)
  assert verdict.status == HELD and set(panels.values()) == {HELD} and len(panels) == 4
  runs = sign_results(0.02, 0.003)
  runs[("drop", "neg", "pos")] = result(entropy=0.0215 + 0.003)  # above the S* < 0 run: the wrong side
  verdict, panels = claims.sign_masks(runs, grpo, 0.025, noise=0.001)
  assert verdict.status == NOT_HELD and panels[("drop", "neg")] == NOT_HELD and panels[("only", "pos")] == HELD
  verdict, _ = claims.sign_masks(sign_results(0.02, 0.0005), grpo, 0.025, noise=0.001)
  assert verdict.status == UNCLEAR  # every difference within the noise
  sentence = claims.sign_masks(sign_results(0.02, 0.003), grpo, 0.025, 0.001)[0].sentence
  assert "only positive samples: S*>0 -0.0030 against S*<0 (held; against the start: S*>0 -0.0065" in sentence


def test_cut_size_verdict_needs_fewer_masked_tokens_and_a_further_fall():
  def by_mu(fracs, entropies):
    return {"clip_b": {mu: result(frac=f, entropy=e) for mu, f, e in zip((1.0, 2.5, 4.0), fracs, entropies)}}

  assert claims.cut_sizes(by_mu((0.02, 0.01, 0.005), (0.025, 0.022, 0.020)), 0.001).status == HELD
  assert claims.cut_sizes(by_mu((0.02, 0.02, 0.005), (0.025, 0.022, 0.020)), 0.001).status == NOT_HELD
  assert claims.cut_sizes(by_mu((0.02, 0.01, 0.005), (0.020, 0.022, 0.025)), 0.001).status == NOT_HELD
  assert claims.cut_sizes(by_mu((0.02, 0.01, 0.005), (0.0205, 0.020, 0.020)), 0.001).status == UNCLEAR


def test_centered_scale_thresholds():
  assert claims.centered_scale([result(s_star=1e-2, centered=-5e-5)]).status == HELD
  assert claims.centered_scale([result(s_star=1e-2, centered=5e-4)]).status == UNCLEAR
  assert claims.centered_scale([result(s_star=1e-2, centered=2e-3)]).status == NOT_HELD
  assert "5.0e-03" in claims.centered_scale([result(s_star=1e-2, centered=-5e-5)]).sentence


def test_pass_rate_spread_is_a_paired_sign_test():
  grpo = np.ones((20, 4), bool)  # every problem all solved
  clip_b = grpo.copy()
  clip_b[:9, 0] = False  # 9 problems no longer extreme under Clip_B
  clip_b[9, :] = False  # one all failed: still extreme
  verdict = claims.pass_rate_spread([result(correct=grpo)], [result(correct=clip_b)])
  assert verdict.status == HELD and "z = +3.0" in verdict.sentence and "Clip_B 10 / 1" in verdict.sentence
  assert claims.pass_rate_spread([result(correct=clip_b)], [result(correct=grpo)]).status == NOT_HELD
  assert claims.pass_rate_spread([result(correct=grpo)], [result(correct=grpo)]).status == UNCLEAR


def test_negative_covariance_divides_the_forecast_by_each_steps_lr():
  run = result(forecast=-2e-8, lr=1e-4)
  run.steps[3]["entropy/forecast"], run.steps[3]["actor/lr"] = 1e-9, 1e-5
  steps, values = claims.minus_covariance(run)
  np.testing.assert_allclose(values, [-2e-4, -2e-4, -2e-4, 1e-4, -2e-4, -2e-4])
  assert claims.negative_covariance([run]).status == HELD
  flipped = result(forecast=2e-8)
  flipped.steps[0]["entropy/forecast"] = -1e-7
  assert claims.negative_covariance([flipped]).status == UNCLEAR  # mostly positive, larger when negative
  assert claims.negative_covariance([result(forecast=2e-8)]).status == NOT_HELD


def test_table1_intervals_over_seeds_and_paired_differences():
  groups = {"grpo": [result(avg=a, passed=0.9) for a in (0.90, 0.92, 0.94)],
            "clip_b": [result(avg=a, passed=0.9) for a in (0.93, 0.95, 0.97)]}
  verdict, rows = claims.table1(groups)
  mean, half = rows[0]["avg"]
  assert mean == pytest.approx(0.92) and half == pytest.approx(4.302652729911275 * 0.02 / np.sqrt(3))
  assert rows[1]["avg_diff"] == pytest.approx((0.03, 0.0), abs=1e-12)  # paired: the same gain every seed
  assert rows[1]["pass_diff"] == pytest.approx((0.0, 0.0))
  assert verdict.status == UNCLEAR  # Avg@K above GRPO, Pass@K level
  groups["clip_b"] = [result(avg=a, passed=0.95) for a in (0.93, 0.95, 0.97)]
  assert claims.table1(groups)[0].status == HELD
  assert np.isnan(claims.table1({"grpo": groups["grpo"][:1], "clip_b": groups["clip_b"][:1]})[1][0]["avg"][1])


def test_entropy_noise_is_twice_the_pooled_seed_deviation():
  groups = {"grpo": [result(entropy=e) for e in (0.020, 0.022)], "clip_b": [result(entropy=e) for e in (0.030, 0.026)]}
  assert claims.entropy_noise(groups) == pytest.approx(2 * np.sqrt((2 * 0.001**2 + 2 * 0.002**2) / 2))
  assert np.isnan(claims.entropy_noise({"grpo": [result()]}))


def _write_run(run_dir, steps=3, first=1):
  """A run's metrics.jsonl and eval_completions.jsonl as the loop writes them: the start's
  evaluation as step ``first - 1``, the steps from ``first`` (1 today; 0 in runs written before
  rft_jax.train.step_numbers), the final evaluation in the last step's record."""
  os.makedirs(run_dir, exist_ok=True)
  final = {"eval/heldout/avg@2": 0.75, "eval/heldout/pass@2": 1.0, "eval/heldout/entropy": 0.025}
  last = first + steps - 1
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": first - 1, "eval/heldout/avg@2": 0.5, "eval/heldout/pass@2": 0.75,
                        "eval/heldout/entropy": 0.03}) + "\n")
    for step in range(first, last + 1):
      f.write(json.dumps({"step": step, "actor/entropy": 0.02, "train/accuracy": 0.8,
                          **(final if step == last else {})}) + "\n")
  with open(os.path.join(run_dir, "eval_completions.jsonl"), "w") as f:
    for step, rows in ((first - 1, [(0, 0, False), (0, 1, True)]), (last, [(0, 0, True), (0, 1, True), (1, 0, False),
                                                                           (1, 1, True)])):
      f.writelines(json.dumps({"step": step, "problem": p, "sample": s, "correct": c}) + "\n" for p, s, c in rows)


@pytest.mark.parametrize("first", [1, 0], ids=["today", "counted-from-0"])
def test_load_run_reads_the_final_evaluation(tmp_path, first):
  _write_run(tmp_path / "grpo_s0", first=first)
  run = load_run(str(tmp_path / "grpo_s0"))
  assert run.name == "grpo_s0" and [r["step"] for r in run.steps] == [1, 2, 3]
  assert run.start == {"avg": 0.5, "pass": 0.75, "entropy": 0.03}
  assert run.final == {"avg": 0.75, "pass": 1.0, "entropy": 0.025}
  np.testing.assert_array_equal(run.correct, [[True, True], [False, True]])
  os.remove(tmp_path / "grpo_s0" / "eval_completions.jsonl")
  with pytest.raises(ValueError, match="eval_completions.jsonl: no answers of the evaluation at step 3"):
    load_run(str(tmp_path / "grpo_s0"))


@pytest.mark.parametrize("settings", [QUICK, FULL], ids=["quick", "full"])
def test_planned_runs_are_valid_demo_configs(tmp_path, settings):
  runs = planned_runs(settings)
  names = [r.name for r in runs]
  assert len(names) == len(set(names)) and names[0] == "grpo_s0"
  assert sum(r.name.startswith("sign_") for r in runs) == 8
  assert len(runs) == 3 * settings.seeds + len(settings.clip_b_mus) + len(settings.clip_v_mus) - 2 + 8
  for run in runs if settings == QUICK else runs[:1]:  # the full set differs in seeds, cuts and length only
    cfg = load_demo_config(None, run_overrides(run, settings, str(tmp_path), str(tmp_path / "train.jsonl")))
    assert cfg.steps == settings.steps and cfg.seed == run.seed and cfg.eval.every == settings.steps
    assert cfg.eval.at_start == (run.name == "grpo_s0")
  only = load_demo_config(None, run_overrides(sign_run("only", "neg", "pos"), settings, str(tmp_path), "t.jsonl"))
  mask = only.learner.entropy_mask
  assert (mask.kind, mask.action, mask.samples, mask.sign) == ("sign", "only", "negative", "positive")


def test_a_finished_run_is_reused_only_with_the_same_config(tmp_path):
  run, out = method_run("clip_b", 1), str(tmp_path)
  paths = (str(tmp_path / "train.jsonl"), str(tmp_path / "heldout.jsonl"))
  cfg = run_config(run, QUICK, out, *paths)
  _write_run(cfg.run_dir, steps=QUICK.steps)
  assert not finished(cfg)  # no config.yaml: not this run
  with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
    f.write(to_yaml(cfg))
  assert finished(cfg)
  assert not finished(run_config(run, dataclasses.replace(QUICK, steps=20), out, *paths))
  assert not finished(run_config(run, QUICK, out, *paths, overrides=["learner.optim.lr=1e-4"]))
  assert not finished(run_config(run, QUICK, out, paths[0], str(tmp_path / "other.jsonl")))
  with open(tmp_path / "runs" / "runs.json", "w") as f:
    json.dump({run.name: {"seconds": 12.5}}, f)
  done = run_all([run], QUICK, out, *paths)  # nothing to train: no worker starts
  assert done[run.name]["reused"] and done[run.name]["seconds"] == 12.5
  assert json.load(open(tmp_path / "runs" / "runs.json"))[run.name]["seconds"] == 12.5
  _write_run(cfg.run_dir, steps=QUICK.steps - 1)  # stopped before its last step and evaluation
  assert not finished(cfg)


def test_bad_figure_options_are_named(capsys):
  assert main(["figures", "--seeds", "0"]) == 2
  assert "--seeds must be >= 1, got 0" in capsys.readouterr().err


def _completion(question: str) -> Completion:
  n = 5
  rng = np.random.default_rng(len(question))
  return Completion(problem=MathExample(question=question, answer="3", id="1+2"), tokens=list("1+2=3"),
                    classes=["operand digit", "separator", "operand digit", "separator", "sum digit"],
                    advantage=0.5, reward=1.0, p=rng.uniform(0.5, 1, n), entropy=rng.uniform(0, 0.1, n),
                    s_star=rng.normal(0, 1e-2, n), expected_s=rng.normal(0, 1e-4, n), forecast=rng.normal(0, 1e-6, n),
                    masked=np.array([False, False, True, False, False]))


def test_the_page_shows_every_figure_in_a_browser(tmp_path):
  """Figures drawn from runs with the claims' shapes; the page loads in Chromium without an
  error, every image is shown, and every verdict is on it."""
  grpo = [result(f"grpo_s{i}", entropy=0.018 + 1e-4 * i, correct=np.eye(8, 4, dtype=bool) | (i > 0),
                 start={"avg": 0.85, "pass": 0.95, "entropy": 0.025}) for i in range(2)]
  clip_b = [result(f"clip_b_s{i}", entropy=0.021, frac=0.004, correct=np.eye(8, 4, k=i, dtype=bool)) for i in range(2)]
  groups = {"grpo": grpo, "clip_b": clip_b, "clip_v": [result(f"clip_v_s{i}", entropy=0.022) for i in range(2)]}
  sign_runs = sign_results(0.02, 0.003)
  by_mu = {"clip_b": {1.0: result(frac=0.01, entropy=0.024), 2.5: clip_b[0]}}
  fig1, panels = claims.sign_masks(sign_runs, grpo[0], 0.025, 0.001)
  out = str(tmp_path)
  sections = [
      FigureSection("Figure 1", "Sign masks", "claim 1", fig1, draw.figure1(f"{out}/fig1.png", sign_runs, grpo[0], panels),
                    ["sign_only_pos_spos"]),
      FigureSection("Figure 2", "Cuts", "claim 2", claims.cut_sizes(by_mu, 0.001),
                    draw.figure2(f"{out}/fig2.png", by_mu, grpo[0]), ["clip_b_mu1"]),
      FigureSection("Figure 3", "Scale", "claim 3", claims.centered_scale(grpo), draw.figure3(f"{out}/fig3.png", grpo),
                    ["grpo_s0"]),
      FigureSection("Figure 4", "Pass rates", "claim 4", claims.pass_rate_spread(grpo, clip_b),
                    draw.figure4(f"{out}/fig4.png", grpo, clip_b), ["grpo_s0"]),
      FigureSection("Figure 5", "Covariance", "claim 5", claims.negative_covariance(grpo),
                    draw.figure5(f"{out}/fig5.png", grpo), ["grpo_s0"]),
  ]
  runs = {"grpo_s0": {"overrides": ["seed=0"], "seconds": 42.0, "reused": False},
          "clip_b_s0": {"overrides": ["learner.entropy_mask.kind=clip_b"], "seconds": 37.0, "reused": True}}
  attribution = [("start", [_completion("What is 1 + 2?")]), ("grpo_s0 after 12 steps", [_completion("What is 2 + 1?")])]
  path = write_page(out, sections=sections, table=claims.table1(groups), runs=runs, settings=QUICK,
                    start=grpo[0].start, noise=0.001, attribution=attribution, k=4,
                    command="rft-jax figures --quick", seconds=95.0)
  with open(tmp_path / "attribution.html", "w") as f:  # what make_figures writes beside the page
    f.write(attribution_html(attribution, "Clip_B"))
  assert problems(open_page(str(tmp_path / "attribution.html"))) == []
  report = open_page(path, screenshot=str(tmp_path / "page.png"))
  assert problems(report) == []
  assert [src for src, _ in report["images"]] == [f"fig{i}.png" for i in range(1, 6)]
  assert all(width >= 600 for _, width in report["images"])
  assert report["sections"] == ["figure1", "figure2", "figure3", "figure4", "figure5", "table1", "attribution", "runs"]
  text = open(path).read()
  for s in sections:
    assert html.escape(s.verdict.sentence) in text
  assert "rft-jax figures --quick" in text and "37 s (reused)" in text and "sum digit" in text
  assert os.path.getsize(tmp_path / "page.png") > 50_000
