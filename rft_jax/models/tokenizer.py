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


# How a question becomes a prompt (``data.chat_template``).
CHAT_TEMPLATE_MODES = ("auto", "chat", "none")


def prompt_token_ids(tokenizer: Any, question: str, system: str | None = None,
                     chat_template: str = "auto", **template_kwargs) -> list[int]:
  """Token ids of a question's prompt.

  ``chat_template``: ``chat`` applies the tokenizer's chat template (:func:`chat_token_ids`;
  an error naming the setting if it has none), ``none`` uses the plain text (the system
  message, a blank line, then the question; the tokenizer's own special tokens such as a BOS
  added), ``auto`` the template when the tokenizer has one, else the plain text.
  """
  if chat_template not in CHAT_TEMPLATE_MODES:
    raise ValueError(f"data.chat_template={chat_template!r} is not one of {list(CHAT_TEMPLATE_MODES)}")
  has_template = bool(getattr(tokenizer, "chat_template", None))
  if chat_template == "chat" and not has_template:
    raise CheckpointError(f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')}: no chat template; set "
                          f"data.chat_template=none (or auto) for plain-text prompts")
  if chat_template == "chat" or (chat_template == "auto" and has_template):
    return chat_token_ids(tokenizer, question, system, **template_kwargs)
  text = question if system is None else f"{system}\n\n{question}"
  return list(tokenizer(text, add_special_tokens=True)["input_ids"])
