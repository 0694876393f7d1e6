"""Supervised fine-tuning on (question, response) pairs: the warm start before RL.

Each example becomes ``chat prompt + response + <|im_end|>``; the loss is the mean
negative log-likelihood of the response tokens (the prompt is context only), computed
with the same chunked ``token_stats`` pass as the learner, and optimised with AdamW
under a warmup-cosine schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rft_jax.entropy import token_stats


@dataclasses.dataclass
class SFTConfig:
  """Supervised fine-tuning settings."""

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
      raise ValueError(f"example {i}: {len(seq)} tokens exceed sft max_len={max_len}")
    ids[i, :len(seq)] = seq
    mask[i, len(p):len(seq)] = 1.0
    attention[i, :len(seq)] = 1
  return ids, mask, attention


def sft(model: nnx.Module, ids: np.ndarray, response_mask: np.ndarray, attention: np.ndarray,
        config: SFTConfig, log: Callable[[int, float], None] | None = None) -> nnx.Module:
  """Trains ``model`` in place on :func:`encode_pairs`' arrays; returns it."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, config.lr, config.warmup_steps, config.steps)
  optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=config.weight_decay), wrt=nnx.Param)

  def loss_fn(model, ids, mask, attn):
    hidden = model(ids, attn, return_hidden=True)
    stats = token_stats(hidden[:, :-1], ids[:, 1:], unembedding=model.unembedding())
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
      log(i, float(loss))
  return model
