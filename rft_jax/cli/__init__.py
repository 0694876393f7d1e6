"""The ``rft-jax`` command line: one subcommand per job.

The commands live by group (:mod:`~rft_jax.cli.run_commands`: train, demo, figures, sft;
:mod:`~rft_jax.cli.sample_commands`: eval, attribute, filter; :mod:`~rft_jax.cli.tool_commands`:
verify, export, plan, plot, build-kernels), each with its parser; :mod:`~rft_jax.cli.entry` builds
the parser and runs one (``rft-jax = rft_jax.cli:main``). Heavy imports happen inside the commands,
so that ``rft-jax --help`` is instant.
"""

from rft_jax.cli.entry import build_parser, main
from rft_jax.cli.tool_commands import VERIFY_TOLERANCES

__all__ = ["VERIFY_TOLERANCES", "build_parser", "main"]
