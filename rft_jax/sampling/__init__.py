"""The rollout sampler: prefill once per prompt, decode in one compiled loop, on the learner's mesh."""

from rft_jax.sampling.buckets import batch_bucket, prompt_length_bucket
from rft_jax.sampling.generate import empty_cache, generate
from rft_jax.sampling.keys import completion_keys, prompt_fingerprints
from rft_jax.sampling.loop import LoopSpec, LoopState, sample_loop
from rft_jax.sampling.params import SamplingParams
from rft_jax.sampling.rollouts import FINISH_REASONS, OnDevice, Rollouts
from rft_jax.sampling.strategies import Strategy, truncate

__all__ = [
    "FINISH_REASONS", "LoopSpec", "LoopState", "OnDevice", "Rollouts", "SamplingParams", "Strategy",
    "batch_bucket", "completion_keys", "empty_cache", "generate",
    "prompt_fingerprints", "prompt_length_bucket", "sample_loop", "truncate",
]
