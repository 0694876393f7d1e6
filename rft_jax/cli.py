"""The ``rft-jax`` command line: one subcommand per job.

Each subcommand lives in its own small function; heavy imports happen inside them so
that ``rft-jax --help`` is instant.
"""

from __future__ import annotations

import argparse
import sys

from rft_jax.demo.paths import DEFAULT_CONFIG as DEMO_CONFIG  # os only: --help stays instant

# Bounds the identities must meet in float64 (``rft-jax verify`` fails above them).
VERIFY_TOLERANCES = {
    "lemma1": 1e-12,
    "theorem1": 1e-12,
    "theorem2": 1e-12,
    "second_order": 0.05,
    "corollary1": 1e-12,
    "corollary1_1": 1e-12,
    "corollary3": 1e-12,
}


def _verify(args: argparse.Namespace) -> int:
  from rft_jax.entropy.identities import identity_errors

  errors = identity_errors(seed=args.seed, num_cases=args.cases, vocab_size=args.vocab)
  print(f"Entropy-dynamics identities, float64, {2 * args.cases} positions x {args.vocab} vocab")
  print(f"{'identity':<14} {'worst error':>12} {'bound':>9}  ok")
  finite = errors.pop("all_finite") == 1.0
  ok = finite
  for name, bound in VERIFY_TOLERANCES.items():
    passed = errors[name] <= bound
    ok &= passed
    print(f"{name:<14} {errors[name]:>12.3e} {bound:>9.0e}  {'yes' if passed else 'NO'}")
  print("all statistics finite on extreme logits:", "yes" if finite else "NO")
  return 0 if ok else 1


def _train(args: argparse.Namespace) -> int:
  if args.print_config or args.dry_run:
    return _check_config(args)
  from rft_jax.parallel.multihost import initialize_from_env
  from rft_jax.train.config import load_config
  from rft_jax.train.loop import train

  initialize_from_env()
  cfg = load_config(args.config, args.overrides)
  metrics = train(cfg, resume=not (args.no_resume or args.overwrite), overwrite=args.overwrite,
                  allow_config_change=args.allow_config_change)
  done = metrics["steps_done"]
  what = (f"finished {done} steps" if done == cfg.steps else
          f"stopped after {done} of {cfg.steps} steps (the training data ran out)")
  if "reward_mean" not in metrics:  # a rerun of a finished run: no step ran, nothing to report
    print(f"{what} in {cfg.run_dir}: nothing left to do (its latest checkpoint is of step {done})")
  else:
    print(f"{what} in {cfg.run_dir}: reward {metrics['reward_mean']:.3f}, "
          f"entropy {metrics.get('entropy', float('nan')):.3f}")
  return 0


def _check_config(args: argparse.Namespace) -> int:
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


def _checkpoint_dtype(model_dir: str) -> str | None:
  """The dtype a Hugging Face directory's ``config.json`` declares (float32 or bfloat16), if any."""
  import json
  import os

  with open(os.path.join(model_dir, "config.json")) as f:
    config = json.load(f)
  dtype = config.get("torch_dtype") or config.get("dtype")
  return dtype if dtype in ("float32", "bfloat16") else None


def _export(args: argparse.Namespace) -> int:
  from rft_jax.models import load_tokenizer, save_hf

  from flax import nnx

  from rft_jax.train.checkpoint import all_finite, restore_policy
  from rft_jax.train.errors import NonFiniteError

  model, cfg, step = restore_policy(args.run_dir, args.step)
  if not all_finite(nnx.state(model, nnx.Param)):
    raise NonFiniteError(f"step {step} of {args.run_dir} holds NaN or infinite parameters; not exporting")
  dtype = args.dtype or _checkpoint_dtype(cfg.model.path) or cfg.model.param_dtype
  save_hf(model, args.out, tokenizer=load_tokenizer(cfg.model.path), dtype=dtype, source=cfg.model.path)
  print(f"exported step {step} of {args.run_dir} to {args.out} ({dtype})")
  return 0


def _sampling_inputs(args: argparse.Namespace):
  """Loads the policy (HF directory or run directory: :func:`rft_jax.train.policy.load_policy`) and
  the questions.

  A run directory gives the defaults: its prompt (instruction, system prompt), data format,
  longest answer (``eval.max_new_tokens``, else ``sampling.max_new_tokens``) and reward; for an
  HF directory they are the training defaults. The command's options override either.

  Returns:
    ``(model, tokenizer, problems, sampling)``: ``sampling`` holds the keyword arguments of
    :func:`rft_jax.train.evaluate.evaluate` but ``k``, ``temperature`` and ``seed``, and ``config``,
    the run's config (None for an HF directory).
  """
  from rft_jax.data import FORMATS, load_math_dataset
  from rft_jax.train.config import ConfigError
  from rft_jax.train.policy import load_policy

  if args.format is not None and args.format not in FORMATS:
    raise ConfigError(f"--format {args.format!r} is not one of {', '.join(FORMATS)}")
  _check_sampling_options(args)
  _check_run_rewards(args.model)  # before the model loads: a reward that cannot import fails at once
  policy = load_policy(args.model, step=args.step, instruction=args.instruction,
                       system_prompt=args.system_prompt)
  cfg = policy.config
  max_new_tokens = (cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens) if cfg else 1024
  problems, _ = load_math_dataset(args.data, args.format or (policy.data.format if cfg else "jsonl"),
                                  on_bad_row="skip")
  sampling = dict(max_new_tokens=args.max_new_tokens or max_new_tokens, stop_ids=policy.stop_ids,
                  rewards=policy.rewards([p.question for p in problems]), prompt_fn=policy.prompt_ids,
                  config=cfg)
  return policy.model, policy.tokenizer, problems, sampling


def _check_sampling_options(args: argparse.Namespace) -> None:
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


def _check_run_rewards(model: str) -> None:
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


def _sample_problems(args: argparse.Namespace, completions: bool = False):
  """:func:`_sampling_inputs`, then ``k`` answers to each question."""
  from rft_jax.train.evaluate import evaluate

  model, tokenizer, problems, sampling = _sampling_inputs(args)
  sampling.pop("config")
  result = evaluate(model, tokenizer, problems, k=args.k, temperature=args.temperature, seed=args.seed,
                    completions=completions, **sampling)
  return problems, result


def _attribute(args: argparse.Namespace) -> int:
  import dataclasses

  from rft_jax.analysis.attribution import attribute, attribution_html, character_class
  from rft_jax.rewards.user_functions import load_function
  from rft_jax.rl.config import EntropyMaskConfig
  from rft_jax.rl.token_methods import configured_class
  from rft_jax.train.config import ConfigError

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
  model, tokenizer, problems, sampling = _sampling_inputs(args)
  cfg = sampling.pop("config")
  lr = args.lr if args.lr is not None else (cfg.learner.optim.lr if cfg else 1e-6)
  # The mask marked: --mask's, else the run's own; none for an HF directory or a run without one.
  mask = chosen or (cfg.learner.entropy_mask if cfg else EntropyMaskConfig(kind="none"))
  if mask.target_entropy is not None:  # the page marks a fixed cut
    mask = dataclasses.replace(mask, target_entropy=None)
  method = configured_class(mask, removes_tokens=True)
  completions = attribute(model, tokenizer, problems[:args.problems], k=args.k, temperature=args.temperature,
                          seed=args.seed, lr=lr, mask=mask, token_class=classes, **sampling)
  name = method.title if method.chooses_tokens else None
  with open(args.out, "w") as f:
    f.write(attribution_html([(f"{args.model}: {args.problems} problems x {args.k} samples", completions)], name))
  print(args.out)
  return 0


def _eval(args: argparse.Namespace) -> int:
  import json

  problems, result = _sample_problems(args, completions=bool(args.save_completions))
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


def _plot(args: argparse.Namespace) -> int:
  import os

  from rft_jax.analysis.plots import plot_runs
  from rft_jax.train.config import ConfigError

  for run_dir in args.run_dirs:
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
      raise ConfigError(f"{run_dir}: no metrics.jsonl there (not a run directory, or no step done yet)")
  print(plot_runs(args.run_dirs, args.out))
  return 0


def _demo(args: argparse.Namespace) -> int:
  from rft_jax.demo.run import run_demo, split_variants
  from rft_jax.train.config import ConfigError

  try:
    variants, overrides = split_variants(args.overrides)
  except ValueError as exc:  # an unknown variant: invalid input, exit 2
    raise ConfigError(str(exc)) from None
  run_demo(args.config, overrides, variants)
  return 0


def _figures(args: argparse.Namespace) -> int:
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


def _filter(args: argparse.Namespace) -> int:
  from rft_jax.data.filter import pass_rate_filter, write_filtered

  problems, result = _sample_problems(args)
  kept, rates = pass_rate_filter(problems, result["correct"], low=args.low, high=args.high)
  kept_path, _ = write_filtered(args.out, problems, rates, kept)
  print(f"kept {len(kept)} of {len(problems)} questions (pass rate in ({args.low:.4f}, {args.high:.4f})) -> {kept_path}")
  return 0


def _sft(args: argparse.Namespace) -> int:
  import time

  from rft_jax.train.sft import SFTConfig, sft_files

  config = SFTConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                     warmup_steps=args.warmup_steps, max_len=args.max_len, seed=args.seed)
  start = time.time()

  def log(step: int, loss: float) -> None:
    if step % args.log_every == 0 or step == config.steps - 1:
      print(f"sft step {step:5d}  loss {loss:.4f}  ({time.time() - start:.0f} s)", flush=True)

  from rft_jax.data.config import DataConfig

  prompt = DataConfig(system_prompt=args.system_prompt, chat_template=args.chat_template,
                      **({} if args.instruction is None else {"instruction": args.instruction}))
  sft_files(args.model, args.data, args.out, config, question_field=args.question_field,
            response_field=args.response_field, log=log, prompt=prompt)
  print(f"saved {args.out}")
  return 0


def _plan(args: argparse.Namespace) -> int:
  import json
  import os

  # Before jax starts: plan compiles for the named devices only, never touching local
  # accelerators (or libtpu's lock on them), with N fake devices for cpu:N.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  kind, _, count = args.topology.partition(":")
  if kind == "cpu" and count.isdigit() and "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={count}").strip()
  from rft_jax.plan.devices import topology
  from rft_jax.plan.fit import plan
  from rft_jax.plan.report import format_report
  from rft_jax.plan.topology import PlanError
  from rft_jax.train.config import load_config

  cfg = load_config(args.config, args.overrides, required=("model.path",))
  try:
    report = plan(cfg, topology(args.topology),
                  progress=lambda line: print(f"rft-jax plan: {line}", file=sys.stderr, flush=True))
  except PlanError as exc:
    print(f"rft-jax plan: error: {exc}", file=sys.stderr)
    return 2
  print(json.dumps(report) if args.json else format_report(report))
  return 0 if report["fits"] else 1


def _build_kernels(args: argparse.Namespace) -> int:
  import os
  import time

  from rft_jax.models import cpu_attention

  name = f"the CPU decode attention kernel ({cpu_attention.target()})"
  if os.path.exists(cpu_attention.library_path()) and not args.force:
    print(f"rft-jax build-kernels: {name} is built: {cpu_attention.library_path()}")
    return 0
  start = time.perf_counter()
  try:
    path = cpu_attention.build(force=True)
  except RuntimeError as exc:
    print(f"rft-jax build-kernels: error: {exc}", file=sys.stderr)
    return 1
  print(f"rft-jax build-kernels: {name} built into {path} in {time.perf_counter() - start:.1f} s")
  return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
  """Option defaults shown (not an unset one's or a flag's), descriptions and epilogs as written."""

  def _get_help_string(self, action: argparse.Action) -> str:
    if action.default is None or action.default is False:  # unset, or a flag
      return action.help
    return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
  """An ``argparse.ArgumentParser`` whose ``epilog`` may be a function, called only when the help
  is shown (the list of config keys imports jax; ``rft-jax --help`` stays instant), and whose
  help (its subcommands' too) uses :class:`HelpFormatter`."""

  def __init__(self, *args, formatter_class: type = HelpFormatter, **kwargs):
    super().__init__(*args, formatter_class=formatter_class, **kwargs)

  def format_help(self) -> str:
    if callable(self.epilog):
      self.epilog = self.epilog()
    return super().format_help()


def _config_keys_epilog() -> str:
  from rft_jax.train.config_reference import format_config_keys

  return ("config keys (YAML or dotted overrides key=value), their defaults and allowed values\n"
          "(docs/configs.md says what each means); relative paths are read against the current\n"
          "directory:\n" + format_config_keys())


EXIT_STATUS = """\
exit status (every command; the error is one line on standard error):
  0       done
  1       refused or stopped after the input was accepted: RUN_DIR in use by another trainer or
          holding an earlier run (--no-resume), a resume whose config changes what the run
          computes, non-finite parameters (a run, a resume, export), a write that fails, rewards
          that fail beyond rewards.max_error_fraction; plan: the config does not fit; verify: an
          identity above its bound; build-kernels: the build failed
  2       invalid input, found before anything runs: an unknown option or key, a bad config value
          or option value, a missing or malformed file (config, data, model directory, run
          directory), a reward function that does not import
  128+N   stopped by signal N (SIGTERM: 143, SIGINT: 130) after checkpointing the step"""


def _train_epilog() -> str:
  return _config_keys_epilog() + "\n\n" + EXIT_STATUS


def build_parser() -> argparse.ArgumentParser:
  parser = ArgumentParser(prog="rft-jax", description=__doc__.splitlines()[0], epilog=EXIT_STATUS)
  sub = parser.add_subparsers(dest="command", required=True)  # subcommands: ArgumentParser too

  verify = sub.add_parser("verify", help="check Theorems 1-2 and Corollaries 1-3 numerically")
  verify.add_argument("--seed", type=int, default=0, help="random seed of the cases")
  verify.add_argument("--cases", type=int, default=256, help="random positions per kind")
  verify.add_argument("--vocab", type=int, default=64, help="vocabulary size")
  verify.set_defaults(func=_verify)

  train = sub.add_parser("train", help="run (or resume) a training run", epilog=_train_epilog)
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
  train.set_defaults(func=_train)

  demo = sub.add_parser("demo", help="GRPO vs Clip_B vs Clip_V (or other methods: variants=...) on the "
                                     "embedded synthetic task")
  demo.add_argument("--config", default=DEMO_CONFIG, help="YAML config; its relative model.path is "
                    "read against the directory holding the rft_jax package (the repository root in a checkout)")
  demo.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. steps=10; "
                    "variants=grpo,clip_b,clip_v,clip_cov,kl_cov,forking,unlikely,ppo,ppo_clip_b,ppo_clip_v,lora picks the runs "
                    "(default grpo,clip_b,clip_v)")
  demo.set_defaults(func=_demo)

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
  figures.set_defaults(func=_figures)

  export = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face directory")
  export.add_argument("run_dir", help="the run directory (with checkpoints/ and config.yaml)")
  export.add_argument("out", help="HF directory to write")
  export.add_argument("--step", type=int, help="checkpoint step (default: latest)")
  export.add_argument("--dtype", choices=("float32", "bfloat16"),
                      help="dtype of the written weights (default: the source checkpoint's, as its "
                           "config.json says; else the run's model.param_dtype)")
  export.set_defaults(func=_export)

  def sampling_args(p, k, temperature):
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

  evaluate = sub.add_parser("eval", help="Avg@K / Pass@K of a run's checkpoint or an HF directory")
  sampling_args(evaluate, 8, 0.7)
  evaluate.add_argument("--histogram", help="write the per-problem pass-rate histogram PNG here")
  evaluate.add_argument("--save-completions", metavar="PATH",
                        help="write every sampled answer with its score here (JSONL)")
  evaluate.set_defaults(func=_eval)

  attr = sub.add_parser("attribute", help="a page of sampled answers, each token coloured by its Theorem 2 "
                                          "forecast entropy change, and the forecasts by token class")
  sampling_args(attr, 4, 1.0)
  attr.add_argument("--problems", type=int, default=8, help="the first this many questions of --data")
  attr.add_argument("--lr", type=float, help="the step size of the forecast (default: the run's learner.optim.lr)")
  attr.add_argument("--token-classes", metavar="MODULE:FUNCTION",
                    help="token classes, e.g. rft_jax.demo.task:token_class (default: digit / separator / other)")
  attr.add_argument("--mask", metavar="KIND",
                    help="the entropy mask whose tokens are outlined: clip_b, clip_v, ... or none (default: "
                         "the run's learner.entropy_mask; none for an HF directory)")
  attr.add_argument("--out", default="attribution.html", help="the HTML page to write")
  attr.set_defaults(func=_attribute)

  filt = sub.add_parser("filter", help="drop questions with pass rate <= 1/16 or >= 15/16")
  sampling_args(filt, 16, 1.0)
  filt.add_argument("--low", type=float, default=1 / 16, help="drop pass rates at or below this")
  filt.add_argument("--high", type=float, default=15 / 16, help="drop pass rates at or above this")
  filt.add_argument("--out", required=True, help="directory for kept.jsonl and pass_rates.jsonl")
  filt.set_defaults(func=_filter)

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
  sft_parser.set_defaults(func=_sft)

  plan = sub.add_parser("plan", help="compile a config's learner step and sampler for a device "
                                     "topology (no devices, weights or data) and say if it fits")
  plan.add_argument("config", help="YAML config; only model.path/config.json is read")
  plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.micro_batch_size=4")
  plan.add_argument("--topology", required=True,
                    help="a TPU topology (v5p:2x2x1, v5e:2x4, v6e:2x4, v4:2x2x1, ...), GPUs "
                         "(h100:8, h100:2x8, h200:8; needs jax's CUDA plugin) or cpu:N")
  plan.add_argument("--json", action="store_true", help="print one JSON object")
  plan.set_defaults(func=_plan)

  plot = sub.add_parser("plot", help="draw the paper's figures for runs side by side")
  plot.add_argument("run_dirs", nargs="+", help="run directories (with metrics.jsonl); one colour each")
  plot.add_argument("--out", help="PNG to write (default: plots.png in the first run directory)")
  plot.set_defaults(func=_plot)

  kernels = sub.add_parser("build-kernels", help="compile the CPU decode attention kernel for this "
                                                 "machine (without it, CPU decoding uses XLA's attention)")
  kernels.add_argument("--force", action="store_true", help="rebuild it where it is built")
  kernels.set_defaults(func=_build_kernels)
  for command in (train, demo, figures):
    loudness = command.add_mutually_exclusive_group()
    loudness.add_argument("--quiet", action="count", default=0, help="status lines: warnings only")
    loudness.add_argument("--verbose", action="count", default=0, help="status lines: debug too")
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args, extra = parser.parse_known_args(argv)
  # Options may come anywhere among the dotted overrides: argparse leaves the overrides after an
  # option unparsed; they are taken here, in order.
  if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
    args.overrides, extra = [*args.overrides, *extra], []
  if extra:
    parser.error(f"unrecognized arguments: {' '.join(extra)}")
  from rft_jax.train.status import configure_logging

  configure_logging(getattr(args, "verbose", 0) - getattr(args, "quiet", 0))
  try:
    return args.func(args)
  except Exception as exc:  # bad input: one clear line, not a traceback
    from rft_jax.data import DatasetError
    from rft_jax.models import CheckpointError
    from rft_jax.train.config import ConfigError
    from rft_jax.train.errors import Preempted, RunError

    if isinstance(exc, RunError):  # a fault of the run: the run already saved what it could
      print(f"rft-jax {args.command}: {'' if isinstance(exc, Preempted) else 'error: '}{exc}",
            file=sys.stderr)
      return exc.exit_code
    if isinstance(exc, (ConfigError, DatasetError, CheckpointError, FileNotFoundError)):
      print(f"rft-jax {args.command}: error: {exc}", file=sys.stderr)
      return 2
    raise


if __name__ == "__main__":
  sys.exit(main())
