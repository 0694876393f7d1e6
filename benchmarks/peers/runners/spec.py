"""The work every contender of ``benchmarks/peers/peers.py`` is given: one random Qwen3 checkpoint
(saved by transformers, so each library loads the same weights its own way), a word-level
tokenizer for the libraries that want text, the prompts and the learner batch."""

from __future__ import annotations

import json
import os

import numpy as np

from speed.learner_step import MODELS, synthetic_batch

ROLLOUT_PROMPTS = 32
GROUPS, GROUP_SIZE = 8, 4  # e2e: 8 prompts x 4 samples = 32 rows
NEW_TOKENS = 128
PAD, BOS, EOS = 0, 1, 2


def build_checkpoint(path: str, model: str) -> None:
  """A random float32 Qwen3 of size ``model`` (tied embeddings) and its tokenizer, in ``path``."""
  import torch
  from transformers import Qwen3Config, Qwen3ForCausalLM
  from transformers.utils import logging

  logging.set_verbosity_error()
  sizes = MODELS[model]
  config = Qwen3Config(**sizes, tie_word_embeddings=True, max_position_embeddings=4096,
                       bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, dtype="float32",
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})
  torch.manual_seed(0)
  Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(path)
  word_level_tokenizer(sizes["vocab_size"]).save_pretrained(path)


def word_level_tokenizer(vocab: int):
  """Token ``i >= 3`` is the word ``w{i}``: text ``"w5 w17"`` is exactly the ids ``[5, 17]``."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  words = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, vocab)}}
  tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
  return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                 eos_token="</s>", padding_side="left")


def prompts(count: int, vocab: int, seed: int, lo: int = 16, hi: int = 48) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, rng.integers(lo, hi + 1)).tolist() for _ in range(count)]


# Long-tailed rollouts (benchmarks/peers/longtail.py): work -> (prompts, samples each, most new
# tokens).
LONGTAIL = {"longtail_128": (16, 8, 1024), "longtail_512": (64, 8, 512)}
STOP_EVERY = 200  # a near-uniform random model emits one of vocab / 200 stop ids once in ~200 steps


def longtail_prompts(work: str, vocab: int) -> list[list[int]]:
  """The prompts of the long-tailed ``work`` (:data:`LONGTAIL`), the same in every contender's
  spec and in ``benchmarks/speed/longtail_trace.py``."""
  return prompts(LONGTAIL[work][0], vocab, seed=2 + list(LONGTAIL).index(work))


# Decode steps at fixed batch sizes (benchmarks/peers/decode_steps.py): work -> rows, each on its
# own prompt of DECODE_PROMPT tokens, timed over DECODE_STEPS steps.
DECODE = {"decode_1": 1, "decode_8": 8, "decode_32": 32, "decode_64": 64, "decode_128": 128}
DECODE_PROMPT, DECODE_STEPS = 100, 128


def stop_token_ids(vocab: int) -> list[int]:
  """The long-tailed works' stop tokens: ``vocab / STOP_EVERY`` ids from EOS on, so that a row of
  a random model (whose next-token distribution is nearly uniform) stops at each step with
  probability about ``1 / STOP_EVERY``: completion lengths about geometric, mean ~200, a few
  reaching the limit, as RL rollouts are."""
  return list(range(EOS, EOS + vocab // STOP_EVERY))


def write_spec(model: str, root: str, threads: int, longtail: bool = False,
               scheduler: str = "continuous", decode_slots: int | None = None,
               decode: bool = False) -> str:
  """Writes the checkpoint, batch and spec under ``root``; returns the spec's path.
  ``longtail``: with the long-tailed works (:data:`LONGTAIL`); ``decode``: with the decode-step
  works (:data:`DECODE`); ``scheduler`` and
  ``decode_slots``: rft_jax's sampler settings (``SamplingParams``)."""
  os.makedirs(root, exist_ok=True)
  checkpoint = os.path.join(root, "checkpoint")
  build_checkpoint(checkpoint, model)
  vocab = MODELS[model]["vocab_size"]
  batch = synthetic_batch(vocab)
  batch_path = os.path.join(root, "batch.npz")
  np.savez(batch_path, **{k: np.asarray(getattr(batch, k)) for k in
                          ("input_ids", "attention_mask", "response_mask", "advantages",
                           "sampler_logp")})
  spec = {"model": model, "checkpoint": checkpoint, "vocab_size": vocab, "batch": batch_path,
          "rollout_prompts": prompts(ROLLOUT_PROMPTS, vocab, seed=0),
          "group_prompts": prompts(GROUPS, vocab, seed=1), "group_size": GROUP_SIZE,
          "new_tokens": NEW_TOKENS, "temperature": 1.0, "lr": 1e-5, "threads": threads,
          "longtail": {work: {"prompts": longtail_prompts(work, vocab), "n": n, "new_tokens": new}
                       for work, (_, n, new) in LONGTAIL.items() if longtail},
          "decode": {work: {"prompts": prompts(rows, vocab, seed=20 + i, lo=DECODE_PROMPT,
                                               hi=DECODE_PROMPT), "steps": DECODE_STEPS}
                     for i, (work, rows) in enumerate(DECODE.items()) if decode},
          "stop_token_ids": stop_token_ids(vocab), "scheduler": scheduler,
          "decode_slots": decode_slots}
  path = os.path.join(root, "spec.json")
  with open(path, "w") as f:
    json.dump(spec, f)
  return path
