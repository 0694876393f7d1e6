"""What to sample: the settings of :func:`rft_jax.sampling.generate`, and the schema of a run
config's ``sampling`` section (``rft_jax.train.config``): each setting is declared, documented
and checked here, once; errors name it as ``sampling.<key>``."""

from __future__ import annotations

import dataclasses
import math

from rft_jax.models.decode.paged_kv import PAGED_ATTENTION_KINDS

SCHEDULERS = ("continuous", "static")

@dataclasses.dataclass(frozen=True)
class SamplingParams:
  r"""Settings of one :func:`~rft_jax.sampling.generate` call.

  Token ``t`` of a completion is drawn from the scaled logits :math:`z / T`, truncated to the
  ``top_k`` largest entries and then to the smallest set of top entries whose probability mass
  reaches ``top_p`` (the Hugging Face order: temperature, top-k, top-p). ``temperature=0``
  is greedy decoding (argmax of :math:`z`; ``top_k`` and ``top_p`` then change nothing).
  The log-probabilities returned with the tokens are under :math:`\mathrm{softmax}(z / T)` of
  the full vocabulary, before truncation (:math:`\mathrm{softmax}(z)` when greedy), the
  distribution the learner's ratio is computed under.

  ``n``, ``max_new_tokens``, ``stop_token_ids`` and whether decoding is greedy or truncated
  (``top_k > 0`` or ``top_p < 1``) shape the compiled program, and so does
  ``max_rollouts_per_call`` through the batch bucket; the values of ``temperature``, ``top_k``
  and ``top_p`` are traced, so changing them reuses it. A training run compiles one program per
  shape bucket.

  Attributes:
    n: completions per prompt (the GRPO group size).
    temperature: T >= 0; 0 is greedy.
    top_p: nucleus mass in (0, 1]; 1.0 turns it off.
    top_k: keep the k largest logits; 0 turns it off.
    max_new_tokens: M, the most tokens a completion may have (its stop token included).
    stop_token_ids: tokens that end a completion; the stop token is part of the completion. Pass
      the tokenizer's end-of-sequence ids (e.g. ``<|im_end|>`` and ``<|endoftext|>`` for
      Qwen instruct models): nothing here reads them from the model or tokenizer. Empty: every
      completion runs to ``max_new_tokens``. In a run config: stop tokens besides the
      tokenizer's, which a run always stops at.
    cache_segments: decode in up to this many segments whose KV caches grow (doubling, the
      last one ``max_new_tokens``): a step then reads the slots of its segment, at most about
      twice the live context, instead of every preallocated slot. Each segment is one more
      compiled decode body; 1 turns it off.
    min_segment_tokens: no segment shorter than this many new tokens: below it the reads a
      segment saves are worth less than the compile time of its decode body. On CPU two
      segments saved decode time on a small and a larger model, and four, down to 16 tokens,
      saved more on the small one but less on the larger (``docs/results/cpu.md#cache-segments``).
    max_rollouts_per_call: the most rows (prompts x ``n``, dummy padding rows included) one
      compiled call decodes at once, i.e. what bounds its KV cache; ``generate`` runs larger
      batches as several calls of ``max_rollouts_per_call // n`` prompts (rounded down to a
      multiple of the mesh's data axis, at least one prompt per data shard) and concatenates
      them: the same completions as one call (log-probabilities to float32 rounding). None:
      every prompt in one call. At least ``n``: a prompt's ``n`` samples share its prefill, so
      they are never split across calls.
    scheduler: ``continuous`` (default): continuous batching
      (:mod:`rft_jax.sampling.continuous`): a pool of decode slots takes the samples from a
      queue, a stopped sample's slot takes the next one, and the pool shrinks as the queue
      drains, so that long-tailed lengths do not keep every row busy until the longest ends.
      ``static``: every row of a call decodes until the call's longest row ends
      (:mod:`rft_jax.sampling.loop`), with growing cache segments. Both give the same samples.
    decode_slots: continuous batching's pool size, the most samples that decode at once (its
      KV cache holds this many rows of ``prompt + max_new_tokens`` slots); None: one slot per
      row of the call.
    pool_stages: the pool halves at most ``pool_stages - 1`` times as the queue drains (down
      to 1 slot on CPU, 8 elsewhere: ``rft_jax.sampling.continuous.min_pool_slots``): each
      stage is one more compiled decode body. On long-tailed lengths most
      of a call's steps run the last few completions: 128 rows of mean length ~200 and at most
      1,024 compute 53k row-steps for 28k tokens with 3 stages (128, 64, 32), 41k with 5
      (down to 8), 34k with a pool of 64 and 4 stages (a simulation of the schedule). Calls of
      fewer than ``2 * min_segment_tokens`` new tokens do not shrink.
    kv_pages: continuous batching on a paged KV cache (:mod:`rft_jax.sampling.paged_pool`):
      the pages of ``page_size`` tokens of one call **per data shard**. Each shard of the mesh's
      ``data`` axis (a data-parallel group of devices; the whole call without a mesh) runs its
      own pool (:mod:`rft_jax.sampling.paged_shards`) on its ``1/D`` of the call's prompts,
      their samples and ``decode_slots / D`` slots, in ``kv_pages`` pages of its own (each
      page's kv heads split over ``model``), prompts included; so the memory follows the live
      tokens instead of ``decode_slots x (prompt + max_new_tokens)``, and a call holds
      ``D x kv_pages`` pages in all. Samples wait (or are evicted and decoded again) when their
      shard's pages run out. None: a full-width cache row per slot. ``rft-jax plan`` sizes it
      from memory.
    page_size: tokens per page of the paged cache (a power of two suits the Pallas kernels).
    paged_attention: attention over the pages (``rft_jax.models.decode.paged_kv``): ``auto`` (jax's
      Pallas kernel on a TPU where Mosaic takes the shapes, and on a GPU where Triton does
      (``rft_jax.models.decode.paged_kv.resolve_kind``); XLA's gather
      elsewhere), ``xla``, ``pallas_gpu``, ``pallas_tpu``, ``pallas_tpu_megacore`` (the TPU
      kernel over both TensorCores of a v4 or v5p chip; opt-in, not yet run on one). The same
      samples to the kernels' rounding.
    record_routing: a mixture-of-experts model's rollouts record the experts each token ran
      through (``Rollouts.prompt_expert_ids`` / ``completion_expert_ids``: what
      ``learner.routing_replay`` replays and the ``router/routing_mismatch`` metric compares);
      False: nothing recorded (the evaluation's rollouts, whose routing nothing reads). A
      dense model records nothing either way.
  """

  n: int = 1
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_new_tokens: int = 256
  stop_token_ids: tuple[int, ...] = ()
  cache_segments: int = 4
  min_segment_tokens: int = 64
  max_rollouts_per_call: int | None = None
  scheduler: str = "continuous"
  decode_slots: int | None = None
  pool_stages: int = 8
  kv_pages: int | None = None
  page_size: int = 16
  paged_attention: str = "auto"
  record_routing: bool = True

  def __post_init__(self):
    if isinstance(self.stop_token_ids, int) or not hasattr(self.stop_token_ids, "__iter__"):
      raise ValueError(
          f"sampling.stop_token_ids={self.stop_token_ids!r} must be a list of token ids")
    object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
    _check_int("n", self.n, minimum=1)
    _check_int("top_k", self.top_k, minimum=0)
    _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
    _check_int("cache_segments", self.cache_segments, minimum=1)
    _check_int("min_segment_tokens", self.min_segment_tokens, minimum=1)
    _check_int("pool_stages", self.pool_stages, minimum=1)
    _check_int("page_size", self.page_size, minimum=1)
    if not isinstance(self.record_routing, bool):
      raise ValueError(f"sampling.record_routing={self.record_routing!r} must be true or false")
    if self.paged_attention not in PAGED_ATTENTION_KINDS:
      raise ValueError(f"sampling.paged_attention={self.paged_attention!r} is not one of "
                       f"{list(PAGED_ATTENTION_KINDS)}")
    if self.scheduler not in SCHEDULERS:
      raise ValueError(f"sampling.scheduler={self.scheduler!r} is not one of {list(SCHEDULERS)}")
    if self.decode_slots is not None:
      _check_int("decode_slots", self.decode_slots, minimum=1)
      object.__setattr__(self, "decode_slots", int(self.decode_slots))
    if self.kv_pages is not None:
      _check_int("kv_pages", self.kv_pages, minimum=1)
      object.__setattr__(self, "kv_pages", int(self.kv_pages))
      if self.scheduler != "continuous":
        raise ValueError(f"sampling.kv_pages (a paged KV cache) needs sampling.scheduler=continuous, not "
                         f"{self.scheduler!r}")
    for name in ("n", "top_k", "max_new_tokens", "cache_segments", "min_segment_tokens",
                 "pool_stages", "page_size"):
      object.__setattr__(self, name, int(getattr(self, name)))
    if self.max_rollouts_per_call is not None:
      if not _is_int(self.max_rollouts_per_call):
        raise ValueError(f"sampling.max_rollouts_per_call={self.max_rollouts_per_call!r} must be "
                         f"null or an integer")
      if self.max_rollouts_per_call < self.n:
        raise ValueError(
            f"sampling.max_rollouts_per_call={self.max_rollouts_per_call} is below sampling.n="
            f"{self.n}: a prompt's n samples run in one sampler call")
      object.__setattr__(self, "max_rollouts_per_call", int(self.max_rollouts_per_call))
    if not _is_real(self.temperature) or not math.isfinite(self.temperature) or (
        self.temperature < 0):
      raise ValueError(f"sampling.temperature={self.temperature!r} must be a finite "
                       "number >= 0 (0 is greedy)")
    if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
      raise ValueError(f"sampling.top_p={self.top_p!r} must be in (0, 1] (1.0 is off)")
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_p", float(self.top_p))
    for i, token in enumerate(self.stop_token_ids):
      if not _is_int(token) or token < 0:
        raise ValueError(f"sampling.stop_token_ids[{i}]={token!r} must be a token id >= 0")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

  @property
  def greedy(self) -> bool:
    """``temperature == 0``."""
    return self.temperature == 0


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) or (
      hasattr(x, "dtype") and getattr(x.dtype, "kind", "") in "iu" and getattr(x, "ndim", 1) == 0)


def _is_real(x) -> bool:
  return _is_int(x) or isinstance(x, float) or (
      hasattr(x, "dtype") and getattr(x.dtype, "kind", "") == "f" and getattr(x, "ndim", 1) == 0)


def _check_int(name: str, value, *, minimum: int) -> None:
  if not _is_int(value):
    raise ValueError(f"sampling.{name}={value!r} must be an integer >= {minimum}")
  if value < minimum:
    raise ValueError(f"sampling.{name}={value!r} must be >= {minimum}")
