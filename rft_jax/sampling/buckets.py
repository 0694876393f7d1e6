"""Shape buckets: a training run compiles one sampling program per bucket, not one per batch.

Prompt lengths round up to half octaves, ``2^k`` or ``1.5 * 2^k`` (at least
:data:`MIN_PROMPT_BUCKET`), up to :data:`POW2_LIMIT`, then to a multiple of it: twice the
programs of power-of-two buckets, but a prompt is padded by at most a third instead of
doubled, and every decode step reads the padding's cache slots. Prompt counts round up to a
power of two and then to a multiple of the mesh's data-axis size, capped (when a call may hold
only so many rows: ``SamplingParams.max_rollouts_per_call``) at a multiple of it.
"""

from __future__ import annotations

MIN_PROMPT_BUCKET = 16
POW2_LIMIT = 1024


def _next_pow2(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()


def prompt_length_bucket(length: int) -> int:
  """16, 24, 32, 48, 64, 96, ..., 768, 1024, then multiples of 1024 (the smallest ``>= length``)."""
  if length < 1:
    raise ValueError(f"prompt length {length} must be >= 1")
  if length > POW2_LIMIT:
    return -(-length // POW2_LIMIT) * POW2_LIMIT
  octave = _next_pow2(length)
  return max(MIN_PROMPT_BUCKET, octave * 3 // 4 if length <= octave * 3 // 4 else octave)


def batch_bucket(num_prompts: int, data_size: int = 1, max_prompts: int | None = None) -> int:
  """The padded prompt count of one compiled call: a power of two ``>= num_prompts``, a multiple
  of ``data_size``.

  With ``max_prompts``, at most ``max_prompts`` rounded down to a multiple of ``data_size`` (and
  at least ``data_size``: every data shard holds a prompt); ``num_prompts`` above it then run as
  several calls of this many prompts. The cap is not rounded to a power of two: the rows it
  pads are cache the cap is there to bound, and a run's sliced calls all have the same count
  anyway (a cap of 24 prompts makes a bucket of 24, not 32).
  """
  if num_prompts < 1:
    raise ValueError(f"num_prompts={num_prompts} must be >= 1")
  if data_size < 1:
    raise ValueError(f"data_size={data_size} must be >= 1")
  size = -(-_next_pow2(num_prompts) // data_size) * data_size
  if max_prompts is None:
    return size
  if max_prompts < 1:
    raise ValueError(f"max_prompts={max_prompts} must be >= 1")
  return min(size, max(data_size, max_prompts // data_size * data_size))
