"""The ``rft-jax`` entry point: the parser of every command, and :func:`main`, which runs one and
turns bad input into one line and an exit status (``rft-jax --help`` lists them)."""

from __future__ import annotations

import argparse
import sys

from rft_jax.cli import run_commands, sample_commands, tool_commands
from rft_jax.cli.parser import EXIT_STATUS, ArgumentParser

DESCRIPTION = "The ``rft-jax`` command line: one subcommand per job."

# Each command's parser, in the order ``rft-jax --help`` lists them.
COMMANDS = (tool_commands.add_verify_parser, run_commands.add_train_parser, run_commands.add_demo_parser,
            run_commands.add_figures_parser, tool_commands.add_export_parser, sample_commands.add_eval_parser,
            sample_commands.add_attribute_parser, sample_commands.add_filter_parser,
            run_commands.add_sft_parser, tool_commands.add_plan_parser, tool_commands.add_plot_parser,
            tool_commands.add_build_kernels_parser)


def build_parser() -> argparse.ArgumentParser:
  parser = ArgumentParser(prog="rft-jax", description=DESCRIPTION, epilog=EXIT_STATUS)
  sub = parser.add_subparsers(dest="command", required=True)  # subcommands: ArgumentParser too
  for add_parser in COMMANDS:
    add_parser(sub)
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

