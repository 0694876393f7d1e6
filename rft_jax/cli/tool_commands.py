"""``rft-jax verify``, ``export``, ``plan``, ``plot`` and ``build-kernels``: the commands that check,
convert, plan or draw without training or sampling. Heavy imports happen inside them."""

from __future__ import annotations

import argparse
import sys

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



def checkpoint_dtype(model_dir: str) -> str | None:
  """The dtype a Hugging Face directory's ``config.json`` declares (float32 or bfloat16), if any."""
  import json
  import os

  with open(os.path.join(model_dir, "config.json")) as f:
    config = json.load(f)
  dtype = config.get("torch_dtype") or config.get("dtype")
  return dtype if dtype in ("float32", "bfloat16") else None


def export_command(args: argparse.Namespace) -> int:
  from rft_jax.models import load_tokenizer, save_hf

  from flax import nnx

  from rft_jax.train.checkpoint import all_finite, restore_policy
  from rft_jax.train.errors import NonFiniteError

  model, cfg, step = restore_policy(args.run_dir, args.step)
  if not all_finite(nnx.state(model, nnx.Param)):
    raise NonFiniteError(f"step {step} of {args.run_dir} holds NaN or infinite parameters; not exporting")
  dtype = args.dtype or checkpoint_dtype(cfg.model.path) or cfg.model.param_dtype
  save_hf(model, args.out, tokenizer=load_tokenizer(cfg.model.path), dtype=dtype, source=cfg.model.path)
  print(f"exported step {step} of {args.run_dir} to {args.out} ({dtype})")
  return 0



def plot_command(args: argparse.Namespace) -> int:
  import os

  from rft_jax.analysis.plots import plot_runs
  from rft_jax.train.config import ConfigError

  for run_dir in args.run_dirs:
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
      raise ConfigError(f"{run_dir}: no metrics.jsonl there (not a run directory, or no step done yet)")
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


def build_kernels_command(args: argparse.Namespace) -> int:
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
  export.add_argument("out", help="HF directory to write")
  export.add_argument("--step", type=int, help="checkpoint step (default: latest)")
  export.add_argument("--dtype", choices=("float32", "bfloat16"),
                      help="dtype of the written weights (default: the source checkpoint's, as its "
                           "config.json says; else the run's model.param_dtype)")
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
