"""Multi-turn rollouts: the model's turns decoded in a pool of rows, each ended turn handed to its
trajectory's environment in a worker process while the other rows keep decoding, each reply
appended to its row's KV cache when it comes.

The host loop, around :class:`~rft_jax.sampling.turns.TurnPool`:

1. every trajectory's environment starts (``init``) in the workers; its messages, with the tools'
   schemas, are the prompt (:func:`~rft_jax.rollout.conversation.prompt_ids`);
2. free rows take waiting trajectories; the pool decodes a chunk of ``rollout.decode_chunk``
   steps; each row whose turn ended (a stop token) pauses, and its turn's text goes to its
   environment's ``step``, asynchronously;
3. replies that have come back are tokenized on their own
   (:func:`~rft_jax.rollout.conversation.reply_ids`) and queued to their rows; a trajectory the
   environment ended, or that a limit ends, frees its row; the next chunk feeds the replies
   (the history stays in the row's cache: ``rollout.keep_cache``; otherwise the whole history
   is fed again, the same samples);
4. when nothing runs, the loop waits for the next reply; it ends when every trajectory has.

Limits end a trajectory cleanly, recorded as truncated: ``rollout.max_turns`` model turns, and
``rollout.max_trajectory_tokens`` tokens after the prompt (a turn cut at the budget, or a reply
that would not leave the model one token). An environment that fails (raises, times out,
returns something malformed) ends its trajectory as an error, counted
(:class:`EnvironmentCounts`); the step's caller bounds their fraction.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rft_jax.environments import EnvironmentSpec, EnvironmentWorkers
from rft_jax.rollout.config import RolloutConfig
from rft_jax.rollout.conversation import prompt_ids, reply_ids
from rft_jax.rollout.trajectory import Trajectories, Trajectory
from rft_jax.sampling.keys import completion_keys, prompt_fingerprints
from rft_jax.sampling.params import SamplingParams
from rft_jax.sampling.turn_pool import TurnPool


@dataclasses.dataclass(frozen=True)
class Problem:
  """A problem's first messages and its environment's per-row arguments (``extras``)."""

  messages: list[dict]
  extras: dict[str, Any]


def run_trajectories(model, tokenizer: Any, problems: Sequence[Problem], params: SamplingParams,
                     cfg: RolloutConfig, workers: EnvironmentWorkers, *, seed: int,
                     tools: Sequence[dict] = (), mesh: Mesh | None = None) -> Trajectories:
  """``params.n`` trajectories of every problem (problem order, then sample order).

  Args:
    model: the policy (:class:`~rft_jax.models.Qwen`).
    tokenizer: its tokenizer, with the chat template the prompts are rendered with.
    problems: the problems.
    params: the sampler's settings (``n``, temperature, stop tokens; ``decode_slots`` bounds the
      rows decoding at once; ``max_new_tokens`` is the token budget unless the config sets one).
    cfg: the ``rollout:`` settings.
    workers: the environments' host; each trajectory's environment is ``cfg.environment`` with
      ``cfg.environment_config``, and its problem's ``extras``.
    seed: the trajectories' keys are those :func:`~rft_jax.sampling.generate` gives the same
      prompts and seed, so a first turn is the single-turn completion.
    tools: the tools' JSON schemas, rendered into the prompt.
    mesh: where the model lives.
  """
  n = params.n
  trajectories = Trajectories(Trajectory(problem=b, sample=j) for b in range(len(problems))
                              for j in range(n))
  budget = params.max_new_tokens if cfg.max_trajectory_tokens is None else cfg.max_trajectory_tokens
  spec = EnvironmentSpec(cfg.environment, cfg.environment_spec_config())
  started = {i: workers.start(i, spec, problems[t.problem].messages, problems[t.problem].extras)
             for i, t in enumerate(trajectories)}
  for i, future in started.items():
    outcome = future.result()
    t = trajectories[i]
    if outcome.status != "ok":
      _fail(t, outcome)
      continue
    t.prompt_ids = prompt_ids(tokenizer, outcome.output["observations"], tools)
  first = [trajectories[b * n].prompt_ids or [0] for b in range(len(problems))]
  keys = np.asarray(jax.random.key_data(completion_keys(
      jnp.uint32(seed), jnp.asarray(prompt_fingerprints(first)), n)))
  waiting = collections.deque(i for i, t in enumerate(trajectories) if t.ending is None)
  longest = max((len(t.prompt_ids) for t in trajectories), default=1)
  slots = min(len(waiting), params.decode_slots or len(waiting)) or 1
  pool = TurnPool(model, params, slots=slots, width=longest + budget, mesh=mesh)
  free, row_of, steps = list(range(slots)), {}, {}
  at_row = {}  # row -> its trajectory
  while waiting or row_of:
    while free and waiting:  # new trajectories into free rows
      i = waiting.popleft()
      row_of[i] = row = free.pop(0)
      at_row[row] = i
      pool.start(row, trajectories[i].prompt_ids, keys[i], budget)
    for row, (tokens, logprobs, ended) in pool.decode(cfg.decode_chunk).items():
      i = at_row[row]
      t = trajectories[i]
      _model_tokens(t, tokens, logprobs, ended, tokenizer)
      if not ended:
        continue
      if len(t.ids) >= budget and not _stopped(t, params):
        _end(t, "truncated", workers, i, pool, row, free, row_of)
      else:
        steps[workers.step(i, t.turns[-1].text)] = i
    if steps and not pool.running and not pool.queued:  # nothing decodes: wait for a reply
      concurrent.futures.wait(list(steps), return_when=concurrent.futures.FIRST_COMPLETED)
    for future in [f for f in steps if f.done()]:
      i = steps.pop(future)
      _reply(trajectories[i], i, future.result(), cfg, budget, tokenizer, tools, params, workers,
             pool, row_of, free)
  trajectories.evictions = pool.evictions
  return trajectories


def _model_tokens(t: Trajectory, tokens: list[int], logprobs: list[float], ended: bool,
                  tokenizer) -> None:
  """Appends a chunk's tokens to the trajectory's model turn (a new one after the environment's
  reply, or at the start); an ended turn gets its text."""
  if not t.turns or t.turns[-1].role != "assistant":
    t.add("assistant", [], "", [])
  turn = t.turns[-1]
  t.ids += tokens
  t.mask += [1] * len(tokens)
  t.logprobs += logprobs
  turn.end = len(t.ids)
  if ended:
    turn.text = tokenizer.decode(t.ids[turn.start:turn.end], skip_special_tokens=True)


def _stopped(t: Trajectory, params: SamplingParams) -> bool:
  return bool(t.ids) and t.ids[-1] in params.stop_token_ids


def _reply(t: Trajectory, i: int, outcome, cfg: RolloutConfig, budget: int, tokenizer, tools,
           params: SamplingParams, workers, pool: TurnPool, row_of: dict, free: list) -> None:
  """What the environment answered to trajectory ``i``'s last turn: the trajectory ends, or its
  reply goes to its row."""
  row = row_of[i]
  if outcome.status != "ok":
    _fail(t, outcome)
    _end(t, "error", workers, i, pool, row, free, row_of)
    return
  out = outcome.output
  t.rewards.append(float(out["reward"]))
  t.metadata.append(dict(out.get("metadata") or {}))
  if out["done"]:
    _end(t, "done", workers, i, pool, row, free, row_of)
    return
  if t.model_turns >= cfg.max_turns or not _stopped(t, params):
    _end(t, "truncated", workers, i, pool, row, free, row_of)
    return
  reply = reply_ids(tokenizer, out["observations"], t.ids[-1], tools)
  left = budget - len(t.ids) - len(reply)
  if not reply or left < 1:  # no room for the reply and one more token of the model's
    _end(t, "truncated", workers, i, pool, row, free, row_of)
    return
  t.add("environment", reply, "".join(m.get("content", "") for m in out["observations"]),
        messages=list(out["observations"]))
  pool.resume(row, reply, left, again=not cfg.keep_cache)


def _fail(t: Trajectory, outcome) -> None:
  t.ending, t.error, t.error_kind = "error", outcome.error, outcome.status


def _end(t: Trajectory, ending: str, workers, i: int, pool: TurnPool, row: int, free: list,
         row_of: dict) -> None:
  if t.ending is None:
    t.ending = ending
  workers.close(i)
  pool.free(row)
  free.append(row)
  del row_of[i]
