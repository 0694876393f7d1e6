"""Rollouts to the learner's layout without a host round trip (issue 14): with
``generate(keep_on_device=True)`` the learner's batch is assembled where the sampler left its
outputs, equals the host assembly, and nothing of the completions comes back to the host."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax._src.array import ArrayImpl

from rft_jax.parallel import make_mesh, shard_model
from rft_jax.rl.learner import Learner, learner_batch
from rft_jax.sampling import SamplingParams, generate
from rft_jax.train.step_rollouts import chosen_batch
from test_learner import config, tiny_model

N = 2
PARAMS = SamplingParams(n=N, temperature=1.0, max_new_tokens=12)
SHORT = [[5, 17, 9], [58, 3], [12, 9, 44, 20, 7], [11]]  # prompt bucket 16
LONG = [[3 + i % 50 for i in range(k)] for k in (20, 9, 33)]  # prompt bucket 64


@pytest.fixture(scope="module")
def setup():
  mesh = make_mesh(data=4, model=2)
  model = shard_model(tiny_model(), mesh)
  parts = {}
  for name, prompts, seed in (("short", SHORT, 1), ("long", LONG, 2)):
    parts[name] = {on: generate(model, prompts, PARAMS, seed=seed, mesh=mesh, keep_on_device=on)
                   for on in (False, True)}
  return SimpleNamespace(mesh=mesh, model=model, parts=parts)


@contextlib.contextmanager
def host_reads(monkeypatch):
  """Records the shape of every device array read back to the host (``np.asarray`` and friends)."""
  shapes, read = [], ArrayImpl.__array__

  def recording(self, *args, **kwargs):
    shapes.append(self.shape)
    return read(self, *args, **kwargs)

  with monkeypatch.context() as patch:
    patch.setattr(ArrayImpl, "__array__", recording)
    yield shapes


def test_device_rollouts_hold_the_host_values(setup):
  for pair in setup.parts.values():
    host, device = pair[False], pair[True]
    assert device.logprobs is None and host.on_device is None
    assert isinstance(device.on_device.logprobs, jax.Array)
    assert device.on_device.logprobs.sharding.mesh == setup.mesh
    np.testing.assert_array_equal(device.completion_ids, host.completion_ids)
    np.testing.assert_array_equal(device.completion_lengths, host.completion_lengths)
    np.testing.assert_array_equal(np.asarray(device.on_device.completion_ids), host.completion_ids)
    np.testing.assert_array_equal(np.asarray(device.on_device.logprobs), host.logprobs)


def reference_batch(chosen):
  """The loop's earlier assembly: each part's full host arrays, each group's rows left-padded to
  the widest prompt bucket, concatenated, then leading all-padding columns trimmed to a
  multiple of 16."""
  fields = ("input_ids", "attention_mask", "response_mask", "sampler_logp")
  groups = [{k: getattr(learner_batch(rollouts), k)[rows] for k in fields} for rollouts, rows in chosen]
  width = max(g["input_ids"].shape[1] for g in groups)
  arrays = {k: np.concatenate([np.pad(g[k], ((0, 0), (width - g[k].shape[1], 0))) for g in groups])
            for k in groups[0]}
  used = np.flatnonzero(arrays["attention_mask"].any(axis=0))
  keep = min(width, -(-(width - used[0]) // 16) * 16)
  return {k: v[:, width - keep:] for k, v in arrays.items()}


def chosen_groups(setup, on_device: bool):
  """Groups of both parts, interleaved (as dynamic sampling may pick them)."""
  short, long = (setup.parts[name][on_device] for name in ("short", "long"))
  return [(long, slice(2 * N, 3 * N)), (short, slice(N, 2 * N)), (long, slice(0, N)),
          (short, slice(3 * N, 4 * N))]


def test_the_batch_assembled_on_device_equals_the_host_assembly(setup, monkeypatch):
  expected = reference_batch(chosen_groups(setup, False))
  with host_reads(monkeypatch) as reads:
    on_device = chosen_batch(chosen_groups(setup, True))
    assert not reads  # nothing of the completions came back
  on_host = chosen_batch(chosen_groups(setup, False))
  assert expected["input_ids"].shape == (4 * N, 48)  # 33 + 12 used columns, to a multiple of 16
  assert on_device.advantages is None and on_host.advantages is None  # the algorithm's to set
  for key, value in expected.items():
    assert isinstance(getattr(on_device, key), jax.Array) and isinstance(getattr(on_host, key), np.ndarray)
    np.testing.assert_array_equal(np.asarray(getattr(on_device, key)), value)
    np.testing.assert_array_equal(getattr(on_host, key), value)
  single = [(g[0], g[1]) for g in chosen_groups(setup, True) if g[0] is setup.parts["short"][True]]
  np.testing.assert_array_equal(np.asarray(chosen_batch(single).input_ids),
                                reference_batch(chosen_groups(setup, False)[1::2])["input_ids"])


def test_a_learner_step_on_the_device_batch_equals_one_on_host_arrays(setup, monkeypatch):
  advantages = np.asarray([1.0, -1.0] * (2 * N // 2) * 2, np.float32)[:4 * N]
  metrics = {}
  for on_device in (False, True):
    batch = chosen_batch(chosen_groups(setup, on_device))
    model = shard_model(tiny_model(), setup.mesh)  # the step donates its state: a fresh copy each
    learner = Learner(model, config(micro_batch_size=4), mesh=setup.mesh)
    state = learner.init(model)
    with host_reads(monkeypatch) as reads:
      _, metrics[on_device] = learner.step(state, batch.replace(advantages=advantages))
    # Read back: the [L] column flags (device batch only) and scalar metrics, never a [B, L] array.
    assert all(len(shape) <= 1 and (not shape or shape[0] <= batch.input_ids.shape[1]) for shape in reads)
  for key, value in metrics[False].items():
    np.testing.assert_allclose(metrics[True][key], value, rtol=1e-6, atol=1e-7, err_msg=key)


def test_learner_widths_round_to_a_share_of_the_width():
  """A step's learner width follows its longest prompt; at the paper's 7,168 completion tokens
  prompts of 100-600 tokens make 5 widths (one learner program each), not 32, at most 1/32 of
  padding columns; short batches keep multiples of 16."""
  from rft_jax.train.step_rollouts import width_multiple

  assert [width_multiple(w) for w in (45, 600, 1100, 2048, 7268, 7768)] == [16, 16, 32, 64, 128, 128]
  widths = {-(-(7168 + p) // width_multiple(7168 + p)) * width_multiple(7168 + p)
            for p in range(100, 601)}
  assert len(widths) == 5
  for p in range(1, 3000, 7):
    used = 1024 + p
    padded = -(-used // width_multiple(used)) * width_multiple(used)
    assert padded - used < max(16, used / 32)
