"""``rft-jax figures``: the paper's empirical claims, each seen happening on the demo's task.

Runs what the figures need (:mod:`rft_jax.figures.runs`, reusing finished runs), reads them back,
judges each claim (:mod:`rft_jax.figures.claims`), draws Figures 1-5 (:mod:`rft_jax.figures.draw`),
samples a few held-out answers before and after training for the token attribution
(:mod:`rft_jax.analysis.attribution`), and writes ``OUT/index.html`` (:mod:`rft_jax.figures.page`).
"""

from __future__ import annotations

import os
import re
import time
from typing import Sequence

from rft_jax.figures import claims, draw
from rft_jax.figures.page import FigureSection, write_page
from rft_jax.figures.results import load_run
from rft_jax.figures.runs import (
    SIGN_PANELS, SIGNS, FigureSettings, method_run, mu_run, planned_runs, run_all, sign_run)

ATTRIBUTION_PROBLEMS = 8


def hardest_problems(problems: Sequence, count: int) -> list:
  """The ``count`` held-out sums with the most carries (in file order among equals): after training
  the easy ones are answered right every time, a group with one reward, so every token's advantage
  and forecast is 0 there."""
  from rft_jax.demo.task import carrying_columns

  def carries(problem) -> int:
    operands = [int(x) for x in re.findall(r"\d+", problem.question)[:2]]  # "What is 83 + 86?"
    return len(carrying_columns(*operands)) if len(operands) == 2 else 0

  return sorted(problems, key=carries, reverse=True)[:count]


def make_figures(out_dir: str, settings: FigureSettings, overrides: Sequence[str] = (), *,
                 config_path: str | None = None, workers: int = 2, command: str = "rft-jax figures") -> str:
  """Runs (``workers`` at a time), judges and draws everything into ``out_dir``; returns the
  page's path."""
  from rft_jax.demo.run import write_demo_data

  began = time.time()
  out_dir = os.path.abspath(out_dir)
  train_path, heldout_path = write_demo_data(os.path.join(out_dir, "data"), heldout_size=settings.heldout)
  runs = run_all(planned_runs(settings), settings, out_dir, train_path, heldout_path, overrides, config_path,
                 workers)
  results = {name: load_run(info["dir"]) for name, info in runs.items()}
  seeds = range(settings.seeds)
  groups = {m: [results[method_run(m, s).name] for s in seeds] for m in ("grpo", "clip_b", "clip_v")}
  grpo = groups["grpo"][0]
  start_entropy = grpo.start["entropy"]
  noise = claims.entropy_noise(groups)
  sign_runs = {(a, samples, sign): results[sign_run(a, samples, sign).name]
               for a, samples in SIGN_PANELS for sign in SIGNS}
  by_mu = {"clip_b": {mu: results[mu_run("clip_b", mu).name] for mu in settings.clip_b_mus},
           "clip_v": {mu: results[mu_run("clip_v", mu).name] for mu in settings.clip_v_mus}}
  path = lambda name: os.path.join(out_dir, name)  # noqa: E731
  fig1_verdict, panels = claims.sign_masks(sign_runs, grpo, start_entropy, noise)
  table_verdict, table_rows = claims.table1(groups)
  sections = [
      FigureSection("Figure 1", "Sign masks on S*",
                    "On positive samples the S* > 0 tokens lower the entropy and the S* < 0 tokens raise it; on "
                    "negative samples the other way round (Theorem 1). So trained on the positive samples' S* > 0 "
                    "tokens alone, the policy ends with less entropy than trained on their S* < 0 tokens alone "
                    "(more on negative samples), and GRPO without the S* > 0 tokens ends with more than GRPO without "
                    "the S* < 0 tokens (less on negative samples).",
                    fig1_verdict, draw.figure1(path("fig1.png"), sign_runs, grpo, panels),
                    [r.name for r in sign_runs.values()] + [grpo.name]),
      FigureSection("Figure 2", "Clip_B and Clip_V at several cuts",
                    "A larger cut mu masks fewer tokens and lets the entropy fall further.",
                    claims.cut_sizes(by_mu, noise), draw.figure2(path("fig2.png"), by_mu, grpo),
                    [r.name for m in by_mu.values() for r in m.values()]),
      FigureSection("Figure 3", "S* against S* - E_p[S]",
                    "The batch mean of S* - E_p[S] is orders of magnitude smaller than that of S* (Corollary 2: "
                    "E_p[S_k - E_p[S]] = 0 at every position).",
                    claims.centered_scale(groups["grpo"]), draw.figure3(path("fig3.png"), groups["grpo"]),
                    [r.name for r in groups["grpo"]]),
      FigureSection("Figure 4", "Pass rates of the held-out problems",
                    "Clip_B leaves fewer held-out problems all solved or all failed than GRPO.",
                    claims.pass_rate_spread(groups["grpo"], groups["clip_b"]),
                    draw.figure4(path("fig4.png"), groups["grpo"], groups["clip_b"]),
                    [r.name for r in groups["grpo"] + groups["clip_b"]]),
      FigureSection("Figure 5", "The batch covariance of Corollary 4",
                    "-Cov_B(A, S* - E_p[S]), the first-order entropy change of a GRPO step per unit learning "
                    "rate, is mostly negative, and larger in magnitude when negative.",
                    claims.negative_covariance(groups["grpo"]), draw.figure5(path("fig5.png"), groups["grpo"]),
                    [r.name for r in groups["grpo"]]),
  ]
  attribution = _attribution(out_dir, [runs[method_run("grpo", 0).name]["dir"], runs[method_run("clip_b", 0).name]["dir"]],
                             heldout_path)
  return write_page(out_dir, sections=sections, table=(table_verdict, table_rows), runs=runs,
                    settings=settings, start=grpo.start, noise=noise, attribution=attribution,
                    k=grpo.correct.shape[1], command=command, seconds=time.time() - began)


def _attribution(out_dir: str, run_dirs: Sequence[str], heldout_path: str) -> list:
  """Writes ``OUT/attribution.html`` (the same held-out problems, those with the most carries,
  answered by the start and by each run after training, tokens coloured by their Theorem 2 forecast, Clip_B's cut marked) and
  returns its sections ``(title, completions)``."""
  from rft_jax.data import load_math_dataset
  from rft_jax.demo.task import token_class
  from rft_jax.rl.config import EntropyMaskConfig
  from rft_jax.analysis.attribution import attribute, attribution_html
  from rft_jax.parallel import mesh_of
  from rft_jax.train.policy import load_policy

  problems = hardest_problems(load_math_dataset(heldout_path, "jsonl")[0], ATTRIBUTION_PROBLEMS)
  policies = []  # (title, policy); one tokenizer, the first run's
  for run_dir in run_dirs:
    trained = load_policy(run_dir, tokenizer=policies[0][1].tokenizer if policies else None)
    if not policies:
      policies.append(("start (the demo's checkpoint)", load_policy(trained.config, tokenizer=trained.tokenizer)))
    policies.append((f"{os.path.basename(run_dir)} after {trained.step} steps", trained))
  sections = []
  for title, policy in policies:
    cfg = policy.config
    completions = attribute(
        policy.model, policy.tokenizer, problems, prompt_fn=policy.prompt_ids, k=4,
        temperature=cfg.sampling.temperature, max_new_tokens=cfg.sampling.max_new_tokens,
        stop_ids=policy.stop_ids, rewards=policy.rewards([p.question for p in problems]),
        lr=cfg.learner.optim.lr, mask=EntropyMaskConfig(kind="clip_b"), seed=0, token_class=token_class,
        mesh=mesh_of(policy.model))
    sections.append((title, completions))
  with open(os.path.join(out_dir, "attribution.html"), "w") as f:
    f.write(attribution_html(sections, "Clip_B"))
  return sections
