"""A config's sources read into OmegaConf nodes: the YAML file and the dotted overrides, each
refused with a :class:`ConfigError` that names the file (and the line) or the override. The
merge of the sources into the schema is :func:`rft_jax.train.config.load_config`'s."""

from __future__ import annotations

from typing import Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rft_jax.train.renamed_keys import rename_keys


class ConfigError(ValueError):
  """A config that cannot run; the message names the file, the key and the value."""


def describe_error(exc: OmegaConfBaseException) -> str:
  key = getattr(exc, "full_key", None)
  text = str(exc).splitlines()[0]
  return f"{text} (key: {key})" if key else text


def load_yaml(path: str):
  """The YAML file as an OmegaConf mapping; a file that is missing, not UTF-8, not YAML or not a
  mapping is a :class:`ConfigError` naming the file (and the line)."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except FileNotFoundError as exc:
    raise ConfigError(f"config file not found: {path}") from exc
  except OSError as exc:  # a directory, no permission
    raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from exc
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as exc:
    line = raw.count(b"\n", 0, exc.start) + 1
    raise ConfigError(f"{path}: line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x})") from exc
  try:
    loaded = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
  except yaml.YAMLError as exc:
    raise ConfigError(f"{path}: malformed YAML: {yaml_problem(exc)}") from exc
  if not OmegaConf.is_dict(loaded):
    raise ConfigError(f"{path}: the top level must be a mapping of settings (key: value), "
                      f"not a {type(OmegaConf.to_container(loaded)).__name__}")
  return rename_keys(loaded, path)


def parse_overrides(overrides: Sequence[str]):
  """The ``key=value`` overrides as an OmegaConf mapping (``key=`` is the empty string)."""
  bad = [o for o in overrides if "=" not in o]
  if bad:
    raise ConfigError(f"override {bad[0]!r} is not of the form key=value")
  dotlist = []
  for override in overrides:
    # `key=` is the empty string (OmegaConf reads it as null, which a str field refuses)
    item = override + "''" if override.endswith("=") else override
    try:
      OmegaConf.from_dotlist([item])
    except yaml.YAMLError as exc:
      raise ConfigError(f"override {override!r}: the value is not valid YAML: "
                        f"{yaml_problem(exc, with_line=False)}") from exc
    dotlist.append(item)
  return OmegaConf.from_dotlist(dotlist)


def yaml_problem(exc: yaml.YAMLError, with_line: bool = True) -> str:
  """What a YAML parser error says, with the line and column of its marks (1-based)."""
  def at(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if with_line and mark is not None else ""

  problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
  context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
  problem_mark = getattr(exc, "problem_mark", None) or context_mark
  text = f"{at(problem_mark)}: {problem}" if at(problem_mark) else problem
  if context:
    where = at(context_mark) if context_mark is not problem_mark else ""
    text += f" ({context}{' at ' + where if where else ''})"
  return text
