"""The host's handle on a multi-turn pool (:mod:`rft_jax.sampling.turns`): queue feeds, run decode
chunks, read the turns.

::

  pool = TurnPool(model, params, slots=64, width=4096)
  pool.start(row, prompt_ids, key, budget)     # a new trajectory in a free row
  turns = pool.decode(32)                       # {row: (tokens, logprobs, ended)} of the chunk
  pool.resume(row, reply_ids, budget)           # an environment's reply, then the model again
  pool.free(row)                                # the trajectory is over

The pool keeps each row's history on the host (its tokens so far, its key, its draws): feeds
queue there and go to the devices in one :func:`~rft_jax.sampling.turns.feed` call before the
next chunk. A row's cache holds its history but the last token, which its next decode step
feeds. With a paged cache (``sampling.kv_pages``) the pool also keeps the block tables
(:class:`~rft_jax.sampling.turn_pages.PageTable`): pages are given as rows grow, and when they
run short the youngest trajectories' pages are taken back (*evicted*); an evicted row's whole
history is fed again once pages are free (the same samples: its draws' random numbers follow
its count). Evictions are counted (:attr:`TurnPool.evictions`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rft_jax.parallel import Rules
from rft_jax.sampling.params import SamplingParams
from rft_jax.sampling.turn_pages import PageTable
from rft_jax.sampling.turns import TurnSpec, decode_for, decode_model, empty_state, feed, feed_width


@dataclasses.dataclass
class _Row:
  """A row's trajectory on the host: its tokens so far, key, draws and draws left; ``cached``:
  its cache holds ``tokens[:-1]`` (False once evicted, or before the first feed)."""

  tokens: list[int]
  key: np.ndarray
  drawn: int
  left: int
  order: int
  cached: bool = False
  fed: int = 0  # of tokens, those a queued feed appends (0: the whole history, from empty)


class TurnPool:
  """A pool of ``slots`` rows of at most ``width`` tokens (prompt and everything after it)."""

  def __init__(self, model, params: SamplingParams, *, slots: int, width: int,
               mesh: Mesh | None = None, rules: Rules = (), cache_dtype=None):
    self.graphdef, state = nnx.split(model)
    self.spec = TurnSpec.of(params, slots, width, cache_dtype)
    self.params, self.mesh, self.rules = params, mesh, rules
    self.model_state = decode_model(self.graphdef, state, mesh=mesh)
    self.state = empty_state(model.config, self.spec)
    self.pages = (None if params.kv_pages is None else
                  PageTable(params.kv_pages, self.spec.page_size, slots, self.spec.pages_per_row))
    self.rows: dict[int, _Row] = {}
    self.queued: dict[int, bool] = {}  # rows whose feed waits for the next decode
    self.running: set[int] = set()
    self.evictions = 0
    self._started = 0

  @property
  def width(self) -> int:
    return self.spec.width

  def start(self, row: int, prompt: list[int], key_data, budget: int) -> None:
    """Row ``row`` starts a trajectory: ``prompt`` (at least one token), ``key_data`` (``[2]``
    uint32) its key, ``budget`` the tokens it may draw."""
    if row in self.rows:
      raise ValueError(f"TurnPool: row {row} holds a trajectory; free it first")
    if not prompt:
      raise ValueError(f"TurnPool: row {row} starts from no tokens")
    self.rows[row] = _Row(list(prompt), np.asarray(key_data, np.uint32), 0, budget, self._started)
    self._started += 1
    self.queued[row] = True

  def resume(self, row: int, tokens: list[int], budget: int, *, again: bool = False) -> None:
    """Paused row ``row`` goes on: ``tokens`` (an environment's reply, at least one) appended to
    its history, then the model draws again, ``budget`` tokens at most. ``again``: feed the whole
    history again instead of appending to the kept cache (``rollout.keep_cache=false``: the
    same samples)."""
    r = self.rows.get(row)
    if r is None or row in self.running or row in self.queued:
      raise ValueError(f"TurnPool: row {row} has no ended turn to resume")
    if not tokens:
      raise ValueError(f"TurnPool: row {row} resumed with no tokens")
    r.tokens += list(tokens)
    r.left = budget
    if again and r.cached:
      r.cached = False
      if self.pages is not None:
        self.pages.release(row)
    r.fed = len(tokens) + 1 if r.cached else 0  # its last drawn token and the reply
    self.queued[row] = True

  def free(self, row: int) -> None:
    """Row ``row``'s trajectory is over: the row may start another."""
    self.rows.pop(row, None)
    self.queued.pop(row, None)
    self.running.discard(row)
    if self.pages is not None:
      self.pages.release(row)

  def decode(self, steps: int) -> dict[int, tuple[list[int], list[float], bool]]:
    """Sends the queued feeds, then up to ``steps`` decode steps; returns, for every row that
    ran, its new tokens, their log-probabilities and whether its turn ended (the row paused)."""
    self._send_feeds()
    if self.pages is not None:
      self._give_pages(steps)
    if not self.running:
      return {}
    active = np.zeros((self.spec.slots,), bool)
    active[list(self.running)] = True
    pages = None if self.pages is None else self.pages.table
    self.state, chunk = decode_for(self.mesh)(
        self.graphdef, self.model_state, self.state, jnp.float32(self.params.temperature or 1.0),
        jnp.int32(self.params.top_k), jnp.float32(self.params.top_p), active, pages,
        steps=steps, spec=self.spec, mesh=self.mesh, rules=self.rules)
    tokens, logprobs, drawn, running = jax.device_get(
        (chunk.tokens, chunk.logprobs, chunk.drawn, self.state.running))
    out = {}
    for row in sorted(self.running):
      k, r = int(drawn[row]), self.rows[row]
      r.tokens += tokens[row, :k].tolist()
      r.drawn, r.left = r.drawn + k, r.left - k
      out[row] = (tokens[row, :k].tolist(), logprobs[row, :k].tolist(), not bool(running[row]))
      if not running[row]:
        self.running.discard(row)
    return out

  def _send_feeds(self) -> None:
    fed = [row for row in sorted(self.queued, key=lambda x: self.rows[x].order)
           if self._pages_for(row, len(self.rows[row].tokens) - 1)]
    if not fed:
      return
    f = min(1 << (len(fed) - 1).bit_length(), self.spec.slots)  # a power of two, or all rows
    fed += [fed[0]] * (f - len(fed))  # the first row again: the same values written twice
    pieces = [self._feed_tokens(row) for row in fed]
    ids = np.zeros((f, feed_width(max(max(len(x) for x in pieces), 1))), np.int32)
    rows, lengths, last, budget, counts = (np.zeros((f,), np.int32) for _ in range(5))
    restart, keys = np.zeros((f,), bool), np.zeros((f, 2), np.uint32)
    for i, (row, piece) in enumerate(zip(fed, pieces)):
      r = self.rows[row]
      ids[i, :len(piece)] = piece
      rows[i], lengths[i], last[i], budget[i] = row, len(piece), r.tokens[-1], r.left
      restart[i], keys[i], counts[i] = not r.cached, r.key, r.drawn
    self.state = feed(self.graphdef, self.model_state, self.state, rows, restart, keys, counts,
                      ids, lengths, last, budget,
                      None if self.pages is None else self.pages.table, spec=self.spec)
    for row in set(fed):
      self.rows[row].cached = True
      self.queued.pop(row)
      self.running.add(row)

  def _feed_tokens(self, row: int) -> list[int]:
    """What row ``row``'s queued feed appends to its cache: the whole history but its last
    token (from empty), or the tokens after what the cache holds."""
    r = self.rows[row]
    return r.tokens[:-1] if not r.cached else r.tokens[-r.fed:-1]

  def _pages_for(self, row: int, tokens: int) -> bool:
    """Whether row ``row`` holds (or was given) the pages of ``tokens`` tokens; on a dense pool
    always. Short of pages, younger trajectories than ``row`` are evicted first."""
    if self.pages is None:
      return True
    if self.pages.ensure(row, tokens):
      return True
    for victim in sorted(self.rows, key=lambda x: -self.rows[x].order):
      if self.rows[victim].order <= self.rows[row].order:
        break
      self._evict(victim)
      if self.pages.ensure(row, tokens):
        return True
    if not any(self.pages.held(x) for x in self.rows if x != row):
      raise ValueError(f"sampling.kv_pages={self.params.kv_pages} pages of {self.spec.page_size} "
                       f"tokens cannot hold one trajectory of {tokens} tokens")
    return False

  def _give_pages(self, steps: int) -> None:
    """Pages for the running rows' next ``steps`` tokens, oldest trajectory first; a row that
    cannot get them is evicted (and fed again later)."""
    for row in sorted(self.running, key=lambda x: self.rows[x].order):
      if row in self.running:
        r = self.rows[row]
        if not self._pages_for(row, len(r.tokens) - 1 + min(steps, r.left)):
          self._evict(row)

  def _evict(self, row: int) -> None:
    """Takes row ``row``'s pages back; its history is fed again from empty when it next runs (a
    running row's feed is queued now)."""
    r = self.rows[row]
    if not r.cached and row not in self.running:
      return
    self.pages.release(row)
    self.evictions += 1
    r.cached, r.fed = False, 0
    if row in self.running:
      self.running.discard(row)
      self.queued[row] = True
