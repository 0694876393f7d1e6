"""The one registry pattern the algorithms, objectives and token methods share."""

from __future__ import annotations

import pytest

from rft_jax.rl.advantages.algorithms import ALGORITHMS
from rft_jax.rl.named_registry import Registry
from rft_jax.rl.objectives import OBJECTIVES
from rft_jax.rl.token_methods import TOKEN_METHODS


def test_a_registry_adds_and_looks_up_by_the_config_key():
  things = Registry("learner.thing", "thing")
  first = object()
  assert things.add("a", first) is first and things.add("a", first) is first  # the same entry again
  with pytest.raises(ValueError, match=r"thing 'a' is registered already"):
    things.add("a", object())
  assert things.entry("a") is first and sorted(things) == ["a"]
  with pytest.raises(ValueError, match=r"learner\.thing='b' is not one of \['a'\]"):
    things.entry("b")


def test_the_three_registries_are_registries():
  for registry, key in ((ALGORITHMS, "learner.advantage"), (OBJECTIVES, "learner.objective"),
                        (TOKEN_METHODS, "learner.entropy_mask.kind / learner.entropy_method.kind")):
    assert isinstance(registry, Registry) and registry.key == key and len(registry) >= 2
