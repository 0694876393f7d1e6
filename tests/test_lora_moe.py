"""LoRA on mixture-of-experts models (issue 54, point 3): an adapter per expert of the targeted
feed-forward projections (and the shared expert's, Qwen2-MoE), the router's, merged in the
forward exactly as the sampler's merged model holds them; what trains; the export."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rft_jax.models import Qwen, QwenConfig, load_hf, save_hf
from rft_jax.models.lora import LoraConfig
from rft_jax.models.lora_model import add_adapters, has_adapters, merged
from rft_jax.rl.learner import Learner

from test_lora import perturbed
from test_learner_moe import tiny_moe

EXPERT_LORA = LoraConfig(rank=4, alpha=8.0, targets=("q", "gate", "up", "down", "router"))


def tiny(family):
  config = QwenConfig(model_type=family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                      shared_expert_intermediate_size=24 if family == "qwen2_moe" else 0)
  return Qwen(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_expert_and_router_adapters_start_at_the_base_and_merge_exactly(family):
  base = tiny(family)
  ids = jax.random.randint(jax.random.key(0), (2, 9), 1, 64)
  model = add_adapters(base, EXPERT_LORA, seed=1)
  adapters = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
  names = {path[-2] for path in adapters}
  assert {"gate_lora", "up_lora", "down_lora", "router_lora", "q_lora"} <= names
  experts = adapters[("layers", "mlp", "gate_lora", "lora_a")].get_value()
  assert experts.shape == (2, 4, 32, 4)  # [L, E, D, r]: one adapter per expert
  shared = [p for p in adapters if "shared_expert" in p]
  assert bool(shared) == (family == "qwen2_moe")
  np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(base(ids)))
  perturbed(model, scale=0.05)
  adapted = model(ids)
  assert np.max(np.abs(adapted - base(ids))) > 1e-2
  plain = merged(model)
  assert plain.config.lora is None and not has_adapters(plain)
  np.testing.assert_allclose(np.asarray(plain(ids)), np.asarray(adapted), atol=1e-5)
  # every adapter matters: zeroing one moves the logits
  for target in ("gate_lora", "down_lora", "router_lora"):
    state = nnx.state(model, nnx.LoRAParam)
    zeroed = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if any(getattr(k, "key", None) == target for k in p) else x, state)
    other = nnx.merge(nnx.graphdef(model), nnx.state(model, nnx.Not(nnx.LoRAParam)), zeroed)
    assert np.max(np.abs(other(ids) - adapted)) > 1e-4, target


def test_only_the_moe_adapters_train_and_replay_gives_the_samplers_log_probs():
  """A learner step on a LoRA MoE policy (experts, router, q): the base stays, every adapter's
  ``B`` leaves zero; with routing replay the log-probs equal the merged (sampler's) model's."""
  from test_learner_moe import bf16_routed_batch, config

  model = perturbed(add_adapters(tiny_moe(), EXPERT_LORA, seed=2), scale=0.05)
  b = bf16_routed_batch(merged(model))  # the sampler's log-probs: the merged weights, replayed ids
  learner = Learner(model, config(routing_replay=True, micro_batch_size=4, lr=1e-2))
  state = learner.init(model)
  before = {p: np.array(v.get_value()) for p, v in nnx.to_flat_state(state.params)}  # the step donates them
  state, metrics = learner.step(state, b)
  assert metrics["logp_mismatch_max"] < 2e-5, metrics["logp_mismatch_max"]
  after = dict(nnx.to_flat_state(state.params))
  for path, var in after.items():
    moved = not np.array_equal(np.asarray(var.get_value()), before[path])
    if path[-1] == "lora_b":
      assert moved, path
    elif not isinstance(var, nnx.LoRAParam):
      assert not moved, path


def test_export_of_a_lora_moe_loads_in_transformers_with_its_logits(tmp_path):
  from hf_fixtures import hf_logits, hf_model
  from moe_fixtures import make_tiny_moe

  source = make_tiny_moe(tmp_path, "qwen2_moe")
  model = perturbed(add_adapters(load_hf(source), EXPERT_LORA, seed=3), scale=0.05)
  out = save_hf(model, tmp_path / "saved", source=source)
  ids = np.random.default_rng(0).integers(3, 256, (2, 9))
  want = np.asarray(merged(model)(jnp.asarray(ids)))
  np.testing.assert_allclose(hf_logits(hf_model(out), ids), want, atol=5e-5, rtol=1e-5)
  assert np.max(np.abs(hf_logits(hf_model(source), ids) - want)) > 1e-2


def test_router_target_on_a_dense_model_is_one_line():
  with pytest.raises(ValueError, match=r"^model.lora.targets: 'router' on a dense model \('qwen3' has no router\)"):
    QwenConfig("qwen3", 64, 32, 64, 1, 4, 2, lora=LoraConfig(rank=2, targets=("q", "router")))
  assert LoraConfig(targets=("all-linear",)).targets == LoraConfig().targets  # the router only when named
  assert LoraConfig(targets=("router",)).targets == ("router",)
