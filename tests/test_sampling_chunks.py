"""Rollouts in several sampler calls (``SamplingParams.max_rollouts_per_call``): the same
completions as one call, one compiled program for every slice, on one device and on a mesh.

Log-probabilities are compared to float32 rounding, not bit for bit: XLA:CPU rounds some of a
row's sums differently at another batch size (the RMSNorm over the hidden features of 1-2 rows
against 64 rows, the key projection of one row), so one row's log-probs differ by up to ~2e-6
between a call of 8 prompts and one of 3. The keys, and so the tokens, do not depend on it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re

import numpy as np
import pytest

from hf_fixtures import make_tiny_qwen
from rft_jax.models import load_hf
from rft_jax.parallel import make_mesh
from rft_jax.plan.fit import while_loop_bodies
from rft_jax.sampling import decoder
from rft_jax.sampling import SamplingParams, batch_bucket, continuous, generate, loop
from rft_jax.sampling.generate import program_for
from rft_jax.train.config import ConfigError, load_config
from rft_jax.train.resolve import sampling_params

# Lengths 7, 2, 5, 20, 1, 3, 2: the whole list's width bucket is 24, the first and last slices'
# own would be 16. The last prompt repeats the second one, in another slice.
PROMPTS = [[5, 17, 9, 33, 71, 2, 40], [88, 3], [12, 99, 64, 120, 7], list(range(30, 50)), [101],
           [3, 3, 8], [88, 3]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, stop_token_ids=(2, 7, 11))
SLICED = dataclasses.replace(PARAMS, max_rollouts_per_call=7)  # 3 prompts a call: 3 + 3 + 1
FIELDS = ("prompt_ids", "prompt_lengths", "completion_ids", "completion_lengths", "finish_reason",
          "prompt_index")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return make_tiny_qwen(tmp_path_factory.mktemp("ckpt"), "qwen2", tie=False, kv_heads=2)


@pytest.fixture(scope="module")
def whole(ckpt):
  """The rollouts of one call (8 prompts' bucket)."""
  return generate(load_hf(ckpt), PROMPTS, PARAMS, seed=3)


def _assert_same(a, b, *, exact: bool):
  for field in FIELDS:
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
  if exact:
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
  else:
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_slices_equal_one_call_and_compile_once(ckpt, whole):
  model = load_hf(ckpt)
  assert set(whole.finish_reason) == {"stop", "length"}
  before = program_for(PARAMS, None)._cache_size()
  sliced = generate(model, PROMPTS, SLICED, seed=3)
  assert program_for(PARAMS, None)._cache_size() == before + 1  # three calls, one program
  _assert_same(sliced, whole, exact=False)
  assert sliced.prompt_ids.shape == (7, 24)  # the whole list's width, in every slice
  groups = sliced.completion_ids.reshape(len(PROMPTS), PARAMS.n, -1)
  assert not np.array_equal(groups[1], groups[6]), "the repeated prompt drew the same samples"

  # A call depends on its own prompts only: the first two slices alone give the same bits.
  # Five prompts (two calls) of the same bucket and other traced settings: no new program.
  first_two = generate(model, PROMPTS[:6], SLICED, seed=3)
  for field in FIELDS[2:] + ("logprobs",):
    np.testing.assert_array_equal(getattr(first_two, field), getattr(sliced, field)[:12],
                                  err_msg=field)
  generate(model, PROMPTS[:5], dataclasses.replace(SLICED, temperature=0.6), seed=9)
  assert program_for(PARAMS, None)._cache_size() == before + 1


def test_slices_on_a_mesh_equal_one_call(ckpt, whole):
  mesh = make_mesh(data=4, model=2)
  model = load_hf(ckpt, mesh=mesh)
  before = program_for(PARAMS, None)._cache_size()
  # 4 prompts a call (one per data shard), two calls: the last holds 3 and a dummy.
  sliced = generate(model, PROMPTS, dataclasses.replace(PARAMS, max_rollouts_per_call=9),
                    seed=3, mesh=mesh)
  assert program_for(PARAMS, None)._cache_size() == before + 1
  _assert_same(sliced, whole, exact=False)


def test_batch_bucket_cap():
  # Capped at max_prompts rounded down to a multiple of the data axis, at least the data axis;
  # not rounded up to a power of two (padding rows are cache the cap bounds).
  assert [batch_bucket(x, 1, 16) for x in (1, 5, 16, 17, 64)] == [1, 8, 16, 16, 16]
  assert batch_bucket(20, 1, 24) == 24 and batch_bucket(64, 8, 24) == 24
  assert batch_bucket(64, 6, 16) == 12 and batch_bucket(7, 4, 2) == 4 and batch_bucket(7, 4, 9) == 8
  assert batch_bucket(5, 1, None) == batch_bucket(5) == 8
  with pytest.raises(ValueError, match="max_prompts=0"):
    batch_bucket(4, 1, 0)


@pytest.mark.parametrize("value", [1, 3, 4.0, True, "8"])
def test_max_rollouts_per_call_below_n_or_not_an_int_is_refused(value):
  with pytest.raises(ValueError, match=r"sampling.max_rollouts_per_call=\S+ (is below sampling.n=4|must be null or an integer)"):
    SamplingParams(n=4, max_rollouts_per_call=value)
  assert SamplingParams(n=4, max_rollouts_per_call=np.int64(4)).max_rollouts_per_call == 4
  assert SamplingParams(n=4).max_rollouts_per_call is None


def test_config_passes_max_rollouts_per_call_to_the_sampler():
  required = ["model.path=/m", "data.train_path=/d.jsonl"]
  cfg = load_config(None, required + ["sampling.max_rollouts_per_call=256"])
  assert sampling_params(cfg, (2,)).max_rollouts_per_call == 256
  assert sampling_params(load_config(None, required), (2,)).max_rollouts_per_call is None
  with pytest.raises(ConfigError, match="sampling.max_rollouts_per_call=8 is below sampling.n=16"):
    load_config(None, required + ["sampling.max_rollouts_per_call=8"])


def _collectives_in_loops(hlo: str, larger_than: int = 0) -> int:
  """All-gathers, all-to-alls and all-reduces in the while loops' bodies of compiled HLO text
  whose result has more than ``larger_than`` elements."""
  bodies = while_loop_bodies(hlo)
  assert bodies
  sizes = [int(np.prod([int(d) for d in m.group(1).split(",") if d]))
           for lines in bodies.values() for line in lines
           for m in [re.search(r"= \w+\[([\d,]*)\]\S* (all-gather|all-to-all|all-reduce)", line)]
           if m]
  return sum(size > larger_than for size in sizes)


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_accelerator_loop_gathers_weights_once_per_call(ckpt, whole, monkeypatch, scheduler):
  """On a data mesh the parameters are FSDP-sharded over data; the accelerator (TPU, GPU)
  program gathers them once per call, so its decode loops gather no weight (the rows are split
  over data, the weights replicated there; gathered in the loop: 4 collectives a step here),
  and it samples what one device does. Run on CPU devices, the platform patched. The static
  loop runs no collective at all; continuous batching's loop exchanges only its slots' control
  values (which sample, which step: at most 2 per slot), never weights or cache rows."""
  generate_module = importlib.import_module("rft_jax.sampling.generate")  # the function's name

  monkeypatch.setattr(decoder, "platform_of", lambda mesh: "tpu")
  params = dataclasses.replace(PARAMS, scheduler=scheduler)
  program = continuous.sample_pool if scheduler == "continuous" else loop.sample_loop
  lowered = []

  def recording(*args, **kwargs):
    lowered.append(functools.partial(program.lower, *args, **kwargs))
    return program(*args, **kwargs)

  monkeypatch.setattr(generate_module, "program_for", lambda params, mesh: recording)
  program.clear_cache()
  mesh = make_mesh(data=8, model=1)
  on_mesh = generate(load_hf(ckpt, mesh=mesh), PROMPTS, params, seed=3, mesh=mesh)
  hlo = lowered[-1]().compile().as_text()
  slots = continuous.pool_sizes(len(PROMPTS) * params.n, params.decode_slots, 1, data=8)[0]
  assert _collectives_in_loops(hlo, larger_than=0 if scheduler == "static" else 2 * slots) == 0
  assert _collectives_in_loops(hlo) == 0 or scheduler == "continuous"
  one_device = generate(load_hf(ckpt), PROMPTS, params, seed=3)
  program.clear_cache()
  _assert_same(on_mesh, one_device, exact=False)
  _assert_same(on_mesh, whole, exact=False)  # and what the CPU program samples
