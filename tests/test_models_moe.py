"""Qwen3-MoE and Qwen2-MoE against transformers on tiny random checkpoints (hidden 64, 2 layers,
8 experts, top-2): left-padded logits, router logits and the load-balancing loss equal; greedy
samples equal on the static, continuous and paged samplers; replayed routing; export loads back
in transformers; bad configs and checkpoints refused in one line naming the key."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import hf_logits, hf_model, read_json
from moe_fixtures import make_tiny_moe, tiny_moe_hf_config
from rft_jax.models import CheckpointError, QwenConfig, load_hf, save_hf
from rft_jax.models.decode.fused_decode import fused_decode_fits
from rft_jax.models.moe import load_balancing_loss, route, router_z_loss
from rft_jax.sampling import SamplingParams, generate

FAMILIES = ("qwen3_moe", "qwen2_moe")
PROMPTS = [[5, 17, 9, 33, 71, 2, 40], [88, 3], [12, 99, 64, 120, 7], [101]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(2,),
                        scheduler="static")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("moe")
  return {"qwen3_moe": make_tiny_moe(root, "qwen3_moe"),
          "qwen2_moe": make_tiny_moe(root, "qwen2_moe", norm_topk_prob=False)}


@pytest.fixture(scope="module")
def models(ckpts):
  return {family: load_hf(path) for family, path in ckpts.items()}


def _left_padded(vocab=256):
  ids = np.random.default_rng(0).integers(3, vocab, (3, 9))
  mask = np.ones_like(ids)
  mask[1, :3] = 0
  mask[2, :6] = 0
  return ids * mask, mask


_forward = nnx.jit(lambda m, ids, mask: m(ids, mask, return_routing=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_router_logits_and_aux_loss_equal_transformers(ckpts, models, family):
  import torch

  ids, mask = _left_padded()
  reference = hf_model(ckpts[family])
  with torch.no_grad():
    out = reference(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                    output_router_logits=True)
  logits, routing = _forward(models[family], jnp.asarray(ids), jnp.asarray(mask))
  real = mask.astype(bool)
  assert np.abs(np.asarray(logits) - out.logits.numpy())[real].max() <= 1e-4
  config = models[family].config
  assert routing.router_logits.shape == (2, 3, 9, 8) and routing.expert_ids.shape == (2, 3, 9, 2)
  hf_router = np.stack([r.numpy() for r in out.router_logits]).reshape(2, 3, 9, 8)
  assert np.abs(np.asarray(routing.router_logits) - hf_router)[:, real].max() <= 1e-4
  aux = load_balancing_loss(routing.router_logits, config.num_experts_per_tok, jnp.asarray(mask))
  assert abs(float(aux) - float(out.aux_loss)) <= 1e-6
  replayed = load_balancing_loss(routing.router_logits, 2, jnp.asarray(mask), routing.expert_ids)
  assert float(replayed) == float(aux)  # the counted ids are the top-k's
  # Without a mask padding counts, as in transformers (same logits, same padding rows).
  from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
  unmasked = load_balancing_loss_func(
      tuple(torch.tensor(np.asarray(routing.router_logits[i]).reshape(-1, 8)) for i in range(2)),
      8, 2, None)
  assert abs(float(load_balancing_loss(routing.router_logits, 2)) - float(unmasked)) <= 1e-6


def test_routing_replay_keeps_the_routers_gradient(models):
  model = models["qwen3_moe"]
  ids, mask = jnp.asarray(_left_padded()[0]), jnp.asarray(_left_padded()[1])
  logits, routing = _forward(model, ids, mask)
  replayed = model(ids, mask, expert_ids=routing.expert_ids)  # eager: rounding apart from jit
  np.testing.assert_allclose(np.asarray(replayed), np.asarray(logits), atol=1e-5)
  other = jnp.flip(routing.expert_ids, axis=-1)  # the same experts, in the other order: same
  np.testing.assert_allclose(model(ids, mask, expert_ids=other), logits, atol=1e-5)
  shifted = (routing.expert_ids + 1) % 8  # other experts: another function
  assert np.abs(np.asarray(model(ids, mask, expert_ids=shifted)) - np.asarray(logits)).max() > 1e-2

  def loss(m, expert_ids):
    return jnp.sum(jax.nn.log_softmax(m(ids, mask, expert_ids=expert_ids))[..., 7] * mask)

  graphs = nnx.grad(loss)(model, routing.expert_ids)
  router_grad = np.asarray(graphs["layers"]["mlp"]["router"][...])
  assert np.abs(router_grad).max() > 1e-3  # the live router's weights are differentiated
  # route(): the weights at the given ids are the softmax's there, renormalised.
  logits_e = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8)), jnp.float32)
  w, chosen = route(logits_e, 2, True, jnp.asarray([[3, 1]] * 4))
  p = jax.nn.softmax(logits_e)[:, jnp.array([3, 1])]
  np.testing.assert_allclose(w, p / p.sum(-1, keepdims=True), rtol=1e-6)
  assert chosen.dtype == jnp.int32
  z = np.log(np.exp(np.asarray(logits_e, np.float64)).sum(-1)) ** 2  # [4]
  np.testing.assert_allclose(router_z_loss(logits_e[None, None]), z.mean(), rtol=1e-5)
  np.testing.assert_allclose(router_z_loss(logits_e[None, None], jnp.asarray([[1, 1, 0, 0]])),
                             z[:2].mean(), rtol=1e-5)


def test_dense_models_refuse_routing():
  from rft_jax.models import Qwen

  model = nnx.eval_shape(lambda: Qwen(QwenConfig("qwen3", 64, 32, 64, 1, 4, 2), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="need an MoE model; model_type 'qwen3' has no experts"):
    model(jnp.zeros((1, 2), jnp.int32), return_routing=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_and_every_scheduler_agrees(ckpts, models, family):
  import torch

  model = models[family]
  static = generate(model, PROMPTS, GREEDY, seed=0)
  reference = hf_model(ckpts[family])
  for i, prompt in enumerate(PROMPTS):
    ids = torch.tensor([prompt])
    hf = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=GREEDY.max_new_tokens, eos_token_id=2, pad_token_id=0)
    expected = hf[0, len(prompt):].tolist()
    if 2 in expected:
      expected = expected[:expected.index(2) + 1]
    assert static.completions()[i] == expected, f"prompt {i}"
  for params in (dataclasses.replace(GREEDY, scheduler="continuous", decode_slots=2),
                 dataclasses.replace(GREEDY, scheduler="continuous", kv_pages=40, page_size=4)):
    out = generate(model, PROMPTS, params, seed=0)
    np.testing.assert_array_equal(out.completion_ids, static.completion_ids)
    np.testing.assert_allclose(out.logprobs, static.logprobs, atol=1e-5)
  assert "mixture of experts" in fused_decode_fits(model.config, 8)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_back_in_transformers(ckpts, models, family, tmp_path):
  model = models[family]
  out = save_hf(model, tmp_path / "saved", max_shard_bytes=60_000, source=ckpts[family])
  assert (out / "model.safetensors.index.json").is_file()
  assert read_json(out / "config.json")["architectures"] == [
      {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[family]]
  ids, mask = _left_padded()
  real = mask.astype(bool)
  ours = hf_logits(hf_model(out), ids, mask)
  original = hf_logits(hf_model(ckpts[family]), ids, mask)
  np.testing.assert_array_equal(ours[real], original[real])  # the same tensors
  again = load_hf(out)
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)),
                               nnx.to_flat_state(nnx.state(again))):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()),
                                  err_msg=str(path))
  bf16 = save_hf(model, tmp_path / "bf16", dtype="bfloat16")
  assert read_json(bf16 / "config.json")["dtype"] == "bfloat16"
  assert read_json(bf16 / "generation_config.json")["eos_token_id"] == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trips_through_transformers(family):
  hf = tiny_moe_hf_config(family)
  config = QwenConfig.from_hf_dict(hf.to_dict())
  assert config.is_moe and config.num_experts == 8 and config.num_experts_per_tok == 2
  assert config.shared_expert_intermediate_size == (48 if family == "qwen2_moe" else 0)
  back = type(hf)(**config.to_hf_dict())
  assert QwenConfig.from_hf_dict(back.to_dict()) == config


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the key (and both numbers for an expert-count mismatch).

def _with_config(src, tmp_path, **changes):
  dst = tmp_path / "edited"
  shutil.copytree(src, dst)
  d = read_json(dst / "config.json")
  d.update(changes)
  (dst / "config.json").write_text(json.dumps(d))
  return dst


@pytest.mark.parametrize("family,changes,match", [
    ("qwen3_moe", {"scoring_func": "sigmoid"}, r"scoring_func='sigmoid' is not implemented"),
    ("qwen3_moe", {"n_shared_experts": 2}, r"n_shared_experts=2 is not implemented"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 64},
     r"shared_expert_intermediate_size=64: qwen3_moe has no shared expert"),
    ("qwen2_moe", {"shared_expert_gate_type": "softmax"}, r"shared_expert_gate_type='softmax'"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2 is not supported"),
    ("qwen2_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported"),
    ("qwen3_moe", {"num_experts_per_tok": 0}, r"num_experts_per_tok=0 must be a positive"),
])
def test_unsupported_moe_configs_are_refused_naming_the_key(ckpts, tmp_path, family, changes,
                                                            match):
  with pytest.raises(CheckpointError, match=match) as info:
    load_hf(_with_config(ckpts[family], tmp_path, **changes))
  assert "\n" not in str(info.value)


def test_expert_count_mismatch_names_both_numbers(ckpts, tmp_path):
  path = _with_config(ckpts["qwen3_moe"], tmp_path, num_local_experts=6)
  with pytest.raises(CheckpointError, match=r"holds 8 experts per layer .* num_experts=6"):
    load_hf(path)


def test_config_checks_in_code():
  base = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
  QwenConfig(**base)
  with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"):
    QwenConfig(**{**base, "num_experts_per_tok": 5})
  with pytest.raises(ValueError, match="num_experts=4 needs an MoE model_type"):
    QwenConfig(**{**base, "model_type": "qwen3"})
  from rft_jax.models.lora import LoraConfig
  QwenConfig(**base, lora=LoraConfig(rank=2, targets=("q_proj", "v_proj", "gate_proj", "router")))


# ---------------------------------------------------------------------------------------------
# On the fake 8-device mesh, and at full size.

@pytest.mark.parametrize("data,model", [(2, 4), (8, 1)])
def test_expert_parallel_forward_equals_one_device(ckpts, models, data, model):
  from jax.sharding import NamedSharding, PartitionSpec as P

  from rft_jax.parallel import make_mesh

  mesh = make_mesh(data=data, model=model)
  sharded = load_hf(ckpts["qwen2_moe"], mesh=mesh)
  experts = sharded.layers.mlp.expert_up.get_value()  # [L, E, D, I]
  want = P(None, "model", "data", None) if model > 1 else P(None, None, "data", None)
  assert experts.sharding == NamedSharding(mesh, want)
  ids, mask = (jnp.asarray(np.tile(a, (2, 1))[:8]) for a in _left_padded())
  logits, routing = _forward(sharded, ids, mask)
  ref_logits, ref_routing = _forward(models["qwen2_moe"], ids, mask)
  real = np.asarray(mask).astype(bool)
  np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(ref_logits)[real], atol=1e-5)
  np.testing.assert_array_equal(routing.expert_ids, ref_routing.expert_ids)


def test_qwen3_30b_a3b_config_reads_and_builds_abstractly():
  import math
  from pathlib import Path

  from rft_jax.models import abstract_model, read_config
  from rft_jax.parallel import make_mesh, state_shardings

  config = read_config(Path(__file__).parents[1] / "configs/models/Qwen3-30B-A3B",
                       param_dtype=jnp.bfloat16)
  assert config == QwenConfig.qwen3_30b_a3b(param_dtype=jnp.bfloat16)
  model = abstract_model(config)
  state = nnx.state(model)
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
  assert count == 30_532_122_624  # the Hub's safetensors total
  mesh = make_mesh(data=1, model=8)
  experts = state_shardings(state, mesh)["layers"]["mlp"]["expert_gate"].get_value()
  assert experts.shard_shape((48, 128, 2048, 768)) == (48, 16, 2048, 768)
  logits, routing = nnx.eval_shape(lambda m, x: m(x, return_routing=True), model,
                                   jax.ShapeDtypeStruct((2, 16), jnp.int32))
  assert logits.shape == (2, 16, 151936)
  assert routing.router_logits.shape == (48, 2, 16, 128)
  assert routing.expert_ids.shape == (48, 2, 16, 8)


def test_decode_paths_return_the_routing_of_the_full_forward(models):
  """What rollout routing replay records: the cache paths' expert ids of a token equal the full
  forward's at its position (prefill, the XLA step, the feature-major CPU step)."""
  from rft_jax.models import Qwen

  from rft_jax.models.decode import feature_major

  model = models["qwen2_moe"]
  ids, mask = (jnp.asarray(a) for a in _left_padded())
  prompt, next_ids = ids[:, :7], ids[:, 7]
  _, routing = _forward(model, ids, mask)
  logits, cache, prompt_ids = model.prefill(prompt, mask[:, :7], model.init_cache(3, 9),
                                            return_routing=True)
  real = np.asarray(mask[:, :7]).astype(bool)
  np.testing.assert_array_equal(np.asarray(prompt_ids)[:, real],
                                np.asarray(routing.expert_ids)[:, :, :7][:, real])
  _, _, step_ids = model.decode_step(next_ids, cache, return_routing=True)
  np.testing.assert_array_equal(step_ids, routing.expert_ids[:, :, 7])
  weights = feature_major.decode_weights(model)
  _, _, cpu_ids = feature_major.decode_step(model, weights, next_ids, cache, return_routing=True)
  np.testing.assert_array_equal(cpu_ids, routing.expert_ids[:, :, 7])
  dense = nnx.eval_shape(lambda: Qwen(QwenConfig("qwen3", 64, 32, 64, 1, 4, 2),
                                      rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="need an MoE model"):
    dense.decode_step(jnp.zeros((1,), jnp.int32), None, return_routing=True)
