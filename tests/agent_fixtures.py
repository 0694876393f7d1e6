"""A tiny word-level tokenizer for multi-turn tests: Qwen's chat markers, the number-guessing
game's words and the integers 1-64, so that a random tiny model sometimes guesses."""

from __future__ import annotations

from pathlib import Path

from hf_fixtures import make_tiny_tokenizer


def make_agent_tokenizer(root: Path, vocab: int = 128) -> Path:
  """Saves the tokenizer under ``root/agent_tokenizer`` (vocabulary ``vocab``; ``<|im_end|>`` is
  id 2, the tiny models' end of sequence) and returns the directory."""
  words = ["Higher.", "Lower.", "Guess", "number"] + [str(i) for i in range(1, 65)]
  return make_tiny_tokenizer(root, vocab, words, name="agent_tokenizer")
