"""A character-level tokenizer with Qwen's chat markers, saved in Hugging Face form.

Small enough for a demo model, but a real ``tokenizer.json`` + chat template loaded by
``transformers.AutoTokenizer`` exactly like a Qwen tokenizer.
"""

from __future__ import annotations

import string

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHARACTERS = string.digits + string.ascii_letters + " +-=?.,:;!()[]{}\\/*^_'\"\n<>|$%&#@"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_char_tokenizer(out_dir: str):
  """Writes the tokenizer to ``out_dir`` and returns it (a ``PreTrainedTokenizerFast``)."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
  for ch in CHARACTERS:
    vocab.setdefault(ch, len(vocab))
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
  # Every character is its own token (special tokens are matched first by the tokenizer).
  tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  tok.decoder = decoders.Fuse()
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=list(SPECIAL_TOKENS[1:]))
  fast.chat_template = CHAT_TEMPLATE
  fast.save_pretrained(out_dir)
  return fast
