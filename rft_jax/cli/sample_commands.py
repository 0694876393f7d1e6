"""``rft-jax eval``, ``attribute`` and ``filter``: the commands that sample answers to a data set's
questions from a policy (an HF directory or a run directory). Heavy imports happen inside them."""

from __future__ import annotations

import argparse

from rft_jax.cli.parser import add_mesh_option, mesh_from_option


def sampling_inputs(args: argparse.Namespace):
  """Loads the policy (HF directory or run directory: :func:`rft_jax.train.policy.load_policy`) and
  the questions.

  A run directory gives the defaults: its prompt (instruction, system prompt), data format,
  longest answer (``eval.max_new_tokens``, else ``sampling.max_new_tokens``) and reward; for an
  HF directory they are the training defaults. The command's options override either.

  Returns:
    ``(model, tokenizer, problems, sampling)``: ``sampling`` holds the keyword arguments of
    :func:`rft_jax.train.evaluate.evaluate` but ``k``, ``temperature`` and ``seed`` (``mesh``: the
    one a run's checkpoint was restored onto, None for an HF directory on one device), and
    ``config``, the run's config (None for an HF directory).
  """
  from rft_jax.data import FORMATS, load_math_dataset
  from rft_jax.parallel import mesh_of
  from rft_jax.train.config import ConfigError
  from rft_jax.train.policy import load_policy

  if args.format is not None and args.format not in FORMATS:
    raise ConfigError(f"--format {args.format!r} is not one of {', '.join(FORMATS)}")
  check_sampling_options(args)
  check_run_rewards(args.model)  # before the model loads: a reward that cannot import fails at once
  policy = load_policy(args.model, step=args.step, instruction=args.instruction,
                       system_prompt=args.system_prompt, mesh=mesh_from_option(args.mesh))
  cfg = policy.config
  max_new_tokens = (cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens) if cfg else 1024
  problems, _ = load_math_dataset(args.data, args.format or (policy.data.format if cfg else "jsonl"),
                                  on_bad_row="skip", extras_field=cfg.data.extras_field if cfg else None)
  sampling = dict(max_new_tokens=args.max_new_tokens or max_new_tokens, stop_ids=policy.stop_ids,
                  rewards=policy.rewards([p.question for p in problems]), prompt_fn=policy.prompt_ids,
                  config=cfg, mesh=mesh_of(policy.model), data=policy.data)
  return policy.model, policy.tokenizer, problems, sampling


def check_sampling_options(args: argparse.Namespace) -> None:
  """The sampling options of ``eval`` / ``filter`` / ``attribute``, checked before anything loads
  (a :class:`ConfigError`, exit 2)."""
  import math

  from rft_jax.train.config import ConfigError

  if args.k < 1:
    raise ConfigError(f"--k {args.k}: must be >= 1 (samples per question)")
  if not (math.isfinite(args.temperature) and args.temperature >= 0):
    raise ConfigError(f"--temperature {args.temperature}: must be a finite number >= 0 (0 is greedy)")
  if args.max_new_tokens is not None and args.max_new_tokens < 1:
    raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
  if getattr(args, "low", None) is not None and not 0 <= args.low < args.high <= 1:
    raise ConfigError(f"--low {args.low} --high {args.high}: need 0 <= low < high <= 1")
  if getattr(args, "problems", 1) < 1:
    raise ConfigError(f"--problems {args.problems}: must be >= 1")
  if getattr(args, "lr", None) is not None and not (math.isfinite(args.lr) and args.lr > 0):
    raise ConfigError(f"--lr {args.lr}: must be a finite number > 0")


def check_run_rewards(model: str) -> None:
  """A run directory's ``rewards.functions`` import here (else a :class:`ConfigError` with the
  ``PYTHONPATH`` to set, as at train time): checked before its model loads and samples."""
  import os

  from rft_jax.train.config import load_config
  from rft_jax.train.preflight import check_reward_functions

  config = os.path.join(model, "config.yaml")
  if not (os.path.isdir(os.path.join(model, "checkpoints")) and os.path.isfile(config)):
    return
  cfg = load_config(config)
  # Where the run's own module may be: the run directory's parents (runs/NAME under the project),
  # the training data's directory.
  near, parent = [], os.path.abspath(model)
  for _ in range(3):
    parent = os.path.dirname(parent)
    near.append(parent)
  if cfg.data.train_path:
    near.append(os.path.dirname(os.path.abspath(cfg.data.train_path)))
  check_reward_functions(cfg.rewards.functions, f"{config}: rewards.functions", near)


def sample_problems(args: argparse.Namespace, completions: bool = False):
  """:func:`sampling_inputs`, then ``k`` answers to each question."""
  from rft_jax.train.evaluate import evaluate

  from rft_jax.train.agent_round import agent_parts

  model, tokenizer, problems, sampling = sampling_inputs(args)
  cfg, data = sampling.pop("config"), sampling.pop("data")
  agent = agent_parts(cfg, tokenizer, sampling["stop_ids"]) if cfg else None
  try:  # a multi-turn run's answers are trajectories, with its environment
    result = evaluate(model, tokenizer, problems, k=args.k, temperature=args.temperature, seed=args.seed,
                      completions=completions, trajectories=None if agent is None else agent.sampler(
                          cfg, model, tokenizer, sampling["mesh"], data), **sampling)
  finally:
    if agent is not None:
      agent.close()
  return problems, result


def attribute_command(args: argparse.Namespace) -> int:
  import dataclasses

  from rft_jax.analysis.attribution import attribute, attribution_html, character_class
  from rft_jax.train.agent_round import agent_parts
  from rft_jax.rewards.user_functions import load_function
  from rft_jax.rl.config import EntropyMaskConfig
  from rft_jax.rl.token_methods import configured_class
  from rft_jax.train.config import ConfigError
  from rft_jax.train.output_paths import check_file

  check_file(args.out, "--out")
  try:
    classes = load_function(args.token_classes, "--token-classes") if args.token_classes else character_class
  except ValueError as exc:
    raise ConfigError(str(exc)) from None
  chosen = None
  if args.mask is not None:  # checked before anything loads
    try:
      chosen = EntropyMaskConfig(kind=args.mask)
    except ValueError as exc:
      raise ConfigError(f"--mask {args.mask!r}: {exc}") from None
  model, tokenizer, problems, sampling = sampling_inputs(args)
  cfg, data = sampling.pop("config"), sampling.pop("data")
  lr = args.lr if args.lr is not None else (cfg.learner.optim.lr if cfg else 1e-6)
  # The mask marked: --mask's, else the run's own; none for an HF directory or a run without one.
  mask = chosen or (cfg.learner.entropy_mask if cfg else EntropyMaskConfig(kind="none"))
  if mask.target_entropy is not None:  # the page marks a fixed cut
    mask = dataclasses.replace(mask, target_entropy=None)
  method = configured_class(mask, removes_tokens=True)
  agent = agent_parts(cfg, tokenizer, sampling["stop_ids"]) if cfg else None
  try:
    trajectories = None if agent is None else agent.sampler(cfg, model, tokenizer, sampling["mesh"], data)
    completions = attribute(model, tokenizer, problems[:args.problems], k=args.k,
                            temperature=args.temperature, seed=args.seed, lr=lr, mask=mask,
                            token_class=classes, trajectories=trajectories, **sampling)
  finally:
    if agent is not None:
      agent.close()
  name = method.title if method.chooses_tokens else None
  with open(args.out, "w") as f:
    f.write(attribution_html([(f"{args.model}: {args.problems} problems x {args.k} samples", completions)], name))
  print(args.out)
  return 0


def eval_command(args: argparse.Namespace) -> int:
  import json

  from rft_jax.train.output_paths import check_file

  for path, option in ((args.histogram, "--histogram"), (args.save_completions, "--save-completions")):
    if path:  # before anything loads: a file in the way is one line, not a traceback after sampling
      check_file(path, option)
  problems, result = sample_problems(args, completions=bool(args.save_completions))
  summary = {f"avg@{args.k}": result["avg"], f"pass@{args.k}": result["pass"], "problems": len(problems)}
  if args.save_completions:
    from rft_jax.train.metrics_log import JsonlFile

    out = JsonlFile(args.save_completions)
    out.write(result["completions"])
    out.close()
    summary["completions"] = args.save_completions
  print(json.dumps(summary))
  if args.histogram:
    from rft_jax.eval import plot_pass_rate_histogram
    plot_pass_rate_histogram(args.histogram, result["correct"])
  return 0



def filter_command(args: argparse.Namespace) -> int:
  from rft_jax.data.filter import pass_rate_filter, write_filtered
  from rft_jax.train.output_paths import check_directory

  check_directory(args.out, "--out")
  problems, result = sample_problems(args)
  kept, rates = pass_rate_filter(problems, result["correct"], low=args.low, high=args.high)
  kept_path, _ = write_filtered(args.out, problems, rates, kept)
  print(f"kept {len(kept)} of {len(problems)} questions (pass rate in ({args.low:.4f}, {args.high:.4f})) -> {kept_path}")
  return 0



def add_sampling_options(p: argparse.ArgumentParser, k: int, temperature: float) -> None:
  """The policy, data and sampling options of ``eval`` / ``attribute`` / ``filter``, with the
  command's default ``k`` and ``temperature``."""
  p.add_argument("--model", required=True, help="HF model directory or a run directory")
  p.add_argument("--step", type=int, help="checkpoint step of a run directory (default: latest)")
  p.add_argument("--data", required=True, help="questions: a local file or save_to_disk directory")
  p.add_argument("--format", help="dapo_math_17k, aime_2024, aime_2025 or jsonl (default: a run's "
                                  "data.format, else jsonl)")
  p.add_argument("--k", type=int, default=k, help="samples per question")
  p.add_argument("--temperature", type=float, default=temperature, help="sampling temperature")
  p.add_argument("--max-new-tokens", type=int, help="longest answer, in tokens (default: a run's "
                                                    "eval.max_new_tokens or sampling.max_new_tokens, else 1024)")
  p.add_argument("--seed", type=int, default=0, help="sampling seed")
  p.add_argument("--instruction", help="appended to every question (default: the run's data.instruction, "
                                       "or the training default for an HF directory; '' for none)")
  p.add_argument("--system-prompt", help="system message (default: the run's data.system_prompt)")
  add_mesh_option(p)


def add_eval_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax eval``."""
  evaluate = sub.add_parser("eval", help="Avg@K / Pass@K of a run's checkpoint or an HF directory")
  add_sampling_options(evaluate, 8, 0.7)
  evaluate.add_argument("--histogram", help="write the per-problem pass-rate histogram PNG here")
  evaluate.add_argument("--save-completions", metavar="PATH",
                        help="write every sampled answer with its score here (JSONL)")
  evaluate.set_defaults(func=eval_command)
  return evaluate


def add_attribute_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax attribute``."""
  attr = sub.add_parser("attribute", help="a page of sampled answers, each token coloured by its Theorem 2 "
                                          "forecast entropy change, and the forecasts by token class")
  add_sampling_options(attr, 4, 1.0)
  attr.add_argument("--problems", type=int, default=8, help="the first this many questions of --data")
  attr.add_argument("--lr", type=float, help="the step size of the forecast (default: the run's learner.optim.lr)")
  attr.add_argument("--token-classes", metavar="MODULE:FUNCTION",
                    help="token classes, e.g. rft_jax.demo.task:token_class (default: digit / separator / other)")
  attr.add_argument("--mask", metavar="KIND",
                    help="the entropy mask whose tokens are outlined: clip_b, clip_v, ... or none (default: "
                         "the run's learner.entropy_mask; none for an HF directory)")
  attr.add_argument("--out", default="attribution.html", help="the HTML page to write")
  attr.set_defaults(func=attribute_command)
  return attr


def add_filter_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax filter``."""
  filt = sub.add_parser("filter", help="drop questions with pass rate <= 1/16 or >= 15/16")
  add_sampling_options(filt, 16, 1.0)
  filt.add_argument("--low", type=float, default=1 / 16, help="drop pass rates at or below this")
  filt.add_argument("--high", type=float, default=15 / 16, help="drop pass rates at or above this")
  filt.add_argument("--out", required=True, help="directory for kept.jsonl and pass_rates.jsonl")
  filt.set_defaults(func=filter_command)
  return filt
