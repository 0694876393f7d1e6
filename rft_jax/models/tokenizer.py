"""Tokenizer loading and the chat prompt of a question (Hugging Face ``AutoTokenizer``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rft_jax.models.errors import CheckpointError

# A directory with none of these holds no tokenizer: transformers would build an empty one from
# config.json alone (every text -> no tokens) instead of failing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_tokenizer_files(path: str | Path) -> None:
  """Raises :class:`CheckpointError` (naming ``path``) unless it holds tokenizer files."""
  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"{path}: no such model directory")
  if not any((path / name).is_file() for name in TOKENIZER_FILES):
    raise CheckpointError(f"{path}: no tokenizer (none of {', '.join(TOKENIZER_FILES)})")


def load_tokenizer(path: str | Path) -> Any:
  """``transformers.AutoTokenizer`` from a local model directory (no download).

  Raises:
    CheckpointError: no tokenizer files in ``path``, or files transformers cannot read.
  """
  from transformers import AutoTokenizer

  check_tokenizer_files(path)
  try:
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
  except (OSError, ValueError, KeyError, TypeError) as exc:
    text = str(exc).strip().splitlines()
    raise CheckpointError(f"{path}: the tokenizer cannot be loaded ({type(exc).__name__}"
                          f"{': ' + text[0] if text else ''})") from exc


def _messages(question: str, system: str | None) -> list[dict[str, str]]:
  messages = [] if system is None else [{"role": "system", "content": system}]
  return messages + [{"role": "user", "content": question}]


def apply_chat_template(tokenizer: Any, question: str, system: str | None = None,
                        **template_kwargs) -> str:
  """The prompt text: the chat template over ``[system?, user]`` plus the assistant header.

  ``template_kwargs`` reach the template (e.g. ``enable_thinking=False`` for Qwen3). Without a
  ``system`` message the template applies its own default (Qwen2.5 adds one, Qwen3 does not).
  """
  return tokenizer.apply_chat_template(_messages(question, system), tokenize=False,
                                       add_generation_prompt=True, **template_kwargs)


def chat_token_ids(tokenizer: Any, question: str, system: str | None = None,
                   **template_kwargs) -> list[int]:
  """Token ids of :func:`apply_chat_template` (no extra special tokens added)."""
  text = apply_chat_template(tokenizer, question, system, **template_kwargs)
  return list(tokenizer(text, add_special_tokens=False)["input_ids"])
