"""Supervised fine-tuning on (question, response) pairs: the warm start before RL.

Each example becomes ``chat prompt + response + <|im_end|>``; the loss is the mean
negative log-likelihood of the response tokens (the prompt is context only), computed
with the same chunked ``token_stats`` pass as the learner, and optimised with AdamW
under a warmup-cosine schedule. :func:`sft_files` is ``rft-jax sft``: an HF model
directory and a JSONL of pairs in, an HF model directory out.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rft_jax.data.config import DataConfig
from rft_jax.data.prompts import prompt_ids
from rft_jax.entropy import token_stats


@dataclasses.dataclass
class SFTConfig:
  """Supervised fine-tuning settings (``max_len``: prompt + response tokens per example)."""

  steps: int = 1000
  batch_size: int = 64
  lr: float = 3e-3
  warmup_steps: int = 50
  weight_decay: float = 0.01
  max_len: int = 96
  seed: int = 0


def encode_pairs(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                 max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Right-padded ``[N, max_len]`` token ids, response-token mask and attention mask."""
  ids = np.zeros((len(prompt_ids), max_len), np.int32)
  mask = np.zeros((len(prompt_ids), max_len), np.float32)
  attention = np.zeros((len(prompt_ids), max_len), np.int32)
  for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
    seq = list(p) + list(r)
    if len(seq) > max_len:
      raise ValueError(f"row {i}: {len(seq)} tokens (chat prompt + response) exceed max_len={max_len}")
    ids[i, :len(seq)] = seq
    mask[i, len(p):len(seq)] = 1.0
    attention[i, :len(seq)] = 1
  return ids, mask, attention


def sft(model: nnx.Module, ids: np.ndarray, response_mask: np.ndarray, attention: np.ndarray,
        config: SFTConfig, log: Callable[[int, float], None] | None = None) -> nnx.Module:
  """Trains ``model`` in place on :func:`encode_pairs`' arrays; returns it. ``log`` is called
  after each step with its number (from 1, as a run's steps: :mod:`rft_jax.train.step_numbers`)
  and loss."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, config.lr, config.warmup_steps, config.steps)
  optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=config.weight_decay), wrt=nnx.Param)

  def loss_fn(model, ids, mask, attn):
    hidden = model(ids, attn, return_hidden=True)
    stats = token_stats(hidden[:, :-1], ids[:, 1:], unembedding=model.unembedding(), product_dtype=model.config.dtype)
    target = mask[:, 1:]
    return -jnp.sum(stats.logp * target) / jnp.maximum(jnp.sum(target), 1.0)

  @nnx.jit
  def step(model, optimizer, ids, mask, attn):
    loss, grads = nnx.value_and_grad(loss_fn)(model, ids, mask, attn)
    optimizer.update(model, grads)
    return loss

  rng = np.random.default_rng(config.seed)
  for i in range(config.steps):
    rows = rng.integers(0, len(ids), size=config.batch_size)
    loss = step(model, optimizer, jnp.asarray(ids[rows]), jnp.asarray(response_mask[rows]),
                jnp.asarray(attention[rows]))
    if log is not None:
      log(i + 1, float(loss))
  return model


def end_of_turn_id(tokenizer, eos_token_id: int | Sequence[int] | None) -> int:
  """The token that closes an assistant turn: ``<|im_end|>`` (Qwen's chat format) when the
  tokenizer has it, else the model's (first) end-of-sequence id."""
  im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
  if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
    return im_end
  if eos_token_id is None:
    raise ValueError("sft: the tokenizer has no <|im_end|> and the model config no eos_token_id")
  return eos_token_id if isinstance(eos_token_id, int) else list(eos_token_id)[0]


def sft_files(model_path: str, data_path: str, out: str, config: SFTConfig, *,
              question_field: str = "question", response_field: str = "response",
              log: Callable[[int, float], None] | None = None,
              prompt: DataConfig | None = None) -> nnx.Module:
  """Fine-tunes the HF model at ``model_path`` on the JSONL (or parquet) pairs at ``data_path``
  and saves model and tokenizer to ``out`` in HF form; returns the model.

  Each row needs a non-empty ``question_field`` (the user turn, prompted exactly as a training
  run with the data settings ``prompt`` would: its instruction, system prompt and chat
  template; default: the training defaults) and ``response_field`` (the assistant turn); a row
  without one is an error
  naming the file, row and field, and an example longer than ``config.max_len`` tokens one
  naming its row.
  """
  from rft_jax.data import DatasetError, load_math_dataset
  from rft_jax.models import load_hf, load_tokenizer, save_hf

  tokenizer = load_tokenizer(model_path)
  model = load_hf(model_path)
  examples, _ = load_math_dataset(data_path, "jsonl", question_field=question_field,
                                  answer_field=response_field,
                                  field_settings=("--question-field", "--response-field"))
  end = end_of_turn_id(tokenizer, model.config.eos_token_id)
  prompt = DataConfig() if prompt is None else prompt
  prompts = [prompt_ids(tokenizer, prompt, e.question) for e in examples]
  responses = [tokenizer(e.answer, add_special_tokens=False)["input_ids"] + [end]
               for e in examples]
  try:
    ids, mask, attention = encode_pairs(prompts, responses, config.max_len)
  except ValueError as exc:  # an over-long example, named by its row
    raise DatasetError(f"{data_path}: {exc}") from exc
  sft(model, ids, mask, attention, config, log)
  save_hf(model, out, tokenizer=tokenizer)
  return model
