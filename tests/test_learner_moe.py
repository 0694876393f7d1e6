"""The learner on a tiny mixture-of-experts policy (hidden 64, 2 layers, 8 experts, top-2): the
router's load-balancing loss and z-loss as learner terms and metrics, the expert load, Clip_B
unchanged, and the routing mismatch and replay of the sampler's expert ids
(``rft_jax.rl.learner.routing``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rft_jax.models import Qwen, QwenConfig
from rft_jax.models.moe import load_balancing_loss, router_z_loss
from rft_jax.rl.config import EntropyMaskConfig, LearnerConfig
from rft_jax.rl.learner import Learner, LearnerBatch
from rft_jax.rl.learner.routing import fed_completion_tokens
from test_learner import nested_optim

VOCAB, PROMPT, COMPLETION, ROWS, EXPERTS, TOP_K = 64, 6, 10, 8, 8, 2


def tiny_moe(seed=0, **kw):
  config = QwenConfig(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                      norm_topk_prob=True, router_aux_loss_coef=0.01, **kw)
  return Qwen(config, rngs=nnx.Rngs(seed))


def batch(rows=ROWS, seed=0, expert_ids=None) -> LearnerBatch:
  """Left-padded prompts, right-padded completions of random tokens; advantages of both signs."""
  rng = np.random.default_rng(seed)
  column = np.arange(PROMPT + COMPLETION)[None]
  prompt = (column >= PROMPT - rng.integers(2, PROMPT + 1, rows)[:, None]) & (column < PROMPT)
  response = (column >= PROMPT) & (column < PROMPT + rng.integers(3, COMPLETION + 1, rows)[:, None])
  attention = prompt | response
  ids = np.where(attention, rng.integers(3, VOCAB, attention.shape), 0)
  return LearnerBatch(input_ids=jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(attention, jnp.int32),
                      response_mask=jnp.asarray(response, jnp.float32),
                      advantages=jnp.asarray(rng.standard_normal(rows), jnp.float32),
                      sampler_logp=jnp.asarray(np.where(response, -rng.exponential(2.0, attention.shape), 0.0),
                                               jnp.float32),
                      expert_ids=expert_ids)


def config(**kw):
  base = dict(lr=1e-3, micro_batch_size=ROWS, forecast_every=0,
              entropy_mask=EntropyMaskConfig(kind="clip_b", mu_low=0.5))
  base.update(kw)
  return LearnerConfig(**nested_optim(base))


_routing = nnx.jit(lambda m, ids, mask: m(ids, mask, return_routing=True)[1])


def test_clip_b_step_reports_the_router_terms_of_its_forward():
  model, b = tiny_moe(), batch()
  routing = _routing(model, b.input_ids, b.attention_mask)
  lb = float(load_balancing_loss(routing.router_logits, TOP_K, b.attention_mask))
  z = float(router_z_loss(routing.router_logits, b.attention_mask))
  real = int(jnp.sum(b.attention_mask))
  learner = Learner(model, config(router_z_loss_coef=0.1))
  assert learner.router.aux_coef == 0.01  # the model config's router_aux_loss_coef
  _, metrics = learner.step(learner.init(model), b)
  assert all(np.isfinite(v) for v in metrics.values()), metrics
  assert metrics["nonfinite_skipped"] == 0 and metrics["mask_frac"] > 0  # Clip_B masked some tokens
  np.testing.assert_allclose(metrics["router/load_balancing_loss"], lb, rtol=1e-6)
  np.testing.assert_allclose(metrics["router/z_loss"], z, rtol=1e-6)
  np.testing.assert_allclose(metrics["router/expert_load_mean"], real * TOP_K / EXPERTS)
  assert real * TOP_K / EXPERTS <= metrics["router/expert_load_max"] <= real
  assert "router/routing_mismatch" not in metrics  # no sampler ids in the batch


def test_router_terms_add_to_the_loss_over_micro_batches():
  """Off (both weights 0) and on, over 4 micro-batches and 2 mini-batches: the loss differs by the
  weighted terms (the mean over the micro-batches' terms of the first update's)."""
  model, b = tiny_moe(), batch()
  losses = {}
  for coefs in ((0.0, 0.0), (0.5, 0.25)):
    m = tiny_moe()
    learner = Learner(m, config(router_aux_loss_coef=coefs[0], router_z_loss_coef=coefs[1], micro_batch_size=2))
    _, metrics = learner.step(learner.init(m), b)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    losses[coefs] = metrics
  routing = _routing(model, b.input_ids, b.attention_mask)
  parts = [(load_balancing_loss(routing.router_logits[:, i::4], TOP_K, b.attention_mask[i::4]),
            router_z_loss(routing.router_logits[:, i::4], b.attention_mask[i::4])) for i in range(4)]
  terms = np.mean([0.5 * float(lb) + 0.25 * float(z) for lb, z in parts])
  np.testing.assert_allclose(losses[0.5, 0.25]["loss"] - losses[0.0, 0.0]["loss"], terms, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(losses[0.5, 0.25]["router/load_balancing_loss"],
                             np.mean([float(lb) for lb, _ in parts]), rtol=1e-5)


def test_mismatch_counts_the_completion_tokens_routed_elsewhere():
  """The sampler's ids as the learner's own top-k but for some tokens: the mismatch is their share."""
  model, b = tiny_moe(), batch()
  routing = _routing(model, b.input_ids, b.attention_mask)
  own = np.moveaxis(np.asarray(routing.expert_ids), 0, 2)  # [B, T, L, k]
  fed = np.asarray(fed_completion_tokens(b.response_mask * b.attention_mask)) > 0
  changed = np.zeros(fed.shape, bool)
  changed[np.nonzero(fed)[0][::3], np.nonzero(fed)[1][::3]] = True
  sampler = own.copy()
  for row, col in zip(*np.nonzero(changed)):  # layer 1's second expert: one the learner did not choose
    sampler[row, col, 1, 1] = min(set(range(EXPERTS)) - set(own[row, col, 1].tolist()))
  learner = Learner(model, config())
  _, metrics = learner.step(learner.init(model), b.replace(expert_ids=jnp.asarray(sampler, jnp.uint8)))
  np.testing.assert_allclose(metrics["router/routing_mismatch"], changed.sum() / fed.sum(), rtol=1e-6)
  np.testing.assert_allclose(metrics["router/routing_mismatch_layers"], changed.sum() / fed.sum() / 2, rtol=1e-6)


def test_routing_replay_is_refused_on_a_dense_model_and_without_ids():
  dense = Qwen(QwenConfig("qwen3", VOCAB, 32, 64, 1, 4, 2), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"learner.routing_replay=true needs a mixture-of-experts model"):
    Learner(dense, config(routing_replay=True))
  assert Learner(dense, config()).router is None
  model = tiny_moe()
  learner = Learner(model, config(routing_replay=True))
  with pytest.raises(ValueError, match="learner.routing_replay=true: the batch has no expert_ids"):
    learner.step(learner.init(model), batch())


def bf16_routed_batch(model, **model_kw):
  """A stand-in for a sampler that routes in bfloat16 (until the sampler records its decode steps'
  routing): expert ids of the weights' bfloat16 forward, log-probs of the float32 forward routed
  by them, completion tokens drawn from it."""
  b = batch()
  bf16 = tiny_moe(dtype=jnp.bfloat16, **model_kw)
  ids = _routing(bf16, b.input_ids, b.attention_mask).expert_ids  # [L, B, T, k]
  logits = nnx.jit(lambda m, x, mask, e: m(x, mask, expert_ids=e))(model, b.input_ids, b.attention_mask, ids)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), b.input_ids[:, 1:, None], -1)[..., 0]
  sampler_logp = jnp.pad(logp, ((0, 0), (1, 0))) * b.response_mask
  return b.replace(sampler_logp=sampler_logp, expert_ids=jnp.moveaxis(ids, 0, 2).astype(jnp.uint8))


@pytest.mark.parametrize("replay,lora", [(False, False), (True, False), (True, True)])
def test_routing_replay_gives_the_samplers_log_probs(replay, lora):
  """The sampler routed some tokens elsewhere (the mismatch > 0, replay on or off); replayed, the
  learner's pre-update log-probs are the sampler's to float32 rounding, and the rollout
  correction's token weights compose with it (1 there); also with LoRA on the attention."""
  from rft_jax.models.lora import LoraConfig
  from rft_jax.rl.config import RolloutCorrectionConfig

  model_kw = {"lora": LoraConfig(rank=4, targets=("q_proj", "v_proj"))} if lora else {}
  model = tiny_moe(**model_kw)
  b = bf16_routed_batch(model, **model_kw)
  learner = Learner(model, config(routing_replay=replay, micro_batch_size=2,
                                  rollout_correction=RolloutCorrectionConfig(importance_sampling="token")))
  _, metrics = learner.step(learner.init(model), b)
  assert all(np.isfinite(v) for v in metrics.values()), metrics
  assert metrics["router/routing_mismatch"] > 0
  if replay:
    assert metrics["logp_mismatch_max"] < 2e-5, metrics["logp_mismatch_max"]
    np.testing.assert_allclose(metrics["rollout_is_max"], 1.0, atol=1e-4)
  else:
    assert metrics["logp_mismatch_max"] > 1e-3


def test_learner_batch_lays_the_recorded_routing_beside_the_tokens():
  """``Rollouts``' prompt and completion expert ids go to ``LearnerBatch.expert_ids`` column by
  column with the tokens (prompt block narrowed, rows chosen), and a wrong shape is refused."""
  from rft_jax.rl.learner import learner_batch
  from rft_jax.sampling.rollouts import Rollouts, compact_expert_ids

  rng = np.random.default_rng(0)
  prompt_ids = np.array([[0, 0, 5, 6], [0, 7, 8, 9]], np.int32)
  prompt_routing = compact_expert_ids(rng.integers(0, EXPERTS, (2, 4, 2, TOP_K)), EXPERTS)
  completion_routing = compact_expert_ids(rng.integers(0, EXPERTS, (4, 3, 2, TOP_K)), EXPERTS)
  assert prompt_routing.dtype == np.uint8 and compact_expert_ids(np.zeros(1), 300).dtype == np.int16
  rollouts = Rollouts(prompt_ids=prompt_ids, prompt_lengths=np.array([2, 3], np.int32),
                      completion_ids=rng.integers(3, VOCAB, (4, 3)).astype(np.int32),
                      completion_lengths=np.array([3, 2, 1, 3], np.int32),
                      logprobs=np.zeros((4, 3), np.float32), finish_reason=np.array(["length"] * 4),
                      prompt_index=np.array([0, 0, 1, 1], np.int32),
                      prompt_expert_ids=prompt_routing, completion_expert_ids=completion_routing)
  got = learner_batch(rollouts, rows=[3, 0], prompt_width=3)
  np.testing.assert_array_equal(got.expert_ids[0], np.concatenate([prompt_routing[1, 1:], completion_routing[3]]))
  np.testing.assert_array_equal(got.expert_ids[1], np.concatenate([prompt_routing[0, 1:], completion_routing[0]]))
  assert got.expert_ids.shape == got.input_ids.shape + (2, TOP_K)
  with pytest.raises(ValueError, match=r"Rollouts.completion_expert_ids has shape \(4, 3, 1, 2\), expected"):
    Rollouts(**{**rollouts.__dict__, "completion_expert_ids": completion_routing[:, :, :1]})


def test_packed_micro_batches_replay_and_count_as_row_micro_batches():
  model = tiny_moe()
  b = bf16_routed_batch(model)
  got = {}
  for tokens in (None, 48):
    m = tiny_moe()
    learner = Learner(m, config(routing_replay=True, micro_batch_size=4, micro_batch_tokens=tokens))
    _, got[tokens] = learner.step(learner.init(m), b)
  assert got[48]["logp_mismatch_max"] < 2e-5
  for key in ("router/routing_mismatch", "router/routing_mismatch_layers", "router/expert_load_max",
              "router/expert_load_mean"):
    np.testing.assert_allclose(got[48][key], got[None][key], rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("kw", [
    dict(entropy_mask=EntropyMaskConfig(kind="clip_v", max_frac=0.2), forecast_every=1),
    dict(entropy_mask=EntropyMaskConfig(), entropy_method={"kind": "clip_cov"}, kl_coef=0.05, mini_batches=2,
         micro_batch_size=2),
    dict(entropy_mask=EntropyMaskConfig(), objective="gspo", micro_batch_size=4, micro_batch_tokens=64),
], ids=["clip_v-forecast", "clip_cov-kl-minibatches", "gspo-packed"])
def test_token_methods_objectives_and_forecasts_run_on_moe(kw):
  model = tiny_moe()
  learner = Learner(model, config(**kw))
  _, metrics = learner.step(learner.init(model), batch())
  assert all(np.isfinite(v) for v in metrics.values()), metrics
  assert metrics["nonfinite_skipped"] == 0 and metrics["router/load_balancing_loss"] > 0
