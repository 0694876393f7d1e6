"""rft_jax's multi-turn pool as a contender of ``benchmarks/peers/multi_turn.py`` (runs in rft_jax's
own virtualenv).

multi_turn: the work of ``turns_work.py`` through :class:`rft_jax.sampling.turns.TurnPool`, one
row per trajectory (every trajectory decodes at once), driven as
:func:`rft_jax.rollout.multi_turn.run_trajectories` drives it with its environments' replies
scripted: a pool made per call (the weights laid out for decoding each time, as after a learner
step), every trajectory started with its prompt and its key (``completion_keys`` of the seed),
``pool.decode(decode_chunk)`` until every row's turn has ended (at its budget of
``turn_tokens`` draws), then each reply fed and the next turn. Temperature 1, no top-k / top-p,
no stop tokens. ``RFT_JAX_BENCH_KEEP_CACHE`` in the environment picks how a reply is fed:

* ``1`` (the default, ``rollout.keep_cache=True``): ``pool.resume``: the turn's last token and
  the reply appended to the row's kept KV cache;
* ``0`` (``rollout.keep_cache=False``): the whole history (prompt, turns, replies) fed again
  from an empty row, the draws so far kept: the history prefilled again every turn.

The two sample the same tokens (tests/test_sampling_turns.py); both return the model tokens
drawn. On CPU the decode attention kernel is built where it is not, as ``rft_runner.py`` does.
"""

from __future__ import annotations

import inspect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import turns_work  # noqa: E402
from common import serve  # noqa: E402
from rft_jax.models import load_hf  # noqa: E402
from rft_jax.models.decode import cpu_attention  # noqa: E402
from rft_jax.sampling import SamplingParams  # noqa: E402
from rft_jax.sampling.keys import completion_keys, prompt_fingerprints  # noqa: E402

try:  # the pool's host side has a module of its own since the paged multi-turn pool
  from rft_jax.sampling.turn_pool import TurnPool
except ImportError:  # before it
  from rft_jax.sampling.turns import TurnPool

# Re-prefill: `resume(..., again=True)` where the pool keeps the history on the host; before
# that, `free` and `start` with the whole history and the draws so far (what
# rft_jax.rollout.multi_turn did with keep_cache=False).
REFEED_BY_RESUME = "again" in inspect.signature(TurnPool.resume).parameters


SETTINGS: dict[str, str] = {}


def rollout(model, work: dict, temperature: float, keep: bool):
  """``run(seed, phases=None) -> model tokens drawn``: one call of ``work`` (see the module
  docstring). With a dict ``phases``, each turn's feed is sent alone and waited for, and its
  seconds go to ``phases["feed"]``, the turn's decode chunks' to ``phases["decode"]`` (one entry a
  turn; the feed is otherwise sent by the turn's first chunk)."""
  prompts, replies = work["prompts"], work["replies"]
  turns, new, chunk = work["turns"], work["turn_tokens"], work["decode_chunk"]
  rows = len(prompts)
  params = SamplingParams(n=1, temperature=temperature, max_new_tokens=new)
  width = turns_work.longest(work)

  def run(seed: int, phases: dict | None = None) -> int:
    keys = np.asarray(jax.random.key_data(completion_keys(
        jnp.uint32(seed), jnp.asarray(prompt_fingerprints(prompts)), 1)))
    pool = TurnPool(model, params, slots=rows, width=width)
    history = [[] for _ in range(rows)]  # the turns' and replies' tokens after the prompt
    drawn = [0] * rows
    for row in range(rows):
      pool.start(row, prompts[row], keys[row], new)
    for turn in range(turns):
      if phases is not None:
        start = time.perf_counter()
        pool._send_feeds()  # what the next decode call would send first
        jax.block_until_ready(pool.state)
        phases.setdefault("feed", []).append(time.perf_counter() - start)
      start = time.perf_counter()
      ended = 0
      while ended < rows:
        for row, (tokens, _, end) in pool.decode(chunk).items():
          history[row] += tokens
          drawn[row] += len(tokens)
          ended += end
      if phases is not None:
        phases.setdefault("decode", []).append(time.perf_counter() - start)
      if turn == turns - 1:
        break
      for row in range(rows):
        reply = replies[row][turn]
        if keep or REFEED_BY_RESUME:
          pool.resume(row, reply, new, **({} if keep else {"again": True}))
        else:
          pool.free(row)
          pool.start(row, prompts[row] + history[row] + reply, keys[row], new, drawn=drawn[row])
        history[row] += reply
    for row in range(rows):
      pool.free(row)
    return sum(drawn)
  return run


def setup(spec: dict) -> dict:
  if jax.default_backend() == "cpu":  # as `rft-jax build-kernels` (launch/local.sh) does
    cpu_attention.build()
  model = load_hf(spec["checkpoint"])
  work = turns_work.load(spec)
  keep = os.environ.get("RFT_JAX_BENCH_KEEP_CACHE", "1") != "0"
  SETTINGS.update({"keep_cache": str(keep), "decode_chunk": str(work["decode_chunk"]),
                   "rows": str(len(work["prompts"])), "width": str(turns_work.longest(work)),
                   "pool": TurnPool.__module__, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "unset")})
  return {"multi_turn": rollout(model, work, spec["temperature"], keep)}


if __name__ == "__main__":
  serve(setup, ("jax", "flax"), about=lambda: SETTINGS | {
      "CPU attention kernel": "on" if cpu_attention.available() else "off"})
