"""Where in a trajectory the policy's entropy is: by turn, and by what a token does.

The paper's question, which tokens' entropy falls under RL, asked of agent trajectories: a model
token is the *decision* to call a tool (the ``<tool_call>`` token that opens a call), the call's
*arguments* (the tokens inside it, up to ``</tool_call>``), the *answer* (a turn that calls no
tool: what the environment judges), or *reasoning* (the other tokens of a turn that calls a
tool). The environment's tokens have none.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rft_jax.rollout.trajectory import Trajectory

ROLES = ("decision", "arguments", "answer", "reasoning")
_NONE = -1


def tool_call_ids(tokenizer: Any) -> tuple[int | None, int | None]:
  """The ids of ``<tool_call>`` and ``</tool_call>`` when the tokenizer has them as single tokens
  (Qwen2.5 and Qwen3 do), else None."""
  vocab = tokenizer.get_vocab()
  return vocab.get("<tool_call>"), vocab.get("</tool_call>")


def token_roles(t: Trajectory, call_open: int | None, call_close: int | None
                ) -> tuple[np.ndarray, np.ndarray]:
  """``(turn, role)``, ``[len(t.ids)]`` int each: the model turn (from 1) and the index in
  :data:`ROLES` of every model token; -1 on the environment's."""
  turn, role = np.full(len(t.ids), _NONE), np.full(len(t.ids), _NONE)
  k = 0
  for piece in t.turns:
    if piece.role != "assistant":
      continue
    k += 1
    ids = t.ids[piece.start:piece.end]
    turn[piece.start:piece.end] = k
    calls = call_open is not None and call_open in ids
    inside = False
    for j, token in enumerate(ids):
      if calls and token == call_open:
        kind, inside = "decision", True
      elif inside:
        kind, inside = "arguments", token != call_close
      else:
        kind = "reasoning" if calls else "answer"
      role[piece.start + j] = ROLES.index(kind)
  return turn, role


def entropy_by_turn_and_role(trajectories: list[Trajectory], token_entropy: np.ndarray,
                             first_column: np.ndarray, call_ids: tuple[int | None, int | None],
                             max_turns: int) -> dict[str, float]:
  """The mean entropy of the model's tokens by turn (``agent_entropy_turn_k``) and by role
  (``agent_entropy_role_<role>``), over a batch's trajectories; only the turns and roles that
  occur.

  Args:
    trajectories: the batch's trajectories, in its row order.
    token_entropy: ``[B, L]`` the entropy of each column's prediction (the learner's
      ``token_entropy``).
    first_column: ``[B]`` the column of each row's first trajectory token (after its prompt).
    call_ids: :func:`tool_call_ids`.
    max_turns: turns to report.
  """
  sums, counts = np.zeros((2, max_turns + 1)), np.zeros((2, max_turns + 1))
  for row, t in enumerate(trajectories):
    turn, role = token_roles(t, *call_ids)
    values = token_entropy[row, first_column[row]:first_column[row] + len(t.ids)]
    for axis, groups in enumerate((turn, role)):
      real = groups >= 0
      np.add.at(sums[axis], groups[real], values[real])
      np.add.at(counts[axis], groups[real], 1)
  out = {f"agent_entropy_turn_{k}": sums[0, k] / counts[0, k]
         for k in range(1, max_turns + 1) if counts[0, k]}
  out.update({f"agent_entropy_role_{name}": sums[1, i] / counts[1, i]
              for i, name in enumerate(ROLES) if counts[1, i]})
  return {k: float(v) for k, v in out.items()}
