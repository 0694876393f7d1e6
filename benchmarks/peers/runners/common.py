"""What every contender's runner shares (standard library and numpy only: each runs in its peer's
virtualenv).

A runner is a long-lived subprocess of ``benchmarks/peers/peers.py``: it reads the work spec (a JSON
file written by the driver: checkpoint directory, prompts, sizes, the learner batch), builds its
contender once, then answers one command per line on stdin (``{"work": "rollout", "seed": 3}``)
with one JSON line on its private stdout: ``{"seconds": s, "tokens": n}`` or ``{"error": "..."}``.
Everything the libraries print goes to stderr (the driver keeps it in a log file), so that
stdout carries only the answers. The first command of each kind of work also compiles / warms
up; the driver reports it apart and excludes it from the medians.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np


def reward(completion: list[int], vocab: int) -> float:
  """The e2e step's reward, the same in every contender: the fraction of the completion's
  tokens in the lower half of the vocabulary (cheap, deterministic, varies across a group)."""
  return float(np.mean(np.asarray(completion) < vocab // 2)) if len(completion) else 0.0


def group_advantages(rewards: list[float], group: int, eps: float = 1e-4) -> np.ndarray:
  """GRPO's group z-score of rewards ordered group by group (unbiased std)."""
  r = np.asarray(rewards, np.float64).reshape(-1, group)
  return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + eps)).reshape(-1)


def load_batch(path: str) -> dict[str, np.ndarray]:
  """The learner batch (``synthetic_batch`` of ``benchmarks/speed/learner_step.py``, saved by the
  driver): input_ids, attention_mask, response_mask [32, 192]; advantages [32]; sampler_logp
  [32, 192]."""
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def split_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The batch as prompt / completion blocks (what TRL and tunix take): the first completion
  column is the first column of ``response_mask`` that is set anywhere."""
  start = int(np.argmax(batch["response_mask"].any(0)))
  return {"prompt_ids": batch["input_ids"][:, :start],
          "prompt_mask": batch["attention_mask"][:, :start],
          "completion_ids": batch["input_ids"][:, start:],
          "completion_mask": batch["response_mask"][:, start:].astype(np.int32),
          "sampler_logp": batch["sampler_logp"][:, start:], "advantages": batch["advantages"]}


def decode_steps(generate, rows: int, steps: int) -> dict:
  """One decode-step work (``peers.spec.DECODE``): ``generate(new)`` decodes ``new`` tokens on
  every row (no stops); the seconds of ``steps`` more steps, ``generate(4 + steps)`` less
  ``generate(4)``, so that prefill, dispatch and the first tokens cancel out."""
  start = time.perf_counter()
  generate(4)
  short = time.perf_counter() - start
  start = time.perf_counter()
  generate(4 + steps)
  return {"seconds": time.perf_counter() - start - short, "tokens": rows * steps}


def process_settings() -> dict[str, str]:
  """What every runner's process was started with that decides its speed: the libraries
  preloaded, the OpenMP threads, glibc's tunables."""
  preload = [os.path.basename(p) for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
  return {"LD_PRELOAD": " ".join(preload) or "none",
          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
          "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", "unset")}


def serve(setup, packages: tuple[str, ...], about=None) -> None:
  """Runs a runner: ``setup(spec)`` returns ``{work: fn(seed) -> tokens or None}``; each command
  is timed around ``fn`` (which must return only when its work is finished), unless ``fn``
  returns ``{"seconds": s, "tokens": n}`` (:func:`decode_steps`). The ready line
  carries the installed versions of ``packages`` and, after setup, ``about()``'s ``{name: text}``
  (what else decides the contender's speed)."""
  from importlib.metadata import version
  answers = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)  # library prints go to stderr
  sys.stdout = sys.stderr
  with open(sys.argv[1]) as f:
    spec = json.load(f)
  try:
    works = setup(spec)
    versions = ({p: version(p) for p in packages} | process_settings()
                | (about() if about else {}))
    answers.write(json.dumps({"ready": sorted(works), "versions": versions}) + "\n")
  except Exception as e:  # noqa: BLE001 - the driver prints the reason in the table
    traceback.print_exc()
    answers.write(json.dumps({"error": f"setup: {type(e).__name__}: {e}"[:300]}) + "\n")
    return
  for line in sys.stdin:
    command = json.loads(line)
    fn = works.get(command["work"])
    if fn is None:
      answers.write(json.dumps({"error": "not supported"}) + "\n")
      continue
    try:
      start = time.perf_counter()
      out = fn(int(command["seed"]))
      if not isinstance(out, dict):  # a work that times itself returns {"seconds", "tokens"}
        out = {"seconds": time.perf_counter() - start, "tokens": out}
      answers.write(json.dumps(out) + "\n")
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      answers.write(json.dumps({"error": f"{type(e).__name__}: {e}"[:300]}) + "\n")
