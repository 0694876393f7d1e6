"""``rft-jax train``, ``demo``, ``figures`` and ``sft``: the commands that train (a run, the demo's
runs, the figures' runs, supervised fine-tuning). Heavy imports happen inside the commands."""

from __future__ import annotations

import argparse

from rft_jax.cli.parser import train_epilog
from rft_jax.demo.methods import DEFAULT_VARIANTS, METHODS as DEMO_VARIANTS  # os only: --help stays instant
from rft_jax.demo.paths import DEFAULT_CONFIG as DEMO_CONFIG


def train_command(args: argparse.Namespace) -> int:
  if args.print_config or args.dry_run:
    return check_config(args)
  from rft_jax.parallel.multihost import initialize_from_env
  from rft_jax.train.config import load_config
  from rft_jax.train.loop import train

  initialize_from_env()
  cfg = load_config(args.config, args.overrides)
  metrics = train(cfg, resume=not (args.no_resume or args.overwrite), overwrite=args.overwrite,
                  allow_config_change=args.allow_config_change)
  print(outcome(cfg, metrics))
  return 0


def outcome(cfg, metrics: dict[str, float]) -> str:
  """The one line that ends ``rft-jax train``: the steps done, or why none ran (``metrics``:
  :func:`rft_jax.train.loop.train`'s)."""
  done = metrics["steps_done"]
  if "reward_mean" not in metrics and done >= cfg.steps:  # a rerun of a finished run
    return (f"{cfg.run_dir} already holds {done} steps (steps={cfg.steps}): nothing to do; set steps above "
            f"{done} to train on, or pass --overwrite to start over")
  what = (f"finished {done} steps" if done >= cfg.steps else
          f"stopped after {done} of {cfg.steps} steps (the training data ran out)")
  if "reward_mean" not in metrics:  # the data had run out already: no step ran, nothing to report
    return f"{what} in {cfg.run_dir}: nothing left to do (its latest checkpoint is of step {done})"
  return (f"{what} in {cfg.run_dir}: reward {metrics['reward_mean']:.3f}, "
          f"entropy {metrics.get('entropy', float('nan')):.3f}")


def check_config(args: argparse.Namespace) -> int:
  """``train --print-config`` / ``--dry-run``: the effective config (YAML), and / or every check
  that needs no model loaded (:func:`rft_jax.train.preflight.validate_for_training`); the run
  directory is not touched."""
  from rft_jax.train.config import load_config, to_yaml

  # Printing alone shows an incomplete config too (model.path unset); a dry run needs all of it.
  cfg = load_config(args.config, args.overrides, **({} if args.dry_run else {"required": ()}))
  if args.print_config:
    print(to_yaml(cfg), end="")
  if args.dry_run:
    import jax

    from rft_jax.parallel.multihost import initialize_from_env
    from rft_jax.train.preflight import data_parallel_devices, validate_for_training

    initialize_from_env()  # the device count of the run: every host's
    n_devices = jax.device_count()
    validate_for_training(cfg, n_devices)
    print(f"config OK: model {cfg.model.path}, data {cfg.data.train_path}, {n_devices} devices "
          f"({data_parallel_devices(cfg, n_devices)} data-parallel), {cfg.steps} steps of "
          f"{cfg.data.prompts_per_step} prompts x {cfg.sampling.n} samples into {cfg.run_dir}")
  return 0



def demo_command(args: argparse.Namespace) -> int:
  from rft_jax.demo.run import run_demo, split_variants
  from rft_jax.train.config import ConfigError

  try:
    variants, overrides = split_variants(args.overrides)
  except ValueError as exc:  # an unknown variant: invalid input, exit 2
    raise ConfigError(str(exc)) from None
  run_demo(args.config, overrides, variants, overwrite=args.overwrite, allow_config_change=args.allow_config_change)
  return 0


def figures_command(args: argparse.Namespace) -> int:
  import dataclasses
  import shlex
  import sys

  from rft_jax.figures import FULL, QUICK, make_figures
  from rft_jax.train.config import ConfigError

  for name in ("seeds", "steps", "heldout", "workers"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise ConfigError(f"--{name} must be >= 1, got {getattr(args, name)}")
  chosen = {name: getattr(args, name) for name in ("seeds", "steps", "heldout") if getattr(args, name) is not None}
  settings = dataclasses.replace(QUICK if args.quick else FULL, **chosen)
  page = make_figures(args.out, settings, args.overrides, config_path=args.config, workers=args.workers,
                      command=" ".join(["rft-jax", *map(shlex.quote, sys.argv[1:])]))
  print(f"the figures page: {page}")
  return 0



def sft_command(args: argparse.Namespace) -> int:
  import time

  from rft_jax.train.sft import SFTConfig, sft_files

  config = SFTConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                     warmup_steps=args.warmup_steps, max_len=args.max_len, seed=args.seed)
  start = time.time()

  def log(step: int, loss: float) -> None:
    if step == 1 or step % args.log_every == 0 or step == config.steps:
      print(f"sft step {step:5d}  loss {loss:.4f}  ({time.time() - start:.0f} s)", flush=True)

  from rft_jax.data.config import DataConfig

  prompt = DataConfig(system_prompt=args.system_prompt, chat_template=args.chat_template,
                      **({} if args.instruction is None else {"instruction": args.instruction}))
  sft_files(args.model, args.data, args.out, config, question_field=args.question_field,
            response_field=args.response_field, log=log, prompt=prompt)
  print(f"saved {args.out}")
  return 0


def add_loudness_options(command: argparse.ArgumentParser) -> None:
  """``--quiet`` / ``--verbose``: the status lines of a command that runs training."""
  loudness = command.add_mutually_exclusive_group()
  loudness.add_argument("--quiet", action="count", default=0, help="status lines: warnings only")
  loudness.add_argument("--verbose", action="count", default=0, help="status lines: debug too")


def add_train_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax train``."""
  train = sub.add_parser("train", help="run (or resume) a training run", epilog=train_epilog)
  train.add_argument("--config", help="YAML config (see configs/)")
  train.add_argument("--print-config", action="store_true",
                     help="print the effective config (YAML: defaults filled in, paths absolute) and exit")
  train.add_argument("--dry-run", action="store_true",
                     help="check the config, model directory, data and devices without loading the model "
                          "or touching RUN_DIR, and exit (0: 'config OK')")
  train.add_argument("--no-resume", action="store_true",
                     help="start a new run (refused if RUN_DIR holds an earlier run's checkpoints or metrics)")
  train.add_argument("--overwrite", action="store_true",
                     help="start a new run, deleting RUN_DIR's checkpoints, metrics and TensorBoard events")
  train.add_argument("--allow-config-change", action="store_true",
                     help="resume although the config differs from RUN_DIR/config.yaml in what the run computes")
  train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.optim.lr=1e-6")
  train.set_defaults(func=train_command)
  add_loudness_options(train)
  return train


def add_demo_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax demo``."""
  demo = sub.add_parser("demo", help="GRPO vs Clip_B vs Clip_V (or other methods: variants=...) on the "
                                     "embedded synthetic task")
  demo.add_argument("--config", default=DEMO_CONFIG, help="YAML config; its relative model.path is "
                    "read against the directory holding the rft_jax package (the repository root in a checkout)")
  demo.add_argument("--overwrite", action="store_true",
                    help="train the variants from the start, deleting their earlier runs (without it, a "
                         "finished variant is not trained again and an interrupted one resumes)")
  demo.add_argument("--allow-config-change", action="store_true",
                    help="resume the variants although the config differs from their config.yaml in what "
                         "the runs compute")
  demo.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. steps=10; "
                    f"variants=a,b,... picks the runs (default {','.join(DEFAULT_VARIANTS)}) among "
                    f"{', '.join(DEMO_VARIANTS)}")
  demo.set_defaults(func=demo_command)
  add_loudness_options(demo)
  return demo


def add_figures_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax figures``."""
  figures = sub.add_parser("figures", help="the paper's Figures 1-5 and Table 1 on the embedded task, with "
                                          "whether each claim held, as a static page OUT/index.html")
  figures.add_argument("--quick", action="store_true", help="fewer steps, seeds and cuts (under 10 minutes "
                                                            "on 2 cores)")
  figures.add_argument("--out", default="runs/figures", help="output directory; finished runs there are reused")
  figures.add_argument("--seeds", type=int, help="seeds of GRPO / Clip_B / Clip_V (default 3; --quick 2)")
  figures.add_argument("--steps", type=int, help="training steps of every run (default 60; --quick 12)")
  figures.add_argument("--heldout", type=int, help="held-out problems evaluated (default 256; --quick 64)")
  figures.add_argument("--workers", type=int, default=2, help="runs trained at a time, each in its own "
                                                              "process (one run keeps about one core busy)")
  figures.add_argument("--config", default=DEMO_CONFIG, help="YAML config; its relative model.path is "
                                                              "read against the repository root")
  figures.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. learner.optim.lr=1e-4")
  figures.set_defaults(func=figures_command)
  add_loudness_options(figures)
  return figures


def add_sft_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax sft``."""
  sft_parser = sub.add_parser("sft", help="supervised fine-tuning on question/response pairs")
  sft_parser.add_argument("--model", required=True, help="HF model directory to start from")
  sft_parser.add_argument("--data", required=True, help="JSONL/parquet of question/response rows")
  sft_parser.add_argument("--out", required=True, help="HF directory to write")
  sft_parser.add_argument("--question-field", default="question", help="column of the questions")
  sft_parser.add_argument("--response-field", default="response", help="column of the target responses")
  sft_parser.add_argument("--steps", type=int, default=1000, help="optimizer steps")
  sft_parser.add_argument("--batch-size", type=int, default=64, help="pairs per step")
  sft_parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
  sft_parser.add_argument("--warmup-steps", type=int, default=50, help="linear warm-up steps")
  sft_parser.add_argument("--max-len", type=int, default=96, help="longest pair, in tokens")
  sft_parser.add_argument("--seed", type=int, default=0, help="data order and initialisation seed")
  sft_parser.add_argument("--instruction", help="appended to every question, as data.instruction of a "
                                                "training run (default: the training default; '' for none)")
  sft_parser.add_argument("--system-prompt", help="system message, as data.system_prompt")
  sft_parser.add_argument("--chat-template", default="auto", choices=("auto", "chat", "none"),
                          help="as data.chat_template: the tokenizer's template, or plain text")
  sft_parser.add_argument("--log-every", type=int, default=100, help="print the loss every this many steps")
  sft_parser.set_defaults(func=sft_command)
  return sft_parser
