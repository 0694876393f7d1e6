"""A conversation tokenized once, incrementally: the ids the sampler feeds are the ids the learner
trains on.

Re-tokenizing a finished transcript does not give back the ids a model produced and read: a
tokenizer may merge the model's last token with the next text differently, and some chat
templates re-render earlier turns (Qwen3's drops the reasoning of past assistant turns). So the
prompt is rendered once (:func:`prompt_ids`), the model's tokens are kept as drawn, and each
environment reply is rendered on its own (:func:`reply_ids`): the chat template's text for the
reply messages and the next generation prompt, found as the difference between a short
conversation's rendering with and without them (TRL's ``_get_tool_suffix_ids`` does the same),
after the text the template puts between the end of an assistant turn and the next message.
"""

from __future__ import annotations

from typing import Any, Sequence

Message = dict[str, Any]

_DUMMY = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]


class TemplateError(ValueError):
  """The chat template cannot render a conversation incrementally (or has no tool support)."""


def render(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict] | None,
           generation_prompt: bool) -> str:
  """``messages`` through the tokenizer's chat template, as text."""
  kwargs = {"tools": list(tools)} if tools else {}
  return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                       add_generation_prompt=generation_prompt, **kwargs)


def prompt_ids(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict] | None = None
               ) -> list[int]:
  """The first prompt: ``messages`` (with the ``tools``' schemas in the system turn) and the
  generation prompt."""
  return tokenizer.encode(render(tokenizer, messages, tools, True), add_special_tokens=False)


def turn_end_text(tokenizer: Any, stop_token: int, tools: Sequence[dict] | None = None) -> str:
  """The text the chat template writes after an assistant turn's end token ``stop_token`` and
  before the next message (``"\\n"`` for Qwen's ``<|im_end|>``); empty when the template does not
  end assistant turns with that token."""
  stop = tokenizer.decode([stop_token], skip_special_tokens=False)
  text = render(tokenizer, _DUMMY, tools, False)
  at = text.rfind(stop) if stop else -1
  return text[at + len(stop):] if at >= 0 else ""


def reply_ids(tokenizer: Any, messages: Sequence[Message], stop_token: int,
              tools: Sequence[dict] | None = None) -> list[int]:
  """The ids of an environment's reply ``messages`` that follow a model turn ended by
  ``stop_token``: the template's text after the turn's end, the messages, and the next
  generation prompt.

  Raises:
    TemplateError: the template renders earlier turns differently once the reply is appended
      (it is not prefix-preserving: use a training variant of it, as TRL's ``chat_templates``).
  """
  before = render(tokenizer, _DUMMY, tools, False)
  after = render(tokenizer, [*_DUMMY, *messages], tools, True)
  if not after.startswith(before):
    raise TemplateError(
        "the chat template renders earlier turns differently once a reply is appended (it is not "
        "prefix-preserving), so a multi-turn conversation cannot be tokenized incrementally; set "
        "rollout.chat_template to a prefix-preserving variant (e.g. TRL's qwen3_training.jinja)")
  text = turn_end_text(tokenizer, stop_token, tools) + after[len(before):]
  return tokenizer.encode(text, add_special_tokens=False)


def check_template(tokenizer: Any, stop_token: int, tools: Sequence[dict] = ()) -> None:
  """Raises :class:`TemplateError` where the chat template cannot tokenize a multi-turn
  conversation incrementally (a user's and, with ``tools``, a tool's reply, after an assistant
  turn ended by ``stop_token``): before a run, not at its first reply."""
  replies = [[{"role": "user", "content": "x"}]]
  if tools:
    replies.append([{"role": "tool", "content": "x"}])
  for messages in replies:
    reply_ids(tokenizer, messages, stop_token, tools)


def check_tool_support(tokenizer: Any, tools: Sequence[dict]) -> None:
  """Raises :class:`TemplateError` when the chat template ignores ``tools`` (their names do not
  appear in a rendered prompt)."""
  if not tools:
    return
  text = render(tokenizer, [{"role": "user", "content": "x"}], tools, True)
  missing = [t["function"]["name"] for t in tools if t["function"]["name"] not in text]
  if missing:
    raise TemplateError(f"the model's chat template has no tool support (tools {missing} do not "
                        "appear in a rendered prompt); use a model whose template renders tools=")
