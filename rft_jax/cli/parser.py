"""The ``rft-jax`` parser's parts shared by every command group: the help formatter, the parser
class whose epilog may be computed when the help is shown, and the exit-status table."""

from __future__ import annotations

import argparse

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


def add_mesh_option(parser: argparse.ArgumentParser) -> None:
  """``--mesh DATAxMODEL``: the mesh a run's checkpoint is restored onto (default: the run's)."""
  parser.add_argument("--mesh", metavar="DATAxMODEL",
                      help="restore a run's checkpoint on this data x model mesh of the first devices, "
                           "e.g. 2x4 (default: the run's mesh section on this machine's devices)")


def mesh_from_option(value: str | None):
  """The mesh ``--mesh`` names (None: the run's); a :class:`ConfigError` line for one that is
  malformed or needs more devices than there are."""
  from rft_jax.train.config import ConfigError

  if value is None:
    return None
  data, x, model = value.partition("x")
  if not (x and data.isdigit() and model.isdigit() and int(data) > 0 and int(model) > 0):
    raise ConfigError(f"--mesh {value}: expected DATAxMODEL, two positive sizes such as 2x4")
  from rft_jax.parallel import make_mesh

  try:
    return make_mesh(data=int(data), model=int(model))
  except ValueError as exc:
    raise ConfigError(f"--mesh {value}: {exc}") from None


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
          directory), an output path a file stands in (run_dir, export's OUT, plot, attribute and
          filter --out, eval --histogram / --save-completions) or a non-empty export directory, a
          --mesh the devices cannot make, a reward function that does not import
  128+N   stopped by signal N (SIGTERM: 143, SIGINT: 130) after checkpointing the step"""


def train_epilog() -> str:
  """``train --help``'s epilog: every config key, then the exit statuses."""
  return _config_keys_epilog() + "\n\n" + EXIT_STATUS

