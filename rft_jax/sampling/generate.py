"""The user API: :func:`generate` pads and buckets the prompts, runs the compiled loop, unpads.

::

  params = SamplingParams(n=8, temperature=1.0, max_new_tokens=1024,
                          stop_token_ids=tuple(tokenizer_eos_ids))
  rollouts = generate(learner.model(state), prompt_token_ids, params, seed=step, mesh=mesh)
  batch = learner_batch(rollouts, advantages=...)   # rft_jax.rl.learner: the learner's batch
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rft_jax.models.kv_cache import KVCache, init_cache
from rft_jax.models.lora_model import merged
from rft_jax.parallel import (DATA_AXIS, DEFAULT_RULES, Rules, global_array, host_array,
                              named_sharding, tree_shardings, with_shardings)
from rft_jax.sampling.buckets import batch_bucket, prompt_length_bucket
from rft_jax.sampling.keys import prompt_fingerprints
from rft_jax.sampling.continuous import PoolSpec, pool_for
from rft_jax.sampling import decoder
from rft_jax.sampling.loop import LoopSpec, layer_indices, loop_for
from rft_jax.sampling.params import SamplingParams
from rft_jax.sampling.rollouts import OnDevice, Rollouts


class CallOutputs(NamedTuple):
  """What :func:`generate` keeps of one compiled call's final state, on the devices until every
  call is queued (the call's KV cache is not kept: it is freed when the call ends).

  Attributes:
    tokens: ``[R, M]`` the call's sampled tokens, 0 after each row's end.
    logprobs: ``[R, M]`` their log-probabilities.
    lengths: ``[R]`` tokens per row.
    done: ``[R]`` the row ended with a stop token (or is a dummy).
    evictions: the samples a paged KV cache evicted and decoded again; None for programs
      without a paged cache.
    expert_ids: an MoE model's ``[R, M, L, k]`` recorded routing of the fed tokens; None when
      not recorded.
    prompt_expert_ids: ``[B, P, L, k]`` the prompts' routing in the prefill; None when not recorded.
  """

  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  done: jax.Array
  evictions: jax.Array | None
  expert_ids: jax.Array | None
  prompt_expert_ids: jax.Array | None


def generate(model: nnx.Module, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
             seed: int, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES,
             cache_dtype=None, keep_on_device: bool = False) -> Rollouts:
  """Samples ``params.n`` completions of every prompt with one compiled program.

  The prompts are left-padded to a length bucket and their count padded to a batch bucket (see
  :mod:`rft_jax.sampling.buckets`) with dummy prompts whose outputs are dropped, so calls with
  different batches share compiled programs. Each prompt is prefilled once for its ``n``
  samples. ``params.scheduler`` picks the decode program: continuous batching
  (:mod:`rft_jax.sampling.continuous`, a pool of ``params.decode_slots`` slots refilled as
  samples stop) or the static loop (:mod:`rft_jax.sampling.loop`); both give the same samples.
  The completions are a function of the seed, the prompt's tokens and the sample
  index, not of the prompt's place in the list (see :mod:`rft_jax.sampling.keys`).

  With ``params.max_rollouts_per_call``, more prompts than a call may hold run as consecutive
  calls of one compiled program, on slices of one batch bucket (the last padded with dummies)
  at the whole list's prompt-length bucket, each prompt with its keys of the whole list: the
  completions are those of one call, their log-probabilities to float32 rounding (XLA may round
  a row's sums differently at another batch size: up to ~2e-6 on CPU). A call's KV cache lives
  as long as the call, so the largest call bounds the memory: at the paper's scale (7B, 64 x 16
  rollouts of 7,168 new tokens) one call's cache would not fit a chip, 16 x 16 does.

  Args:
    model: a :class:`~rft_jax.models.Qwen` (e.g. ``Learner.model(state)``); its parameter arrays
      are read in place, with their current shardings. A model with LoRA adapters decodes its
      :func:`~rft_jax.models.lora_model.merged` weights (made here, once per call).
    prompts: token-id lists, of any lengths >= 1.
    params: the :class:`SamplingParams`; ``stop_token_ids`` must hold the tokenizer's
      end-of-sequence ids.
    seed: an integer in ``[0, 2**32)``.
    mesh: lay the rows and the KV cache's batch axis over the mesh's ``data`` axis (the
      parameters must already live on this mesh, e.g. ``shard_model`` or ``load_hf(mesh=)``).
    rules: logical-axis rules for the KV cache (its ``kv_heads`` axis follows the attention
      weights); ``batch`` always maps to ``data``.
    cache_dtype: KV cache dtype (default: the model's compute dtype).
    keep_on_device: leave the log-probabilities (and a copy of the token ids) on the devices,
      as :attr:`Rollouts.on_device`, for a learner's batch assembled there
      (:func:`rft_jax.rl.learner.learner_batch`); only the token ids and lengths come to the host.

  Returns:
    :class:`Rollouts`, prompt by prompt, ``n`` completions each; for a mixture-of-experts model
    with the experts of every token it ran (:mod:`rft_jax.sampling.routing_record`), on the
    devices with ``keep_on_device``.

  Raises:
    ValueError: an empty prompt list or prompt, a token id outside the vocabulary, a seed out of
      range, or parameters not on ``mesh``.
  """
  if not isinstance(params, SamplingParams):
    raise TypeError(f"generate: params must be a SamplingParams, got {type(params).__name__}")
  prompts = _check_prompts(prompts, model.config.vocab_size)
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
    raise ValueError(f"generate: seed={seed!r} must be an integer in [0, 2**32)")
  model = merged(model)  # LoRA adapters folded into the weights the decode kernels read
  graphdef, state = nnx.split(model)
  data = 1
  if mesh is None:
    rules = ()  # unused; a constant keeps the compiled-program key stable
  else:
    if DATA_AXIS not in mesh.shape:
      raise ValueError(f"generate: the mesh {dict(mesh.shape)} has no {DATA_AXIS!r} axis")
    data = mesh.shape[DATA_AXIS]
    _check_on_mesh(state, mesh)
    rules = sampler_rules(rules)

  num, n = len(prompts), params.n
  width = prompt_length_bucket(max(len(x) for x in prompts))
  batch = batch_bucket(num, data, None if params.max_rollouts_per_call is None
                       else params.max_rollouts_per_call // n)
  calls = -(-num // batch)
  total = calls * batch  # the dummy prompts pad the last call
  ids = np.zeros((total, width), np.int32)
  mask = np.zeros((total, width), np.int32)
  for i, prompt in enumerate(prompts):
    ids[i, width - len(prompt):] = prompt
    mask[i, width - len(prompt):] = 1
  fingerprints = np.zeros((total, 3), np.uint32)
  fingerprints[:num] = prompt_fingerprints(prompts)  # occurrence numbers count the whole list
  live = np.arange(total) < num

  spec = call_spec(params, batch * n, data, cache_dtype, decoder.platform_of(mesh))
  sample_loop = program_for(params, mesh)
  outs = []
  for call in range(calls):  # one compiled program for every call: the same shapes
    inputs = [x[call * batch:(call + 1) * batch] for x in (ids, mask, fingerprints, live)]
    if mesh is not None:
      inputs = [global_array(x, named_sharding(("batch",) + (None,) * (x.ndim - 1), x.shape,
                                               mesh, rules)) for x in inputs]
    out = sample_loop(graphdef, state, *inputs, np.uint32(seed),
                      np.float32(params.temperature or 1.0), np.int32(params.top_k),
                      np.float32(params.top_p), layer_indices(model.config.num_hidden_layers),
                      spec=spec, mesh=mesh, rules=rules)
    # Left on device (a few MB per call) and fetched once every call is queued: the device
    # does not wait for a transfer between calls. Each call's KV cache is freed when it ends.
    outs.append(CallOutputs(tokens=out.tokens, logprobs=out.logprobs, lengths=out.lengths, done=out.done,
                            evictions=getattr(out, "evictions", None), expert_ids=out.expert_ids,
                            prompt_expert_ids=out.prompt_expert_ids))
  keep = num * n
  tokens = _host_rows([o.tokens for o in outs], keep)
  lengths = _host_rows([o.lengths for o in outs], keep)
  done = _host_rows([o.done for o in outs], keep)
  on_device = logprobs = None
  if keep_on_device:  # the dummy prompts' rows dropped where the arrays are
    on_device = OnDevice(completion_ids=_device_rows([o.tokens for o in outs], keep),
                         logprobs=_device_rows([o.logprobs for o in outs], keep))
  else:
    logprobs = _host_rows([o.logprobs for o in outs], keep).astype(np.float32)
  prompt_routing = completion_routing = None
  if outs[0].expert_ids is not None:  # an MoE model's recorded routing (rft_jax.sampling.routing_record)
    if keep_on_device:
      completion_routing = _device_rows([o.expert_ids for o in outs], keep)
      prompt_routing = _device_rows([o.prompt_expert_ids for o in outs], num)
    else:
      completion_routing = _host_rows([o.expert_ids for o in outs], keep)
      prompt_routing = _host_rows([o.prompt_expert_ids for o in outs], num)
  return Rollouts(
      prompt_ids=ids[:num],
      prompt_lengths=np.asarray([len(x) for x in prompts], np.int32),
      completion_ids=np.asarray(tokens, np.int32),
      completion_lengths=np.asarray(lengths, np.int32),
      logprobs=logprobs,
      finish_reason=np.where(done, "stop", "length"),
      prompt_index=np.repeat(np.arange(num, dtype=np.int32), n),
      on_device=on_device,
      evictions=sum(int(host_array(o.evictions)) for o in outs if o.evictions is not None),
      prompt_expert_ids=prompt_routing,
      completion_expert_ids=completion_routing,
  )


def call_spec(params: SamplingParams, rollouts: int, data: int, cache_dtype=None,
              platform: str | None = None) -> PoolSpec | LoopSpec:
  """The static settings of one call of ``rollouts`` rows over ``data`` shards on ``platform``
  (None: an accelerator), for the program ``params.scheduler`` picks (:func:`program_for`)."""
  if params.scheduler == "continuous":
    return PoolSpec.of(params, rollouts, data, cache_dtype, platform)
  return LoopSpec.of(params, cache_dtype)


def program_for(params: SamplingParams, mesh: Mesh | None):
  """The compiled program :func:`generate` runs for ``params`` on the devices of ``mesh``:
  continuous batching's (:func:`~rft_jax.sampling.continuous.pool_for`) or the static loop's
  (:func:`~rft_jax.sampling.loop.loop_for`), as ``params.scheduler`` says."""
  return pool_for(mesh) if params.scheduler == "continuous" else loop_for(mesh)


def _host_rows(parts: list[jax.Array], keep: int) -> np.ndarray:
  """The first ``keep`` rows of the calls' outputs ``parts``, concatenated on the host."""
  return np.concatenate([host_array(x) for x in parts])[:keep]


@functools.partial(jax.jit, static_argnums=1)
def _device_rows(parts: list[jax.Array], keep: int) -> jax.Array:
  """The first ``keep`` rows of the calls' outputs ``parts``, concatenated on their devices."""
  return jnp.concatenate(parts)[:keep]


def sampler_rules(rules: Rules = DEFAULT_RULES) -> Rules:
  """``rules`` with ``batch`` on the data axis first, as a hashable tuple (a static argument of
  the compiled loop)."""
  return tuple((name, tuple(target) if isinstance(target, list) else target)
               for name, target in (("batch", DATA_AXIS), *rules))


def abstract_cache(config, batch: int, max_len: int, dtype=None, mesh: Mesh | None = None,
                   rules: Rules = DEFAULT_RULES) -> KVCache:
  """A :class:`KVCache` of ``jax.ShapeDtypeStruct`` (with its shardings on ``mesh`` when
  given): shapes and layout, nothing allocated (``rft-jax plan`` counts its bytes)."""
  abstract = jax.eval_shape(lambda: init_cache(config, batch, max_len, dtype))
  if mesh is None:
    return abstract
  return with_shardings(abstract, tree_shardings(abstract, abstract.logical_axes(), mesh, rules))


def empty_cache(config, batch: int, max_len: int, dtype=None, mesh: Mesh | None = None,
                rules: Rules = DEFAULT_RULES) -> KVCache:
  """A zero :class:`KVCache`, created directly with its shardings on ``mesh`` when given."""
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=getattr(a, "sharding", None)),
                      abstract_cache(config, batch, max_len, dtype, mesh, rules))


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
  if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
    prompts = list(prompts)
  if not len(prompts):
    raise ValueError("generate: prompts is empty")
  out = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, (int, np.integer)):
      raise ValueError(f"generate: prompts[{i}]={prompt!r} is a token id, not a list of them")
    prompt = np.asarray(prompt)
    if prompt.ndim != 1 or prompt.size == 0:
      raise ValueError(f"generate: prompts[{i}] must be a non-empty list of token ids, got "
                       f"shape {prompt.shape}")
    if prompt.dtype.kind not in "iu":
      raise ValueError(f"generate: prompts[{i}] holds {prompt.dtype} values, not token ids")
    bad = (prompt < 0) | (prompt >= vocab_size)
    if bad.any():
      raise ValueError(f"generate: prompts[{i}] holds token id {int(prompt[bad][0])} outside "
                       f"[0, {vocab_size})")
    out.append(prompt.astype(np.int64).tolist())
  return out


def _check_on_mesh(state: nnx.State, mesh: Mesh) -> None:
  for path, x in nnx.to_flat_state(state):
    sharding = getattr(x.get_value() if hasattr(x, "get_value") else x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
      raise ValueError(
          f"generate: parameter {'.'.join(map(str, path))} is not laid out on the given mesh "
          f"(sharding {sharding}); shard the model first (rft_jax.parallel.shard_model)")
