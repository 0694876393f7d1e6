"""``rft-jax verify``, ``export``, ``plan``, ``plot`` and ``build-kernels``: the commands that check,
convert, plan or draw without training or sampling. Heavy imports happen inside them."""

from __future__ import annotations

import argparse
import sys

from rft_jax.cli.parser import add_mesh_option, mesh_from_option

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



def verify_command(args: argparse.Namespace) -> int:
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



def export_command(args: argparse.Namespace) -> int:
  """``rft-jax export RUN_DIR OUT``: checked before the model loads (OUT new or empty unless
  ``--overwrite``, ``--step`` one of the run's checkpoints, ``--mesh`` one the devices make); the
  checkpoint restored sharded on the run's mesh (or ``--mesh``) in its dtypes and written one
  tensor at a time (``save_hf``), into a directory beside OUT first when OUT is replaced, so a
  failure leaves OUT as it was."""
  import os
  import shutil

  from flax import nnx

  from rft_jax.models import load_tokenizer, save_hf
  from rft_jax.models.hf import checkpoint_dtype
  from rft_jax.train.checkpoint import all_finite, restore_policy
  from rft_jax.train.config import ConfigError
  from rft_jax.train.errors import NonFiniteError
  from rft_jax.train.output_paths import check_new_directory
  from rft_jax.train.run_dir import checkpoint_steps

  steps = checkpoint_steps(args.run_dir)
  if not (steps and os.path.isfile(os.path.join(args.run_dir, "config.yaml"))):
    raise ConfigError(f"{args.run_dir}: no checkpoints and config.yaml there (not a run directory, or no step "
                      f"done yet)")
  if args.step is not None and args.step not in steps:
    raise ConfigError(f"--step {args.step}: {args.run_dir} has checkpoints of steps {steps}")
  check_new_directory(args.out, "OUT", overwrite=args.overwrite)
  mesh = mesh_from_option(args.mesh)
  model, cfg, step = restore_policy(args.run_dir, args.step, mesh)
  if not all_finite(nnx.state(model, nnx.Param)):
    raise NonFiniteError(f"step {step} of {args.run_dir} holds NaN or infinite parameters; not exporting")
  dtype = args.dtype or checkpoint_dtype(cfg.model.path) or cfg.model.param_dtype
  replace = os.path.isdir(args.out) and bool(os.listdir(args.out))
  target = os.path.normpath(args.out) + ".exporting" if replace else args.out
  if replace and os.path.exists(target):  # left by an export that was stopped
    shutil.rmtree(target)
  save_hf(model, target, tokenizer=load_tokenizer(cfg.model.path), dtype=dtype, source=cfg.model.path)
  if replace:
    shutil.rmtree(args.out)
    os.replace(target, args.out)
  print(f"exported step {step} of {args.run_dir} to {args.out} ({dtype})")
  return 0



def plot_command(args: argparse.Namespace) -> int:
  import os

  from rft_jax.analysis.plots import default_out_path, plot_runs
  from rft_jax.train.config import ConfigError
  from rft_jax.train.output_paths import check_file

  for run_dir in args.run_dirs:
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
      raise ConfigError(f"{run_dir}: no metrics.jsonl there (not a run directory, or no step done yet)")
  check_file(args.out or default_out_path(args.run_dirs), "--out")
  print(plot_runs(args.run_dirs, args.out))
  return 0



def plan_command(args: argparse.Namespace) -> int:
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
  from rft_jax.plan.commands import format_command_report, plan_command as plan_after_training
  from rft_jax.plan.devices import topology
  from rft_jax.plan.fit import plan
  from rft_jax.plan.report import format_report
  from rft_jax.plan.topology import PlanError
  from rft_jax.train.config import ConfigError, load_config

  if args.k < 1:
    raise ConfigError(f"--k {args.k}: must be >= 1 (samples per question)")
  cfg = load_config(args.config, args.overrides, required=("model.path",))
  progress = lambda line: print(f"rft-jax plan: {line}", file=sys.stderr, flush=True)  # noqa: E731
  try:
    if args.planned == "train":
      report, text = plan(cfg, topology(args.topology), progress=progress), format_report
    else:
      report = plan_after_training(cfg, topology(args.topology), args.planned, progress, k=args.k)
      text = format_command_report
  except PlanError as exc:
    print(f"rft-jax plan: error: {exc}", file=sys.stderr)
    return 2
  print(json.dumps(report) if args.json else text(report))
  return 0 if report["fits"] else 1


def build_kernels_command(args: argparse.Namespace) -> int:
  import os
  import time

  from rft_jax.models.decode import cpu_attention

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



def add_verify_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax verify``."""
  verify = sub.add_parser("verify", help="check Theorems 1-2 and Corollaries 1-3 numerically")
  verify.add_argument("--seed", type=int, default=0, help="random seed of the cases")
  verify.add_argument("--cases", type=int, default=256, help="random positions per kind")
  verify.add_argument("--vocab", type=int, default=64, help="vocabulary size")
  verify.set_defaults(func=verify_command)
  return verify


def add_export_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax export``."""
  export = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face directory")
  export.add_argument("run_dir", help="the run directory (with checkpoints/ and config.yaml)")
  export.add_argument("out", help="HF directory to write (new, or empty unless --overwrite)")
  export.add_argument("--overwrite", action="store_true",
                      help="replace what OUT holds (without it, a non-empty OUT is refused)")
  export.add_argument("--step", type=int, help="checkpoint step (default: latest)")
  export.add_argument("--dtype", choices=("float32", "bfloat16"),
                      help="dtype of the written weights (default: the source checkpoint's, as its "
                           "config.json says; else the run's model.param_dtype)")
  add_mesh_option(export)
  export.set_defaults(func=export_command)
  return export


def add_plan_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax plan``."""
  plan = sub.add_parser("plan", help="compile a config's learner step and sampler for a device "
                                     "topology (no devices, weights or data) and say if it fits")
  plan.add_argument("config", help="YAML config; only model.path/config.json is read")
  plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.micro_batch_size=4")
  plan.add_argument("--topology", required=True,
                    help="a TPU topology (v5p:2x2x1, v5e:2x4, v6e:2x4, v4:2x2x1, ...), GPUs "
                         "(h100:8, h100:2x8, h200:8; needs jax's CUDA plugin) or cpu:N")
  plan.add_argument("--command", dest="planned", choices=("train", "eval", "export"), default="train",
                    help="the command planned: train (the learner step and the sampler), eval or export "
                         "of the run's checkpoint (its state restored on the run's mesh; eval's sampler "
                         "at --k samples per question)")
  plan.add_argument("--k", type=int, default=8, help="--command eval: samples per question (rft-jax eval's --k)")
  plan.add_argument("--json", action="store_true", help="print one JSON object")
  plan.set_defaults(func=plan_command)
  return plan


def add_plot_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax plot``."""
  plot = sub.add_parser("plot", help="draw the paper's figures for runs side by side")
  plot.add_argument("run_dirs", nargs="+", help="run directories (with metrics.jsonl); one colour each")
  plot.add_argument("--out", help="PNG to write (default: plots.png in the first run directory)")
  plot.set_defaults(func=plot_command)
  return plot


def add_build_kernels_parser(sub) -> argparse.ArgumentParser:
  """``rft-jax build-kernels``."""
  kernels = sub.add_parser("build-kernels", help="compile the CPU decode attention kernel for this "
                                                 "machine (without it, CPU decoding uses XLA's attention)")
  kernels.add_argument("--force", action="store_true", help="rebuild it where it is built")
  kernels.set_defaults(func=build_kernels_command)
  return kernels
