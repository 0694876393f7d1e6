"""A question's prompt tokens and the tokens that end an answer, as every sampler of the project
uses them (training, evaluation, filtering, attribution, fine-tuning)."""

from __future__ import annotations

from typing import Any

from rft_jax.data.config import DataConfig
from rft_jax.models.tokenizer import prompt_token_ids


def prompt_messages(data: DataConfig, question: str) -> list[dict[str, str]]:
  """A question's first chat messages, as :func:`prompt_ids` renders them: the system prompt if
  set, then the question with ``data.instruction`` appended (a multi-turn trajectory's start)."""
  text = f"{question} {data.instruction}".strip() if data.instruction else question
  system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
  return [*system, {"role": "user", "content": text}]


def prompt_ids(tokenizer: Any, data: DataConfig, question: str) -> list[int]:
  """A question's prompt: ``data.instruction`` appended, ``data.system_prompt`` if set, through
  the chat template or as plain text (``data.chat_template``)."""
  text = f"{question} {data.instruction}".strip() if data.instruction else question
  return prompt_token_ids(tokenizer, text, data.system_prompt, data.chat_template)


def stop_token_ids(tokenizer: Any, model_eos: Any = None) -> tuple[int, ...]:
  """End-of-sequence ids: the tokenizer's eos, the model config's, and Qwen's chat markers."""
  ids = set()
  for value in (tokenizer.eos_token_id, model_eos):
    if value is None:
      continue
    ids.update([value] if isinstance(value, int) else list(value))
  vocab = tokenizer.get_vocab()
  ids.update(vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab)
  return tuple(sorted(int(i) for i in ids))
