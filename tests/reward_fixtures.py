"""Reward functions for tests that train with ``rewards.functions`` (importable by the reward
workers of any test: ``tests/`` is on sys.path before any worker starts)."""


def odd_length(completions, answers, rows):
  """1 for a completion of odd length in characters, else 0: a random tiny model earns it about
  half the time, so groups have reward variance."""
  del answers, rows
  return [float(len(c) % 2) for c in completions]
