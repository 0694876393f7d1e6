r"""Random keys that follow a completion, not its row: the same seed gives the same completions
whatever the order or company of the prompts in a call.

The key of sample ``j`` of a prompt at decoding step ``t`` is

.. math:: k_{j,t} = \mathrm{fold}(\mathrm{fold}(\mathrm{fold}^3(\mathrm{key}(s), f), j), t),

where :math:`f` is the prompt's fingerprint: a 64-bit hash of its token ids (two 32-bit words)
and its occurrence number among identical prompts of the call (0 for the first copy, 1 for the
second, ...), so that repeated prompts in one call still get independent samples. A step's draw
takes one uniform number from its key, :math:`u_{j,t} = U(k_{j,t})`; the sampling program makes
them all before it decodes (:func:`step_uniforms`).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt32


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
  """``[B * n]`` typed keys, row ``b * n + j`` for sample ``j`` of prompt ``b``: the seed's key
  folded with the fingerprint's three words, then with ``j``: one fold at a time, in a loop over
  the four words (one hash in the program instead of four)."""
  b = fingerprints.shape[0]
  words = jnp.concatenate([jnp.repeat(fingerprints, n, axis=0, total_repeat_length=b * n),
                           jnp.tile(jnp.arange(n, dtype=jnp.uint32), b)[:, None]], axis=1)
  fold = jax.vmap(jax.random.fold_in)
  keys = jnp.broadcast_to(jax.random.key(seed), (b * n,))
  return jax.lax.fori_loop(0, 4, lambda i, keys: fold(keys, words[:, i]), keys)


def step_keys(keys: jax.Array, step: jax.Array) -> jax.Array:
  """The keys of decoding step ``step`` (``[R]`` keys in, ``[R]`` keys out)."""
  return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)


def step_uniforms(keys: jax.Array, steps: int) -> Float[Array, "R M"]:
  """``[R, M]`` float32 in ``[0, 1)``: row ``r``'s uniform number at each decoding step
  ``t < steps``, ``uniform(step_keys(keys, t)[r])``, every step at once.

  Two vectorised hashes over ``R x M`` keys before decoding instead of two small ones in every
  step: the same numbers, and no hashing left in the decode loop.
  """
  def at(step):
    return jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(step_keys(keys, step))
  return jax.vmap(at, out_axes=1)(jnp.arange(steps, dtype=jnp.int32))
