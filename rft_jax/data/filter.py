"""The paper's pass-rate filter: keep questions a model neither always nor never solves.

``k`` answers are sampled per question; a question is dropped when its pass rate is
``<= low`` (default 1/16) or ``>= high`` (default 15/16). The kept set and every
question's pass rate are written as JSONL.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from rft_jax.data import MathExample


def pass_rate_filter(problems: Sequence[MathExample], correct: np.ndarray, *, low: float = 1 / 16,
                     high: float = 15 / 16) -> tuple[list[MathExample], np.ndarray]:
  """``(kept, pass_rates)`` for a ``[P, k]`` correctness matrix."""
  if correct.shape[0] != len(problems):
    raise ValueError(f"{correct.shape[0]} rows of results for {len(problems)} problems")
  if not 0 <= low < high <= 1:
    raise ValueError(f"need 0 <= low < high <= 1, got low={low}, high={high}")
  rates = correct.mean(axis=1)
  kept = [p for p, r in zip(problems, rates) if low < r < high]
  return kept, rates


def write_filtered(out_dir: str, problems: Sequence[MathExample], rates: np.ndarray,
                   kept: Sequence[MathExample]) -> tuple[str, str]:
  """Writes ``kept.jsonl`` (question, answer, id) and ``pass_rates.jsonl``; returns both paths."""
  os.makedirs(out_dir, exist_ok=True)
  kept_path, rates_path = os.path.join(out_dir, "kept.jsonl"), os.path.join(out_dir, "pass_rates.jsonl")
  with open(kept_path, "w") as f:
    f.writelines(json.dumps({"question": p.question, "answer": p.answer, "id": p.id}) + "\n" for p in kept)
  with open(rates_path, "w") as f:
    f.writelines(json.dumps({"id": p.id, "pass_rate": float(r)}) + "\n" for p, r in zip(problems, rates))
  return kept_path, rates_path
