"""The config reference, generated from the run's config dataclasses: every key of
:class:`~rft_jax.train.config.TrainConfig` with its type, default, allowed values and one line of
meaning. ``docs/configs.md`` is its output (``tests/test_docs.py`` checks that it is up to date)::

    python -m rft_jax.train.config_reference > docs/configs.md

Nothing here is a second copy of the schema: the keys, types and defaults are read from the
dataclasses (the walk of :func:`rft_jax.train.config.config_keys`, which ``rft-jax train --help``
prints), the meaning from the ``Attributes:`` entries of their docstrings, and the allowed values
from the registries and tuples the validators check against (:func:`allowed_values`;
``tests/test_docs.py`` checks every listed value is accepted and any other refused, and that no
key whose validator refuses an unknown word is missing from the table).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from typing import Any, Callable, Optional, Sequence

from rft_jax.data.config import DataConfig
from rft_jax.data.datasets import FORMATS
from rft_jax.entropy.clipping import LOGP_SOURCES, SAMPLES
from rft_jax.models.config import ATTENTION_KINDS, DECODE_KERNEL_KINDS, DTYPES
from rft_jax.models.lora import ALL_LINEAR, LORA_TARGETS, LoraConfig
from rft_jax.models.decode.paged_kv import PAGED_ATTENTION_KINDS
from rft_jax.models.tokenizer import CHAT_TEMPLATE_MODES
from rft_jax.rewards.extract import EXTRACTORS
from rft_jax.rewards.schemes import SCHEMES, RewardConfig
from rft_jax.rl.advantages.algorithms import ALGORITHMS
from rft_jax.rl.config import (REF_DTYPES, EntropyMaskConfig, EntropyMethodConfig, LearnerConfig,
                               RolloutCorrectionConfig)
from rft_jax.rl.advantages.critic import CriticConfig
from rft_jax.rl.losses import AGGREGATIONS, KL_ESTIMATORS
from rft_jax.rl.objectives import OBJECTIVES
from rft_jax.rl.optimizer import MOMENT_DTYPES, SCHEDULES, OptimizerConfig
from rft_jax.rl.rollout_correction import IMPORTANCE_LEVELS, REJECTION_OPTIONS
from rft_jax.rl.token_methods import method_names
from rft_jax.sampling.params import SCHEDULERS, SamplingParams
from rft_jax.train.config import (EvalConfig, EvalSetConfig, LoggingConfig, MeshConfig, ModelConfig,
                                  TrainConfig)

COMMAND = "python -m rft_jax.train.config_reference > docs/configs.md"


@dataclasses.dataclass(frozen=True)
class Allowed:
  """The values a key takes: ``values()`` reads them from the validator's registry or tuple when
  asked (a method registered later is listed); ``each``: the key is a list (or a comma-separated
  string) each of whose items is one of them."""

  values: Callable[[], Sequence[Any]]
  each: bool = False


# (config class, field) -> the registry or tuple its validator checks against.
ALLOWED: dict[tuple[type, str], Allowed] = {
    (ModelConfig, "dtype"): Allowed(lambda: tuple(DTYPES)),  # TrainConfig.__post_init__
    (ModelConfig, "param_dtype"): Allowed(lambda: tuple(DTYPES)),
    (ModelConfig, "attention"): Allowed(lambda: ATTENTION_KINDS),
    (ModelConfig, "decode_kernels"): Allowed(lambda: DECODE_KERNEL_KINDS),
    (LoraConfig, "targets"): Allowed(lambda: (*LORA_TARGETS, ALL_LINEAR), each=True),
    (DataConfig, "format"): Allowed(lambda: tuple(FORMATS)),  # checked when the data loads
    (DataConfig, "on_bad_row"): Allowed(lambda: ("error", "skip")),  # rft_jax.data.datasets.load_math_dataset
    (DataConfig, "chat_template"): Allowed(lambda: CHAT_TEMPLATE_MODES),
    (SamplingParams, "scheduler"): Allowed(lambda: SCHEDULERS),
    (SamplingParams, "paged_attention"): Allowed(lambda: PAGED_ATTENTION_KINDS),
    (LearnerConfig, "advantage"): Allowed(lambda: tuple(ALGORITHMS)),
    (LearnerConfig, "objective"): Allowed(lambda: tuple(OBJECTIVES)),
    (LearnerConfig, "loss_agg"): Allowed(lambda: AGGREGATIONS),
    (LearnerConfig, "kl_estimator"): Allowed(lambda: tuple(KL_ESTIMATORS)),
    (LearnerConfig, "ref_dtype"): Allowed(lambda: REF_DTYPES),
    (EntropyMaskConfig, "kind"): Allowed(lambda: method_names(removes_tokens=True)),
    (EntropyMaskConfig, "samples"): Allowed(lambda: SAMPLES),
    (EntropyMaskConfig, "sign"): Allowed(lambda: ("positive", "negative")),  # EntropyMaskConfig.__post_init__
    (EntropyMaskConfig, "action"): Allowed(lambda: ("keep", "drop", "only")),  # EntropyMaskConfig.__post_init__
    (EntropyMaskConfig, "logp_source"): Allowed(lambda: LOGP_SOURCES),
    (EntropyMethodConfig, "kind"): Allowed(lambda: method_names(removes_tokens=False)),
    (RolloutCorrectionConfig, "importance_sampling"): Allowed(lambda: (None, *IMPORTANCE_LEVELS)),
    (RolloutCorrectionConfig, "rejection"): Allowed(lambda: REJECTION_OPTIONS, each=True),
    (OptimizerConfig, "schedule"): Allowed(lambda: SCHEDULES),
    (OptimizerConfig, "moment_dtype"): Allowed(lambda: MOMENT_DTYPES),
    (CriticConfig, "loss_agg"): Allowed(lambda: AGGREGATIONS),
    (RewardConfig, "scheme"): Allowed(lambda: tuple(SCHEMES)),
    (RewardConfig, "extractor"): Allowed(lambda: ("auto", *EXTRACTORS)),
    (EvalSetConfig, "format"): Allowed(lambda: tuple(FORMATS)),  # checked when the set loads
    (LoggingConfig, "wandb_mode"): Allowed(lambda: ("online", "offline")),  # LoggingConfig.__post_init__
}

# Keys whose class docstring has no ``Attributes:`` entry for them.
MEANINGS: dict[tuple[type, str], str] = {
    (TrainConfig, "max_refills"): "extra sampling rounds of a step with `dynamic_sampling` (0: none).",
    (LearnerConfig, "max_len"): "Dr.GRPO's constant length for `seq-mean-token-sum-norm` (None: `rollout.max_trajectory_tokens` when set, else `sampling.max_new_tokens`).",
    (RewardConfig, "function_weights"): "one weight per `rewards.functions` entry (empty: all 1).",
    (EvalSetConfig, "name"): "the set's name in its metrics (`eval/<name>/avg@k`); not `val`.",
    (EvalSetConfig, "path"): "local file or `save_to_disk` directory of the set.",
    (EvalSetConfig, "format"): "how its rows are read (as `data.format`).",
    (EvalSetConfig, "k"): "samples per problem (Avg@k, Pass@k).",
    (EvalConfig, "every"): "evaluate every this many steps (0: never).",
    (EvalConfig, "at_start"): "also evaluate the starting policy of a fresh run, logged as step 0.",
    (EvalConfig, "save_completions"): "write every sampled answer, with its score, to "
                                      "`RUN_DIR/eval_completions.jsonl`.",
    (EvalConfig, "temperature"): "sampling temperature of the evaluation (the paper: 0.7).",
    (EvalConfig, "max_new_tokens"): "longest answer of the evaluation (None: `sampling.max_new_tokens`).",
    (EvalConfig, "val_k"): "samples per problem of the held-out split (when `data.val_size > 0`).",
    (EvalConfig, "max_val_problems"): "evaluate at most this many held-out problems (None: all).",
    (EvalConfig, "sets"): "extra evaluation sets (e.g. AIME with `k: 32`).",
    (MeshConfig, "data"): "devices of the data-parallel (FSDP) axis; -1: all devices / `model`.",
    (MeshConfig, "model"): "devices of the tensor-parallel axis.",
}


def allowed_values(cls: type, field: str) -> Optional[tuple[Any, ...]]:
  """The values ``cls.field`` takes (``None``: any value of its type)."""
  entry = ALLOWED.get((cls, field))
  return None if entry is None else tuple(entry.values())


# ------------------------------------------------------------------ docstrings


_ROLE = re.compile(r":(?:class|func|mod|data|meth|attr|math|obj):`~?([^`]*)`")


def markdown_text(text: str) -> str:
  """reStructuredText of a docstring as one line of Markdown: ``x`` -> `x`, :class:`~a.B` -> `a.B`."""
  text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
  text = text.replace("``", "`")
  return re.sub(r"\s+", " ", text).strip()


def first_sentence(text: str) -> str:
  """Up to the first full stop that ends a sentence (not ``e.g.``, ``i.e.`` or a number's)."""
  depth = 0
  for i, ch in enumerate(text):
    depth += ch in "([" and 1 or (ch in ")]" and -1) or 0
    if ch == "." and depth <= 0 and (i + 1 == len(text) or text[i + 1] == " "):
      before = text[max(0, i - 4):i + 1]
      if re.search(r"(?:e\.g|i\.e|etc|vs)\.$", before):
        continue
      return text[:i + 1]
  return text


def attribute_entries(cls: type) -> dict[str, str]:
  """``{field: meaning}`` from the ``Attributes:`` sections of ``cls``'s docstring and of its
  dataclass bases' (a section made of what several classes declare, e.g.
  ``learner.entropy_method``: each token method's settings). An entry names one field or several
  (``a / b:``, ``a, b:``), may carry a parenthesis before its colon (kept); a later field may
  start inside an entry's text (``...; b: ...``, ``... . b: ...``)."""
  fields = {f.name for f in dataclasses.fields(cls)}
  out: dict[str, str] = {}
  for klass in cls.__mro__:
    if dataclasses.is_dataclass(klass):
      out = _docstring_entries(klass.__doc__ or "", fields) | out
  return out


def _docstring_entries(doc: str, fields: set[str]) -> dict[str, str]:
  """:func:`attribute_entries` of one docstring."""
  lines = doc.splitlines()
  start = next((i for i, line in enumerate(lines) if re.match(r"\s*Attributes\b[^:]*:\s*$", line)), None)
  if start is None:
    return {}
  entries: list[list[str]] = []
  indent = None
  for line in lines[start + 1:]:
    if not line.strip():
      if entries:
        break
      continue
    width = len(line) - len(line.lstrip())
    if indent is None:
      indent = width
    if width < indent:
      break
    if width == indent:
      entries.append([line.strip()])
    elif entries[-1][-1].count("``") % 2:  # a ``literal`` broken over two lines
      entries[-1][-1] += line.strip()
    else:
      entries[-1].append(line.strip())
  names = r"(?:``)?\w+(?:``)?(?:\s*(?:/|,)\s*(?:``)?\w+(?:``)?)*"
  head = re.compile(rf"^({names})((?:\s*\([^)]*\))?):\s+(.*)$", re.S)
  out: dict[str, str] = {}

  def add(keys: str, paren: str, text: str) -> None:
    for key in re.split(r"\s*(?:/|,)\s*", keys.replace("``", "")):
      if key in fields and key not in out:
        out[key] = (paren.strip() + " " if paren.strip() else "") + text

  for entry in entries:
    match = head.match(" ".join(entry))
    if not match:
      continue
    keys, paren, text = match.groups()
    # a field's own entry inside another's text: "...; b: ..." or "... . b: ..."
    inner = re.compile(rf"(?:(?<=;)|(?<=\.))\s+({names}):\s+")
    pieces = []
    pos = 0
    for m in inner.finditer(text):
      named = [k for k in re.split(r"\s*(?:/|,)\s*", m.group(1).replace("``", ""))]
      if all(k in fields for k in named):
        pieces.append((keys, paren, text[pos:m.start()]))
        keys, paren, pos = m.group(1), "", m.end()
    pieces.append((keys, paren, text[pos:]))
    for k, p, t in pieces:
      add(k, p, t.strip().rstrip(";").strip())
  return out


# ------------------------------------------------------------------ the walk


@dataclasses.dataclass(frozen=True)
class Key:
  """One row of the reference."""

  key: str
  type: str
  default: Any
  allowed: Optional[tuple[Any, ...]]
  each: bool
  meaning: str
  section: str


def _unwrap_optional(hint) -> tuple[Any, bool]:
  args = typing.get_args(hint)
  if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", ())) and type(None) in args:
    rest = [a for a in args if a is not type(None)]
    return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
  return hint, False


def type_name(hint) -> str:
  """``int``, ``float or null``, ``list of str``, ``section``, ..."""
  inner, optional = _unwrap_optional(hint)
  origin = typing.get_origin(inner)
  if dataclasses.is_dataclass(inner):
    name = "section"
  elif origin in (list, tuple):
    args = [a for a in typing.get_args(inner) if a is not Ellipsis]
    item = args[0] if args else Any
    name = "list of " + ("sections" if dataclasses.is_dataclass(item) else getattr(item, "__name__", str(item)))
  else:
    name = getattr(inner, "__name__", str(inner))
  return name + (" or null" if optional else "")


def _default(cls: type, field: dataclasses.Field, instance: Any) -> Any:
  if instance is not None:
    return getattr(instance, field.name)
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return dataclasses.MISSING


def _meaning(cls: type, name: str, docs: dict[str, str]) -> str:
  text = docs.get(name) or MEANINGS.get((cls, name), "")
  return first_sentence(markdown_text(text))


def reference(schema: type = TrainConfig, prefix: str = "", instance: Any = None,
              section: str = "") -> list[Key]:
  """Every key of ``schema``, walked like :func:`rft_jax.train.config.config_keys` (a nested
  section's defaults from its factory's value; a list's config items as ``key[i].field``), and
  also into a section that is null by default (``model.lora``: its fields with the defaults it
  takes when set)."""
  hints = typing.get_type_hints(schema)
  docs = attribute_entries(schema)
  keys: list[Key] = []
  for field in dataclasses.fields(schema):
    key = prefix + field.name
    default = _default(schema, field, instance)
    hint = hints[field.name]
    inner, optional = _unwrap_optional(hint)
    if dataclasses.is_dataclass(default):
      keys += reference(type(default), key + ".", default, key)
      continue
    entry = ALLOWED.get((schema, field.name))
    keys.append(Key(key, type_name(hint), default, allowed_values(schema, field.name),
                    bool(entry and entry.each), _meaning(schema, field.name, docs), section))
    if dataclasses.is_dataclass(inner) and default is None:  # a section that is off by default
      keys += reference(inner, key + ".", inner(), key)
    item = typing.get_args(inner)
    if typing.get_origin(inner) is list and item and dataclasses.is_dataclass(item[0]):
      keys += reference(item[0], key + "[i].", None, key + "[i]")
  return keys


def section_title(section: str, schema: type = TrainConfig) -> str:
  """The first line of the docstring of the section's class."""
  cls = schema
  for part in section.replace("[i]", "").split("."):
    hints = typing.get_type_hints(cls)
    inner, _ = _unwrap_optional(hints[part])
    args = typing.get_args(inner)
    cls = args[0] if typing.get_origin(inner) is list and args else inner
  return markdown_text((cls.__doc__ or "").strip().split("\n\n")[0])


# ------------------------------------------------------------------ output


def shown(value: Any) -> str:
  """A value as YAML writes it (``null``, ``true``, ``'text'``, ``[a, b]``); as ``--help`` does."""
  if value is None:
    return "null"
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, str):  # YAML's single quotes: a backslash is itself
    return "'" + value.replace("'", "''") + "'"
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(shown(v) for v in value) + "]"
  return repr(value)


def allowed_text(row: Key) -> str:
  """``a``, ``b`` (``each of`` for a list or comma-separated key)."""
  if row.allowed is None:
    return ""
  values = ", ".join("null" if v is None else str(v) for v in row.allowed)
  return ("each of: " if row.each else "") + values


def format_config_keys() -> str:
  """Every setting with its default (``rft-jax train --help``), a line each, with the values a key
  with a fixed set takes; a null section's keys (``model.lora``) too."""
  rows, lines = reference(), []
  off = {row.key for row in rows if row.default is None and row.type == "section or null"}
  for row in rows:
    line = f"  {row.key} = {shown(row.default)}"
    if row.allowed is not None:
      line += f"  ({'each ' if row.each else ''}one of: {', '.join('null' if v is None else str(v) for v in row.allowed)})"
    if row.key in off or row.section in off:  # model.lora: setting one of its keys turns it on
      line += "  (off: set one of its keys to turn it on)" if row.key in off else f"  (once {row.section} is set)"
    lines.append(line)
  return "\n".join(lines)


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def markdown() -> str:
  """The reference as Markdown: one table per section."""
  rows = reference()
  out = [
      "# Config reference",
      "",
      "<!-- Generated by `" + COMMAND + "`; do not edit by hand. -->",
      "",
      "Every key of a run's config (`rft-jax train`, `rft-jax plan`, `rft-jax demo`), generated from the",
      "dataclasses of `rft_jax/train/config.py` and the sections they nest: the type, the default, the",
      "values a key takes where its validator checks a fixed set (read from the same registries, so a",
      "registered token method or objective appears here), and the first sentence of its docstring entry.",
      "Set a key in the YAML file or on the command line (`learner.optim.lr=1e-6`); `rft-jax train --help`",
      "lists the same keys with their defaults and allowed values. How the settings fit together:",
      "[training runs](training.md), [methods and objectives](methods.md), [LoRA](lora.md),",
      "[scale](scale.md).",
      "",
  ]
  sections: list[str] = []  # in the walk's order, a section before those it nests
  present = {row.section for row in rows}
  for row in rows:
    parts = row.section.split(".")
    for i in range(1, len(parts) + 1):
      parent = ".".join(parts[:i])
      if parent in present and parent not in sections:
        sections.append(parent)
    if row.section not in sections:
      sections.append(row.section)
  for section in sections:
    title = "Top level" if not section else f"`{section}`"
    out += [f"## {title}", ""]
    if section:
      out += [section_title(section), ""]
    out += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for row in rows:
      if row.section != section:
        continue
      out.append(f"| `{row.key}` | {row.type} | `{_cell(shown(row.default))}` | "
                 f"{_cell(allowed_text(row))} | {_cell(row.meaning)} |")
    out.append("")
  return "\n".join(out)


def main(argv: Sequence[str] = ()) -> int:
  sys.stdout.write(markdown())
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
