"""Reward functions for tests that train with ``rewards.functions`` (importable by the reward
workers of any test: ``tests/`` is on sys.path before any worker starts)."""


def odd_length(completions, answers, rows):
  """1 for a completion of odd length in characters, else 0: a random tiny model earns it about
  half the time, so groups have reward variance."""
  del answers, rows
  return [float(len(c) % 2) for c in completions]


def nan_for_odd_length(completion, answer, row):
  """Per completion: NaN for one of odd length (a broken reward), else 1."""
  del answer, row
  return float("nan") if len(completion) % 2 else 1.0


def divides_by_zero(completions, answers, rows):
  """A reward function that always raises."""
  del answers, rows
  return [1 / 0 for _ in completions]


def never_matches(completions, answers, rows):
  """0 for every completion, as the README's ``endswith(answer)`` scores the demo model's boxed
  answers: no group has reward variance, so a run learns nothing."""
  del answers, rows
  return [0.0 for _ in completions]
