"""Entropy by turn and by token role (rft_jax.rollout.token_roles): which tokens of an agent's
trajectory are a tool call's decision, its arguments, an answer or reasoning, and the means."""

from __future__ import annotations

import numpy as np

from rft_jax.rollout.token_roles import ROLES, entropy_by_turn_and_role, token_roles
from rft_jax.rollout.trajectory import Trajectory

OPEN, CLOSE, END = 50, 51, 2


def trajectory():
  t = Trajectory(problem=0, sample=0, prompt_ids=[1, 1])
  t.add("assistant", [5, OPEN, 7, 8, CLOSE, END], "call", [0.0] * 6)
  t.add("environment", [30, 31, 32], "reply")
  t.add("assistant", [9, 10, END], "answer", [0.0] * 3)
  return t


def test_roles_and_turns_of_each_token():
  turn, role = token_roles(trajectory(), OPEN, CLOSE)
  names = [ROLES[r] if r >= 0 else "-" for r in role]
  assert names == ["reasoning", "decision", "arguments", "arguments", "arguments", "reasoning",
                   "-", "-", "-", "answer", "answer", "answer"]
  assert turn.tolist() == [1] * 6 + [-1] * 3 + [2] * 3
  _, no_tools = token_roles(trajectory(), None, None)  # a tokenizer without the markers
  assert {ROLES[r] for r in no_tools if r >= 0} == {"answer"}


def test_means_by_turn_and_role():
  t = trajectory()
  entropy = np.zeros((1, 4 + 12))
  entropy[0, 4:] = np.arange(12)  # the trajectory's tokens start at column 4
  out = entropy_by_turn_and_role([t], entropy, np.array([4]), (OPEN, CLOSE), max_turns=3)
  assert out == {"agent_entropy_turn_1": np.mean([0, 1, 2, 3, 4, 5]),
                 "agent_entropy_turn_2": np.mean([9, 10, 11]),
                 "agent_entropy_role_decision": 1.0, "agent_entropy_role_arguments": 3.0,
                 "agent_entropy_role_answer": 10.0, "agent_entropy_role_reasoning": 2.5}
