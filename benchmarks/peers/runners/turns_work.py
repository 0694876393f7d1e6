"""The multi-turn work of ``benchmarks/peers/multi_turn.py``, the same for every contender
(standard library and numpy only: the runners read it in their own virtualenvs).

A trajectory is a prompt, then ``turns`` model turns of exactly ``turn_tokens`` new tokens each
(no stop token: every engine draws the same number of tokens), a scripted reply after each turn
but the last (a tool's output: ``reply_tokens`` random tokens, drawn once with the work's seed):

    prompt | turn 1 | reply 1 | turn 2 | reply 2 | turn 3 | reply 3 | turn 4

The driver writes it as ``turns.json`` beside the spec (``runners/spec.py``); a runner finds it
beside its checkpoint (:func:`load`).
"""

from __future__ import annotations

import json
import os

import numpy as np

FILE = "turns.json"


def make(vocab: int, trajectories: int, prompt_tokens: tuple[int, int], turns: int,
         turn_tokens: int, reply_tokens: tuple[int, int], decode_chunk: int,
         seed: int = 30) -> dict:
  """The work: ``trajectories`` prompts of ``prompt_tokens`` (lo, hi) random tokens, and for
  each, ``turns - 1`` replies of ``reply_tokens`` (lo, hi); token ids from 3 (past the pad, BOS
  and EOS of ``spec.py``'s checkpoints). ``decode_chunk``: rft_jax's decode steps between the
  host's visits (``rollout.decode_chunk``)."""
  rng = np.random.default_rng(seed)

  def draw(lo: int, hi: int) -> list[int]:
    return rng.integers(3, vocab, rng.integers(lo, hi + 1)).tolist()

  prompts = [draw(*prompt_tokens) for _ in range(trajectories)]
  replies = [[draw(*reply_tokens) for _ in range(turns - 1)] for _ in range(trajectories)]
  return {"prompts": prompts, "replies": replies, "turns": turns, "turn_tokens": turn_tokens,
          "decode_chunk": decode_chunk}


def longest(work: dict) -> int:
  """The most tokens a trajectory holds at its end (prompt, turns and replies)."""
  return max(len(p) + work["turns"] * work["turn_tokens"] + sum(map(len, r))
             for p, r in zip(work["prompts"], work["replies"]))


def generated(work: dict) -> int:
  """The model tokens of one run: every trajectory's turns."""
  return len(work["prompts"]) * work["turns"] * work["turn_tokens"]


def save(directory: str, work: dict) -> str:
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, FILE)
  with open(path, "w") as f:
    json.dump(work, f)
  return path


def load(spec: dict) -> dict:
  """The work beside the spec's checkpoint directory."""
  with open(os.path.join(os.path.dirname(spec["checkpoint"].rstrip("/")), FILE)) as f:
    return json.load(f)
