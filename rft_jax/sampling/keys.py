r"""Random keys that follow a completion, not its row: the same seed gives the same completions
whatever the order or company of the prompts in a call.

The key of sample ``j`` of a prompt at decoding step ``t`` is

.. math:: k_{j,t} = \mathrm{fold}(\mathrm{fold}(\mathrm{fold}^3(\mathrm{key}(s), f), j), t),

where :math:`f` is the prompt's fingerprint: a 64-bit hash of its token ids (two 32-bit words)
and its occurrence number among identical prompts of the call (0 for the first copy, 1 for the
second, ...), so that repeated prompts in one call still get independent samples.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, UInt32


def prompt_fingerprints(prompts: Sequence[Sequence[int]]) -> np.ndarray:
  """``[B, 3]`` uint32: (hash low word, hash high word, occurrence number) of each prompt."""
  seen: dict[bytes, int] = {}
  out = np.zeros((len(prompts), 3), np.uint32)
  for i, prompt in enumerate(prompts):
    digest = hashlib.blake2b(np.asarray(prompt, np.int64).tobytes(), digest_size=8).digest()
    occurrence = seen.get(digest, 0)
    seen[digest] = occurrence + 1
    out[i] = (int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little"),
              occurrence)
  return out


def completion_keys(seed: UInt32[Array, ""], fingerprints: UInt32[Array, "B 3"], n: int
                    ) -> jax.Array:
  """``[B * n]`` typed keys, row ``b * n + j`` for sample ``j`` of prompt ``b``."""
  base = jax.random.key(seed)

  def per_prompt(fingerprint):
    key = base
    for word in range(3):
      key = jax.random.fold_in(key, fingerprint[word])
    return jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(n, dtype=jnp.uint32))

  return jax.vmap(per_prompt)(fingerprints).reshape(-1)


def step_keys(keys: jax.Array, step: jax.Array) -> jax.Array:
  """The keys of decoding step ``step`` (``[R]`` keys in, ``[R]`` keys out)."""
  return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
