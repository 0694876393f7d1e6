"""The sampler on a tiny mixture-of-experts model (hidden 64, 2 layers, 8 experts, top-2): the
static, continuous and paged programs record each token's experts per layer
(``rft_jax.sampling.routing_record``), equal to the routing of the full forward; and rollout
routing replay gives the learner the sampler's log-probs to float32 rounding where, without it,
the learner routes some tokens elsewhere (issue 54's done-when). Greedy samples against
transformers on every program: tests/test_models_moe.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rft_jax.rl.learner import Learner, learner_batch
from rft_jax.sampling import decoder
from rft_jax.sampling import SamplingParams, generate
from test_learner_moe import EXPERTS, TOP_K, config, tiny_moe

PROMPTS = [[5, 17, 9, 33, 41, 2, 40], [18, 3], [12, 29, 44, 50, 7], [11]]
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, stop_token_ids=(2,), scheduler="static")
PROGRAMS = {"static": SAMPLED, "continuous": dataclasses.replace(SAMPLED, scheduler="continuous", decode_slots=4),
            "paged": dataclasses.replace(SAMPLED, scheduler="continuous", decode_slots=4, kv_pages=40, page_size=4)}

_routing = nnx.jit(lambda m, ids, mask: m(ids, mask, return_routing=True)[1].expert_ids)


def forward_routing(model, batch):
  """``[B, T, L, k]`` the full forward's top-k of the learner batch's tokens, sorted per token."""
  return np.sort(np.moveaxis(np.asarray(_routing(model, batch.input_ids, batch.attention_mask)), 0, 2), -1)


def test_every_program_records_the_routing_of_the_tokens_it_ran():
  model = tiny_moe()
  recorded = {}
  for name, params in PROGRAMS.items():
    rollouts = generate(model, PROMPTS, params, seed=3)
    assert rollouts.completion_expert_ids.dtype == np.uint8
    assert rollouts.completion_expert_ids.shape == (8, 8, 2, TOP_K)
    batch = learner_batch(rollouts)
    response = np.asarray(batch.response_mask) > 0
    fed = response & np.concatenate([response[:, 1:], np.zeros_like(response[:, :1])], axis=1)
    prompt = (np.asarray(batch.attention_mask) > 0) & ~response
    want, got = forward_routing(model, batch), np.sort(np.asarray(batch.expert_ids), -1)
    np.testing.assert_array_equal(got[fed], want[fed], err_msg=name)
    np.testing.assert_array_equal(got[prompt], want[prompt], err_msg=name)
    assert not np.asarray(batch.expert_ids)[response & ~fed].any(), name  # a completion's last: never fed
    recorded[name] = (rollouts.completion_ids, np.asarray(batch.expert_ids))
  for name in ("continuous", "paged"):
    np.testing.assert_array_equal(recorded[name][0], recorded["static"][0])
    np.testing.assert_array_equal(np.sort(recorded[name][1], -1), np.sort(recorded["static"][1], -1))


def near_tied_moe():
  """A model whose routers score every expert almost alike (a shared column plus 3e-7 noise): the
  top-k turns on float rounding, so the sampler's decode steps and the learner's full forward
  route some tokens differently, as bfloat16 kernels or another batch shape do at scale."""
  model = tiny_moe()
  router = model.layers.mlp.router  # [L, D, E]
  shared = jax.random.normal(jax.random.key(1), router[...].shape[:2] + (1,))
  noise = 3e-7 * jax.random.normal(jax.random.key(2), router[...].shape)
  router[...] = (shared + noise).astype(router[...].dtype)
  return model


@pytest.mark.parametrize("program", ["static", "paged"])
def test_replay_gives_the_learner_the_samplers_log_probs(program):
  model = near_tied_moe()
  rollouts = generate(model, PROMPTS * 2, PROGRAMS[program], seed=0)
  advantages = np.random.default_rng(0).standard_normal(len(rollouts)).astype(np.float32)
  batch = learner_batch(rollouts, advantages=advantages)
  metrics = {}
  for replay in (False, True):
    m = near_tied_moe()
    learner = Learner(m, config(routing_replay=replay, micro_batch_size=len(rollouts)))
    _, metrics[replay] = learner.step(learner.init(m), batch)
  assert metrics[False]["router/routing_mismatch"] > 0  # the learner's own routing differs
  assert metrics[False]["logp_mismatch_max"] > 1e-4
  assert metrics[True]["logp_mismatch_max"] < 2e-5, metrics[True]["logp_mismatch_max"]
  assert all(np.isfinite(v) for v in metrics[True].values())


@pytest.mark.parametrize("program", ["static", "paged"])
def test_a_data_mesh_records_what_one_device_does(program):
  """Rows over ``data`` (the paged pools one per shard): the same samples and routing."""
  from rft_jax.parallel import make_mesh, shard_model

  mesh = make_mesh(data=2, model=1, devices=jax.devices()[:2])
  model = tiny_moe()
  alone = generate(model, PROMPTS, PROGRAMS[program], seed=5)
  on_mesh = generate(shard_model(tiny_moe(), mesh), PROMPTS, PROGRAMS[program], seed=5, mesh=mesh)
  np.testing.assert_array_equal(on_mesh.completion_ids, alone.completion_ids)
  np.testing.assert_array_equal(np.sort(on_mesh.completion_expert_ids, -1), np.sort(alone.completion_expert_ids, -1))
  np.testing.assert_array_equal(np.sort(on_mesh.prompt_expert_ids, -1), np.sort(alone.prompt_expert_ids, -1))


@pytest.mark.parametrize("program", ["static", "continuous"])
def test_the_accelerator_programs_record_what_the_cpu_programs_do(program, monkeypatch):
  """The programs an accelerator compiles (the model's own decode step: the fused kernels decline
  MoE), traced here on the CPU: the same samples, log-probs and routing as the CPU programs'."""
  from rft_jax.sampling.generate import program_for

  model, params = tiny_moe(), PROGRAMS[program]
  program_for(params, None).clear_cache()
  on_cpu = generate(model, PROMPTS, params, seed=7)
  monkeypatch.setattr(decoder, "platform_of", lambda mesh: "gpu")
  program_for(params, None).clear_cache()
  on_gpu = generate(model, PROMPTS, params, seed=7)
  program_for(params, None).clear_cache()
  np.testing.assert_array_equal(on_gpu.completion_ids, on_cpu.completion_ids)
  np.testing.assert_allclose(on_gpu.logprobs, on_cpu.logprobs, atol=1e-5)
  np.testing.assert_array_equal(np.sort(on_gpu.completion_expert_ids, -1), np.sort(on_cpu.completion_expert_ids, -1))
  np.testing.assert_array_equal(np.sort(on_gpu.prompt_expert_ids, -1), np.sort(on_cpu.prompt_expert_ids, -1))


@pytest.mark.parametrize("program", ["static", "continuous", "paged"])
def test_record_routing_off_records_nothing_and_samples_the_same(program):
  """``sampling.record_routing: false`` (the evaluation's rollouts): no expert ids, the same
  completions and log-probabilities as the recording program."""
  model = tiny_moe()
  recorded = generate(model, PROMPTS, PROGRAMS[program], seed=5)
  plain = generate(model, PROMPTS, dataclasses.replace(PROGRAMS[program], record_routing=False), seed=5)
  assert recorded.completion_expert_ids is not None
  assert plain.completion_expert_ids is None and plain.prompt_expert_ids is None
  np.testing.assert_array_equal(plain.completion_ids, recorded.completion_ids)
  np.testing.assert_allclose(plain.logprobs, recorded.logprobs, atol=1e-6)
  with pytest.raises(ValueError, match=r"^sampling.record_routing='no' must be true or false$"):
    SamplingParams(record_routing="no")
