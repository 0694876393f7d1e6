"""The rollout sampler on tiny random Qwen checkpoints: greedy equals transformers, the sampled
distribution is softmax(z / T), top-k / top-p / stop tokens hold, log-probs equal a full forward,
outputs follow the seed and the prompt (not its place), and bucketed shapes reuse programs."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import hf_model, make_tiny_qwen
from rft_jax.models import Qwen, QwenConfig, load_hf
from rft_jax.rl.learner import learner_batch
from rft_jax.sampling import decoder
from rft_jax.sampling import SamplingParams, generate, prompt_fingerprints
from rft_jax.sampling import continuous, loop
from rft_jax.sampling.generate import program_for
from rft_jax.sampling.loop import LoopSpec, layer_indices, loop_for, segment_ends

VOCAB = 128
PROMPTS = [[5, 17, 9, 33, 71, 2, 40], [88, 3], [12, 99, 64, 120, 7], [101]]
# Tests share these settings (temperature and top_p are traced), to compile few programs.
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(2,))
NUCLEUS = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_new_tokens=8)
TRUNCATED = SamplingParams(n=2000, temperature=0.7, top_k=5, max_new_tokens=1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return make_tiny_qwen(tmp_path_factory.mktemp("ckpt"), "qwen2", tie=False, kv_heads=2)


@pytest.fixture(scope="module")
def model(ckpt):
  return load_hf(ckpt)


_forward = nnx.jit(lambda m, ids, mask: m(ids, mask))


def _log_softmax(z: np.ndarray) -> np.ndarray:
  z = z.astype(np.float64)
  return z - np.logaddexp.reduce(z, axis=-1, keepdims=True)


def _first_step_logits(model, prompt) -> np.ndarray:
  return np.asarray(_forward(model, jnp.asarray([prompt]), jnp.ones((1, len(prompt)), jnp.int32))
                    )[0, -1]


# ---------------------------------------------------------------------------------------------
# Greedy decoding against transformers.

@pytest.mark.parametrize("family,tie", [("qwen2", False), ("qwen3", True)])
def test_greedy_equals_transformers_generate(ckpt, tmp_path, family, tie):
  import torch

  path = ckpt if family == "qwen2" else make_tiny_qwen(tmp_path, family, tie=tie, kv_heads=2)
  stop, = GREEDY.stop_token_ids
  out = generate(load_hf(path), PROMPTS, GREEDY, seed=0)
  reference = hf_model(path)
  for i, prompt in enumerate(PROMPTS):
    ids = torch.tensor([prompt])
    hf = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=GREEDY.max_new_tokens, eos_token_id=stop,
                            pad_token_id=0)
    expected = hf[0, len(prompt):].tolist()
    if stop in expected:  # HF pads finished rows with pad_token_id after eos
      expected = expected[:expected.index(stop) + 1]
    assert out.completions()[i] == expected, f"prompt {i}"
    assert out.finish_reason[i] == ("stop" if expected[-1] == stop else "length")


# ---------------------------------------------------------------------------------------------
# The sampled distribution.

def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
  """Pearson's statistic, bins with expected count < 5 pooled; returns (statistic, dof)."""
  expected = probs * counts.sum()
  small = expected < 5
  obs, exp = counts[~small], expected[~small]
  if small.any():
    obs, exp = np.append(obs, counts[small].sum()), np.append(exp, expected[small].sum())
  return float(np.sum((obs - exp) ** 2 / exp)), len(obs) - 1


def test_first_token_distribution_is_softmax_of_scaled_logits(model):
  prompt, temperature, n = [7, 30, 51, 90, 11, 64], 0.7, 4000
  out = generate(model, [prompt], SamplingParams(n=n, temperature=temperature, max_new_tokens=1),
                 seed=1)
  counts = np.bincount(out.completion_ids[:, 0], minlength=VOCAB)
  z = _first_step_logits(model, prompt)
  verdicts = {}
  for t in (0.5, temperature, 1.0):
    stat, dof = _chi_square(counts, np.exp(_log_softmax(z / t)))
    tv = 0.5 * np.abs(counts / n - np.exp(_log_softmax(z / t))).sum()
    verdicts[t] = (stat - dof) / np.sqrt(2 * dof)  # standard deviations above the mean
    print(f"\n[T={t}] chi2={stat:.0f} dof={dof} z-score={verdicts[t]:.1f} TV={tv:.3f}")
  assert verdicts[temperature] < 5
  assert verdicts[0.5] > 10 and verdicts[1.0] > 10


def _nucleus(logp: np.ndarray, candidates: np.ndarray, p: float) -> set[int]:
  """Top-p of the distribution renormalised on ``candidates`` (sorted by decreasing logp)."""
  probs = np.exp(logp[candidates] - np.logaddexp.reduce(logp[candidates]))
  mass_before = np.cumsum(probs) - probs
  return set(candidates[mass_before < p + 1e-5].tolist())  # slack for float32 sums


def test_top_k_and_top_p_stay_in_the_allowed_set(model):
  """Truncation in the Hugging Face order: top-k first, then top-p of what is left."""
  prompt, k = [7, 30, 51, 90, 11, 64], 5
  logp = _log_softmax(_first_step_logits(model, prompt) / TRUNCATED.temperature)
  order = np.argsort(-logp)
  cases = [(dataclasses.replace(TRUNCATED, top_k=0, top_p=0.3), _nucleus(logp, order, 0.3)),
           (dataclasses.replace(TRUNCATED, top_k=0, top_p=0.1), _nucleus(logp, order, 0.1)),
           (dataclasses.replace(TRUNCATED, top_k=k, top_p=0.6), _nucleus(logp, order[:k], 0.6)),
           (dataclasses.replace(TRUNCATED, top_k=k, top_p=1.0), set(order[:k].tolist()))]
  assert all(2 <= len(allowed) <= 16 for _, allowed in cases)  # a real cut, drawn in full
  for params, allowed in cases:
    seen = set(generate(model, [prompt], params, seed=2).completion_ids[:, 0].tolist())
    assert seen <= allowed, (params, sorted(seen - allowed))
    assert seen == allowed, (params, "some allowed tokens were never drawn")


# ---------------------------------------------------------------------------------------------
# Stop tokens, padding and the learner layout.

def test_stop_tokens_end_completions(model):
  m = GREEDY.max_new_tokens
  base = generate(model, PROMPTS, GREEDY, seed=0)
  assert 2 not in base.completion_ids and (base.finish_reason == "length").all()
  assert (base.completion_lengths == m).all()
  # Stop on the 4th greedy token of prompt 0 and the 2nd of prompt 2: greedy decoding up to the
  # stop is unchanged, so each completion must end at the first occurrence of a stop token.
  stops = (int(base.completion_ids[0, 3]), int(base.completion_ids[2, 1]))
  out = generate(model, PROMPTS, dataclasses.replace(GREEDY, stop_token_ids=stops), seed=0)
  for i, row in enumerate(base.completion_ids):
    hits = [t for t, token in enumerate(row) if token in stops]
    length = hits[0] + 1 if hits else m
    assert out.completion_lengths[i] == length
    assert out.finish_reason[i] == ("stop" if hits else "length")
    np.testing.assert_array_equal(out.completion_ids[i, :length], row[:length])
    assert not out.completion_ids[i, length:].any() and not out.logprobs[i, length:].any()
    assert (out.logprobs[i, :length] < 0).all()
  assert out.completion_lengths[0] <= 4 and out.completion_lengths[2] <= 2

  arrays = learner_batch(out)
  width = out.prompt_ids.shape[1]
  assert arrays.input_ids.shape == (len(PROMPTS), width + m)
  for i, prompt in enumerate(PROMPTS):
    length = out.completion_lengths[i]
    real = arrays.input_ids[i][arrays.attention_mask[i] == 1].tolist()
    assert real == prompt + out.completions()[i]
    response = np.flatnonzero(arrays.response_mask[i])
    np.testing.assert_array_equal(response, width + np.arange(length))
    np.testing.assert_array_equal(arrays.sampler_logp[i, response],
                                  out.logprobs[i, :length])


def test_logprobs_equal_a_full_forward(model):
  """Under softmax(z / T) of the full vocabulary, also with top-p / top-k truncation on."""
  for params in (dataclasses.replace(NUCLEUS, temperature=0.7, top_p=0.8, top_k=20), GREEDY):
    out = generate(model, PROMPTS, params, seed=4)
    arrays = learner_batch(out)
    logits = np.asarray(_forward(model, jnp.asarray(arrays.input_ids),
                                 jnp.asarray(arrays.attention_mask)))
    scale = params.temperature or 1.0
    logp = _log_softmax(logits[:, :-1] / scale)
    target = np.take_along_axis(logp, arrays.input_ids[:, 1:, None], axis=-1)[..., 0]
    mask = arrays.response_mask[:, 1:] == 1
    diff = np.abs(np.where(mask, target - arrays.sampler_logp[:, 1:], 0.0)).max()
    print(f"\n[T={params.temperature}] max |sampler logp - forward logp| = {diff:.1e}")
    assert diff <= 1e-4


def test_growing_cache_segments_change_nothing(model):
  """Decoding in segments with growing caches (the default from 128 new tokens on) equals one
  full-size cache: same tokens, log-probs to float32 rounding, also when every row stops inside
  the first segment."""
  assert segment_ends(128, 4, 16) == (16, 32, 64, 128) and segment_ends(40, 4, 16) == (20, 40)
  assert segment_ends(40, 1, 16) == (40,) and segment_ends(8, 4, 16) == (8,)
  assert segment_ends(7168, 4) == (896, 1792, 3584, 7168) and segment_ends(127, 4) == (127,)
  assert segment_ends(128, 4) == (64, 128) and segment_ends(511, 4, 256) == (511,)
  assert SamplingParams().min_segment_tokens == 64
  params = SamplingParams(n=3, temperature=1.0, max_new_tokens=40, cache_segments=1, min_segment_tokens=16)
  whole = generate(model, PROMPTS, params, seed=5)
  split = generate(model, PROMPTS, dataclasses.replace(params, cache_segments=4), seed=5)
  np.testing.assert_array_equal(split.completion_ids, whole.completion_ids)
  np.testing.assert_allclose(split.logprobs, whole.logprobs, atol=1e-5)
  assert (whole.completion_lengths == 40).all()
  # Every row stops within its first 3 tokens, inside the first segment.
  stops = tuple(sorted({int(t) for t in whole.completion_ids[:, :3].ravel()}))
  early = generate(model, PROMPTS, dataclasses.replace(params, cache_segments=4,
                                                       stop_token_ids=stops), seed=5)
  assert (early.finish_reason == "stop").all() and early.completion_lengths.max() <= 3
  np.testing.assert_array_equal(early.completion_ids[:, :1], whole.completion_ids[:, :1])


def _layer_slices_in_loops(jaxpr, num_layers: int, inside: bool = False) -> int:
  """Slices of ``[num_layers, ...]`` arrays (the stacked layer weights) inside while loops."""
  count = 0
  for eqn in jaxpr.eqns:
    shape = getattr(eqn.invars[0].aval, "shape", ()) if eqn.invars else ()
    if inside and eqn.primitive.name in ("slice", "dynamic_slice") and len(shape) >= 2 and (
        shape[0] == num_layers):
      count += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          count += _layer_slices_in_loops(sub, num_layers, inside or eqn.primitive.name == "while")
  return count


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_gpu_program_decodes_on_layers_sliced_once(monkeypatch, scheduler):
  """XLA:GPU copies a sliced weight before a matrix product, so the GPU program slices the
  layers (cast to the compute dtype) once per call, outside its decode loops, where the TPU
  program slices them in the loop; both programs (run here on CPU) sample the same tokens."""
  config = QwenConfig("qwen2", 256, 64, 128, 3, 4, 2, tie_word_embeddings=True,
                      dtype=jnp.bfloat16, param_dtype=jnp.float32)
  bf16_model = Qwen(config, rngs=nnx.Rngs(3))
  graphdef, state = nnx.split(bf16_model)
  params = SamplingParams(max_new_tokens=40, min_segment_tokens=16, scheduler=scheduler,
                          decode_slots=2)  # two loops: two segments, or a pool of 4 -> 2 slots
  if scheduler == "static":
    program, spec = loop._sample_loop, LoopSpec.of(params)
  else:
    program, spec = continuous._sample_pool, continuous.PoolSpec.of(params, 4)
  rows = np.ones((4, 8), np.int32)
  args = (state, rows, rows, np.zeros((4, 3), np.uint32), np.ones(4, bool), np.uint32(0),
          np.float32(1), np.int32(0), np.float32(1), layer_indices(3))
  outputs = {}
  nucleus = dataclasses.replace(NUCLEUS, scheduler=scheduler)
  for platform in ("tpu", "gpu"):
    monkeypatch.setattr(decoder, "platform_of", lambda mesh, platform=platform: platform)
    jaxpr = jax.make_jaxpr(functools.partial(program, graphdef, spec=spec, mesh=None,
                                             rules=None))(*args)
    slices = _layer_slices_in_loops(jaxpr.jaxpr, num_layers=3)
    assert (slices == 0) == (platform == "gpu"), (platform, slices)
    program_for(nucleus, None).clear_cache()
    outputs[platform] = generate(bf16_model, PROMPTS, nucleus, seed=9)
  program_for(nucleus, None).clear_cache()
  np.testing.assert_array_equal(outputs["gpu"].completion_ids, outputs["tpu"].completion_ids)
  np.testing.assert_allclose(outputs["gpu"].logprobs, outputs["tpu"].logprobs, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Determinism and compiled programs.

def test_same_seed_same_outputs_whatever_the_prompt_order(model):
  params = NUCLEUS
  prompts = PROMPTS + [PROMPTS[1]]  # a repeated prompt still gets its own samples
  a = generate(model, prompts, params, seed=7)
  b = generate(model, prompts, params, seed=7)
  for field in ("completion_ids", "completion_lengths", "logprobs"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  assert not np.array_equal(a.completion_ids, generate(model, prompts, params,
                                                       seed=8).completion_ids)
  groups = a.completion_ids.reshape(len(prompts), params.n, -1)
  assert not np.array_equal(groups[1], groups[4]), "identical prompts drew identical samples"
  assert len({tuple(x) for x in groups[0]}) == params.n

  order = [2, 0, 3, 1]
  reference = generate(model, PROMPTS, params, seed=7).completion_ids.reshape(4, params.n, -1)
  np.testing.assert_array_equal(reference, groups[:4])  # the duplicate changed nothing else
  shuffled = generate(model, [PROMPTS[i] for i in order], params, seed=7)
  c = shuffled.completion_ids.reshape(4, params.n, -1)
  for new, old in enumerate(order):
    np.testing.assert_array_equal(c[new], reference[old], err_msg=f"prompt {old}")


def test_batches_of_one_bucket_compile_one_program(model):
  generate(model, PROMPTS, NUCLEUS, seed=0)  # bucket (4 prompts, 16 tokens)
  program = program_for(NUCLEUS, None)
  before = program._cache_size()
  compositions = [PROMPTS[:3], [[9] * 16, [3, 4], [77] * 11], PROMPTS[::-1]]
  for i, prompts in enumerate(compositions):
    generate(model, prompts, dataclasses.replace(NUCLEUS, temperature=0.5 + i / 4), seed=i)
  assert program._cache_size() == before
  generate(model, [[5] * 17, [1]], NUCLEUS, seed=0)  # a new bucket: (2, 32)
  assert program._cache_size() == before + 1


def _distinct_fusions(layers: int) -> int:
  """Fused computations of the CPU sampler's compiled program for a random model of ``layers``
  layers, counted once per body (names and metadata aside): the kernels XLA:CPU compiles."""
  config = QwenConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, qk_norm=True)
  graphdef, state = nnx.split(Qwen(config, rngs=nnx.Rngs(0)))
  spec = LoopSpec.of(NUCLEUS)
  compiled = loop_for(None).lower(
      graphdef, state, np.ones((2, 16), np.int32), np.ones((2, 16), np.int32),
      prompt_fingerprints([[1], [2]]), np.ones(2, bool), np.uint32(0), np.float32(1.0),
      np.int32(0), np.float32(1.0), layer_indices(layers), spec=spec, mesh=None, rules=()
  ).compile()
  bodies = re.findall(r"\n%fused_computation[^\n]*\n(.*?\n)}", compiled.as_text(), re.S)
  return len({re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", body))
              for body in bodies})


@pytest.mark.skipif(jax.default_backend() != "cpu", reason=(
    "a property of the CPU program: GPUs and TPUs slice at constant offsets (sample_loop)"))
def test_sampler_kernels_do_not_grow_with_depth():
  """The sampler slices each layer at an index that is an argument of its program, so the
  kernels that read a layer's weights are one computation for every layer: 4 layers compile
  (almost) the same kernels as 2. Sliced at constant offsets they were 12 more per layer."""
  two, four = _distinct_fusions(2), _distinct_fusions(4)
  assert four - two <= 2, (two, four)


@pytest.mark.parametrize("prompts,match", [
    ([], "prompts is empty"), ([[1, 2], []], r"prompts\[1\] must be a non-empty"),
    ([[1, VOCAB]], rf"prompts\[0\] holds token id {VOCAB} outside \[0, {VOCAB}\)"),
    ([[1], [0.5]], r"prompts\[1\] holds float64"), ([3, 4], r"prompts\[0\]=3 is a token id")])
def test_generate_rejects_bad_prompts(model, prompts, match):
  with pytest.raises(ValueError, match=match):
    generate(model, prompts, GREEDY, seed=0)


def test_generate_rejects_bad_seed_and_params(model):
  with pytest.raises(ValueError, match="seed=-1"):
    generate(model, PROMPTS, GREEDY, seed=-1)
  with pytest.raises(TypeError, match="SamplingParams"):
    generate(model, PROMPTS, {"n": 2}, seed=0)
