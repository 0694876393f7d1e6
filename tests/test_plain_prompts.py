"""Prompts without a chat template: data.chat_template auto | chat | none."""

import pytest

from hf_fixtures import make_tiny_tokenizer
from rft_jax.models import CheckpointError, chat_token_ids, load_tokenizer
from rft_jax.models.tokenizer import prompt_token_ids


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
  path = make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
  with_template = load_tokenizer(path)
  plain = load_tokenizer(path)
  plain.chat_template = None
  return with_template, plain


def test_auto_uses_the_template_when_there_is_one(tokenizers):
  with_template, plain = tokenizers
  assert prompt_token_ids(with_template, "what is 1+1 ?") == chat_token_ids(with_template, "what is 1+1 ?")
  assert prompt_token_ids(plain, "what is 1+1 ?") == plain("what is 1+1 ?")["input_ids"]


def test_none_is_plain_text_with_the_system_message_first(tokenizers):
  with_template, _ = tokenizers
  ids = prompt_token_ids(with_template, "what is 1+1 ?", "be brief", chat_template="none")
  assert with_template.decode(ids) == with_template.decode(with_template("be brief\n\nwhat is 1+1 ?")["input_ids"])
  assert "<|im_start|>" not in with_template.decode(ids)


def test_chat_without_a_template_is_an_error_naming_the_setting(tokenizers):
  _, plain = tokenizers
  with pytest.raises(CheckpointError, match="data.chat_template=none"):
    prompt_token_ids(plain, "what", chat_template="chat")
  with pytest.raises(ValueError, match="data.chat_template='jinja'"):
    prompt_token_ids(plain, "what", chat_template="jinja")
