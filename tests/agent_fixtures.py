"""A tiny word-level tokenizer for multi-turn tests: Qwen's chat markers, the number-guessing
game's words and the integers 1-64, so that a random tiny model sometimes guesses."""

from __future__ import annotations

from pathlib import Path

from hf_fixtures import CHAT_TEMPLATE


def make_agent_tokenizer(root: Path, vocab: int = 128) -> Path:
  """Saves the tokenizer under ``root/agent_tokenizer`` (vocabulary ``vocab``; ``<|im_end|>`` is
  id 2, the tiny models' end of sequence) and returns the directory."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  words = ["system", "user", "assistant", "\n", "Higher.", "Lower.", "Guess", "number"]
  words += [str(i) for i in range(1, 65)]
  table = {w: i for i, w in enumerate(specials + words)}
  table.update({f"w{i}": i for i in range(len(table), vocab)})
  tok = Tokenizer(models.WordLevel(table, unk_token="<|endoftext|>"))
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(pattern="\n", behavior="isolated"), pre_tokenizers.WhitespaceSplit()])
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", additional_special_tokens=specials[1:])
  fast.chat_template = CHAT_TEMPLATE
  out = Path(root) / "agent_tokenizer"
  fast.save_pretrained(out)
  return out
