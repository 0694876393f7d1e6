"""LoRA adapters of the policy (rft_jax.models.lora, lora_model; the learner's LoRA plumbing in
rft_jax.rl.model_trainer): the adapted model at init, the merged weights, what trains, what the
optimizer holds, checkpoints, the sampler and the Hugging Face export."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rft_jax.models import Qwen, QwenConfig
from rft_jax.models.lora import PROJECTIONS, LoraConfig
from rft_jax.models.lora_model import add_adapters, has_adapters, merged
from rft_jax.rl.config import EntropyMaskConfig, LearnerConfig
from rft_jax.rl.learner import Learner
from rft_jax.rl.optimizer import OptimizerConfig

from test_learner import VOCAB, synthetic_batch

LORA = LoraConfig(rank=4, alpha=8.0)
HF_ATOL = 5e-5  # transformers' float32 logits against ours (see the export test)


def tiny_model(seed=0, family="qwen3", **kw):
  config = QwenConfig(model_type=family, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, tie_word_embeddings=True, **kw)
  return Qwen(config, rngs=nnx.Rngs(seed))


def perturbed(model, seed=1, scale=0.1):
  """``model`` (in place) with random values in every adapter matrix (``B`` no longer zero)."""
  adapters = nnx.state(model, nnx.LoRAParam)
  leaves, treedef = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  nnx.update(model, jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                                 for x, k in zip(leaves, keys)]))
  return model


def learner_config(**kw):
  base = dict(micro_batch_size=4, forecast_every=0, optim=OptimizerConfig(lr=3e-3, max_grad_norm=1.0))
  base.update(kw)
  return LearnerConfig(**base)


# ---------------------------------------------------------------------------------------------
# Config.

def test_lora_config_normalises_targets_and_names_bad_values():
  assert LoraConfig().targets == PROJECTIONS
  assert LoraConfig(targets=("v", "q_proj", "down")).targets == ("q_proj", "v_proj", "down_proj")
  assert LoraConfig(targets=("all-linear",)).targets == PROJECTIONS
  assert LoraConfig(rank=8, alpha=16).scale == 2.0
  for kw, key in [({"rank": 0}, "model.lora.rank"), ({"rank": 2.5}, "model.lora.rank"),
                  ({"alpha": -1.0}, "model.lora.alpha"), ({"alpha": float("nan")}, "model.lora.alpha"),
                  ({"targets": ("qkv",)}, "model.lora.targets"), ({"targets": ()}, "model.lora.targets")]:
    with pytest.raises(ValueError, match=key) as info:
      LoraConfig(**kw)
    assert "\n" not in str(info.value)


def test_run_config_reads_model_lora():
  from rft_jax.train.config import ConfigError, load_config

  required = ["model.path=/m", "data.train_path=/d"]
  assert load_config(None, required).model.lora is None
  cfg = load_config(None, required + ["model.lora.rank=8", "model.lora.targets=[q,v]"])
  assert cfg.model.lora == LoraConfig(rank=8, alpha=32.0, targets=("q_proj", "v_proj"))
  with pytest.raises(ConfigError, match=r"model\.lora\.rank") as info:
    load_config(None, required + ["model.lora.rank=0"])
  assert "\n" not in str(info.value)
  with pytest.raises(ConfigError, match=r"model\.lora\.targets"):
    load_config(None, required + ["model.lora.targets=[qkv]"])


def test_demo_lora_variant_configures():
  from rft_jax.demo.methods import METHODS
  from rft_jax.train.config import load_config

  cfg = load_config("configs/demo.yaml", METHODS["lora"], required=())
  assert cfg.model.lora is not None and cfg.model.lora.rank >= 1
  assert cfg.learner.entropy_mask.kind == "none"


# ---------------------------------------------------------------------------------------------
# The model.

@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_adapters_start_at_the_base_and_merge_exactly(family):
  base = tiny_model(family=family)
  ids = jax.random.randint(jax.random.key(0), (2, 7), 0, VOCAB)
  want = base(ids)
  model = add_adapters(base, LORA)
  assert has_adapters(model) and not has_adapters(base)
  adapters = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
  assert len(adapters) == 2 * len(PROJECTIONS)
  for path, var in adapters.items():
    assert isinstance(var, nnx.LoRAParam) and var.get_value().dtype == jnp.float32
    if path[-1] == "lora_b":
      assert not np.any(np.asarray(var.get_value()))  # B = 0: the base's function
  np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(want))
  perturbed(model)
  adapted = model(ids)
  assert np.max(np.abs(adapted - want)) > 1e-2
  plain = merged(model)
  assert plain.config.lora is None and not has_adapters(plain)
  np.testing.assert_allclose(np.asarray(plain(ids)), np.asarray(adapted), atol=2e-5)
  # the cache path of the adapted model (the unmerged projections) agrees with the merged model
  cache = model.init_cache(2, 12)
  logits, cache = model.prefill(ids, jnp.ones_like(ids), cache)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(adapted[:, -1]), atol=2e-5)


def test_targets_choose_the_adapted_projections_and_bfloat16_base():
  base = tiny_model(param_dtype=jnp.bfloat16)
  model = add_adapters(base, LoraConfig(rank=2, targets=("q", "down")))
  names = {p[-2] for p, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  assert names == {"q_lora", "down_lora"}
  base_dtypes = {v.get_value().dtype for _, v in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.LoRAParam)))}
  assert base_dtypes == {jnp.dtype(jnp.bfloat16)}
  perturbed(model)
  plain = merged(model)
  flat = dict(nnx.to_flat_state(nnx.state(plain)))
  assert flat[("layers", "attn", "q_proj")].get_value().dtype == jnp.bfloat16
  # untargeted weights are the base's arrays, shared
  assert flat[("layers", "attn", "k_proj")].get_value() is dict(nnx.to_flat_state(nnx.state(model)))[
      ("layers", "attn", "k_proj")].get_value()


def test_feature_major_decoding_refuses_an_unmerged_model():
  from rft_jax.models.decode.feature_major import decode_weights

  with pytest.raises(ValueError, match="merged"):
    decode_weights(add_adapters(tiny_model(), LORA))


# ---------------------------------------------------------------------------------------------
# The learner.

def _flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_only_the_adapters_train_and_adamw_holds_only_them():
  base = tiny_model()
  batch, _ = synthetic_batch(base)
  model = add_adapters(base, LORA)
  learner = Learner(model, learner_config())
  state = learner.init(model)
  adapter_size = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
  base_size = sum(x.size for x in jax.tree.leaves(nnx.state(base, nnx.Param)))
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert sum(x.size for x in moments) == 2 * adapter_size  # AdamW's mu and nu, adapters only
  assert sum(x.size for x in jax.tree.leaves(state.params)) == base_size + adapter_size
  before = _flat(state.params)
  state, metrics = learner.step(state, batch)
  assert metrics["grad_norm"] > 0 and metrics["nonfinite_skipped"] == 0.0
  after = _flat(state.params)
  changed = {k for k in before if not np.array_equal(before[k], after[k])}
  assert changed and all("lora" in k for k in changed)
  assert any("lora_b" in k for k in changed)
  # the step's model for the sampler is the merged one, and it moved
  plain = learner.model(state)
  assert not has_adapters(plain)


@pytest.mark.parametrize("micro", [4, 16])
def test_token_statistics_and_masks_at_init_equal_full_fine_tuning(micro):
  """At init (B = 0) a LoRA step sees the base model: the same entropy, S_*, masks, loss."""
  base = tiny_model()
  batch, _ = synthetic_batch(base)
  cfg = learner_config(micro_batch_size=micro, entropy_mask=EntropyMaskConfig(kind="clip_b", mu_low=0.3))
  full = Learner(base, cfg)
  _, m_full, rows_full = full.step(full.init(base), batch, rows=True)
  model = add_adapters(tiny_model(), LORA)
  lora = Learner(model, cfg)
  _, m_lora, rows_lora = lora.step(lora.init(model), batch, rows=True)
  for key in ("entropy", "s_star_mean", "s_centered_mean", "mask_frac", "mask_frac_negative", "loss",
              "logp_mismatch", "entropy_change_forecast", "response_tokens"):
    assert m_lora[key] == pytest.approx(m_full[key], rel=1e-6, abs=1e-7), key
  assert m_full["mask_frac"] > 0
  for key in rows_full:
    np.testing.assert_allclose(rows_lora[key], rows_full[key], rtol=1e-6, atol=1e-7)


def test_entropy_change_measurement_with_adapters():
  base = tiny_model()
  batch, _ = synthetic_batch(base)
  model = add_adapters(base, LORA)
  learner = Learner(model, learner_config(forecast_every=1))
  state, metrics = learner.step(learner.init(model), batch)
  assert np.isfinite(metrics["entropy_change_measured"]) and np.isfinite(metrics["entropy_change_first_order"])
  assert metrics["entropy_change_first_order"] != 0.0


def test_checkpoint_resume_is_exact(tmp_path):
  """Two steps straight equal one step, a save, a restore onto a fresh template, one step."""
  from rft_jax.train.checkpoint import RunCheckpointer

  base = tiny_model()
  batches = [synthetic_batch(base, seed=s)[0] for s in (0, 1)]

  def fresh():
    model = add_adapters(tiny_model(), LORA, seed=3)
    learner = Learner(model, learner_config(micro_batch_size=8))
    return learner, learner.init(model)

  learner, state = fresh()
  metrics_straight = []
  for batch in batches:
    state, metrics = learner.step(state, batch)
    metrics_straight.append(metrics)
  straight = _flat(state)

  learner, state = fresh()
  state, metrics = learner.step(state, batches[0])
  assert metrics == metrics_straight[0]
  checkpointer = RunCheckpointer(str(tmp_path / "checkpoints"), async_save=False)
  checkpointer.save(1, state, {"seed": 0})
  checkpointer.close()
  learner, template = fresh()
  checkpointer = RunCheckpointer(str(tmp_path / "checkpoints"))
  state, _, step = checkpointer.restore(template)
  checkpointer.close()
  assert step == 1
  state, metrics = learner.step(state, batches[1])
  assert metrics == metrics_straight[1]
  resumed = _flat(state)
  assert resumed.keys() == straight.keys()
  for key in straight:
    np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)


# ---------------------------------------------------------------------------------------------
# The sampler and the export.

def test_greedy_samples_of_the_merged_weights_follow_the_adapted_forward():
  """``generate`` decodes the merged weights (its CPU decode kernels read weights directly); its
  greedy completions are the argmax chain of the adapted model's own full forward."""
  from rft_jax.sampling import SamplingParams, generate

  model = perturbed(add_adapters(tiny_model(), LORA), scale=0.3)
  prompts = [[5, 9, 17, 3], [11, 2, 40, 7], [1, 60, 33, 21]]
  out = generate(model, prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=6), seed=0)
  ids = jnp.asarray(prompts, jnp.int32)
  forward = jax.jit(lambda ids: model(ids)[:, -1])
  for _ in range(6):
    ids = jnp.concatenate([ids, jnp.argmax(forward(ids), -1)[:, None].astype(ids.dtype)], axis=1)
  np.testing.assert_array_equal(np.asarray(out.completion_ids), np.asarray(ids[:, 4:]))
  unmerged = jnp.argmax(add_adapters(tiny_model(), LORA)(jnp.asarray(prompts))[:, -1], -1)
  assert not np.array_equal(np.asarray(out.completion_ids[:, 0]), np.asarray(unmerged))  # the adapters matter


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_export_merges_the_adapters_into_a_directory_transformers_loads(tmp_path, family):
  """``rft-jax export`` of a LoRA run's checkpoint: transformers' logits of the written
  directory are the merged JAX model's."""
  import shutil

  from hf_fixtures import hf_logits, hf_model, make_tiny_qwen, make_tiny_tokenizer
  from rft_jax import cli
  from rft_jax.models import load_hf
  from rft_jax.train.checkpoint import RunCheckpointer
  from rft_jax.train.config import load_config, to_yaml

  source = make_tiny_qwen(tmp_path, family, tie=family == "qwen3", vocab=128)
  for f in make_tiny_tokenizer(tmp_path).iterdir():
    shutil.copy(f, source / f.name)
  run = tmp_path / "run"
  cfg = load_config(None, [f"model.path={source}", "data.train_path=/d", f"run_dir={run}", "seed=5",
                           "model.lora.rank=4", "model.lora.alpha=12", "model.lora.targets=[q,k,v,o,gate,up,down]"])
  run.mkdir()
  (run / "config.yaml").write_text(to_yaml(cfg))
  model = perturbed(add_adapters(load_hf(source), cfg.model.lora, seed=cfg.seed), scale=0.2)
  learner = Learner(model, cfg.learner)
  state = learner.init(model)
  checkpointer = RunCheckpointer(str(run / "checkpoints"), async_save=False)
  checkpointer.save(1, state, {"seed": cfg.seed})
  checkpointer.close()
  out = tmp_path / "hf"
  assert cli.main(["export", str(run), str(out)]) == 0
  ids = np.random.default_rng(0).integers(0, 128, (2, 9))
  want = np.asarray(merged(learner.merge(state.params))(jnp.asarray(ids)))
  # float32 sums in torch's order and XLA's: 1.2e-5 apart at worst on an AVX-512 EPYC, whose
  # kernels block the sums otherwise than AVX2's (the base's logits are 1e-2 away and more)
  np.testing.assert_allclose(hf_logits(hf_model(out), ids), want, atol=HF_ATOL, rtol=1e-5)
  assert np.max(np.abs(hf_logits(hf_model(source), ids) - want)) > 1e-2  # not the base's


def test_sharded_lora_step_and_sampler_equal_single_device():
  """On a data=4 x model=2 mesh: adapters laid out by their logical axes, AdamW's moments like
  them, the merged weights like the base's; the step and greedy samples as on one device."""
  from rft_jax.parallel import make_mesh, shard_model
  from rft_jax.sampling import SamplingParams, generate

  batch, _ = synthetic_batch(tiny_model())
  model = perturbed(add_adapters(tiny_model(), LORA), scale=0.05)
  single = Learner(model, learner_config(micro_batch_size=8))
  s1, m1 = single.step(single.init(model), batch)
  mesh = make_mesh(data=4, model=2)
  sharded = perturbed(add_adapters(shard_model(tiny_model(), mesh), LORA, mesh=mesh), scale=0.05)
  learner = Learner(sharded, learner_config(micro_batch_size=8), mesh=mesh)
  state = learner.init(sharded)
  adapters = nnx.state(sharded, nnx.LoRAParam)
  assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(adapters))
  adapter_layout = [x.sharding for x in jax.tree.leaves(learner.trainable(state.params))]
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert [x.sharding for x in moments] == adapter_layout * 2
  s2, m2 = learner.step(state, batch)
  for k in ("loss", "grad_norm", "entropy"):
    assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-7), k
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_allclose(a, np.asarray(b), rtol=1e-4, atol=1e-6)
  plain = learner.model(s2)
  base = dict(nnx.to_flat_state(nnx.state(learner.merge(s2.params))))
  for path, var in nnx.to_flat_state(nnx.state(plain)):
    assert var.get_value().sharding == base[path].get_value().sharding, path
  params = SamplingParams(n=2, temperature=0.0, max_new_tokens=5)
  prompts = [[5, 9, 17, 3], [11, 2, 40, 7]]
  on_mesh = generate(plain, prompts, params, seed=0, mesh=mesh)
  alone = generate(single.model(s1), prompts, params, seed=0)
  np.testing.assert_array_equal(on_mesh.completion_ids, alone.completion_ids)


# ---------------------------------------------------------------------------------------------
# rft-jax plan.

def test_plan_counts_the_frozen_base_and_the_adapters_moments(tmp_path, capsys):
  """``rft-jax plan`` with model.lora: the train state's parameters are the base (bfloat16
  here) and the float32 adapters; AdamW's moments cover the adapters only; the sampler's merged
  weights are a copy beside the train state's targeted weights and adapters."""
  import json

  from rft_jax import cli
  from rft_jax.plan.devices import topology
  from rft_jax.plan.fit import plan
  from rft_jax.train.config import load_config

  model_dir = tmp_path / "model"
  model_dir.mkdir()
  # V=256, D=64, F=128, L=2, N=4, K=2, H=16 (untied: an lm_head)
  config = QwenConfig("qwen3", 256, 64, 128, 2, 4, 2, head_dim=16)
  (model_dir / "config.json").write_text(json.dumps(config.to_hf_dict()))
  run = tmp_path / "run.yaml"
  run.write_text(f"model: {{path: {model_dir}, param_dtype: bfloat16}}\n"
                 "data: {prompts_per_step: 2, max_prompt_len: 16}\n"
                 "sampling: {n: 2, max_new_tokens: 16}\nlearner: {micro_batch_size: 4}\n")
  lora = ["model.lora.rank=4", "model.lora.targets=[q,v,down]"]
  report = plan(load_config(str(run), lora + ["mesh.data=1"], required=()), topology("cpu:1"))
  learner, sampler = report["learner"], report["sampler"]
  d, f, layers, n, k, h, r = 64, 128, 2, 4, 2, 16, 4
  adapters = layers * r * ((d + n * h) + (d + k * h) + (f + d))  # A [in, r] + B [r, out] per target
  base = (2 * 256 * d + layers * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f + 2 * d + 2 * h) + d)
  assert learner["trainable_parameters"] == adapters
  assert learner["trainable_parameter_bytes"] == 4 * adapters  # float32
  assert learner["parameter_bytes"] == 2 * base + 4 * adapters  # the base in bfloat16
  assert 0 <= learner["optimizer_state_bytes"] - 2 * 4 * adapters <= 16  # mu and nu, the adapters'
  targeted = layers * (d * n * h + d * k * h + f * d)
  assert sampler["resident_bytes"] == learner["optimizer_state_bytes"] + 2 * targeted + 4 * adapters
  assert report["model"]["lora"] == {"rank": 4, "alpha": 32.0, "targets": ["q_proj", "v_proj", "down_proj"]}
  assert report["fits"]
  cli.main(["plan", str(run), *lora, "mesh.data=1", "--topology", "cpu:1"])
  assert "lora     rank 4, alpha 32 on q_proj, v_proj, down_proj" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# A run.

def test_a_lora_run_trains_resumes_and_exports(tmp_path):
  """``rft-jax train`` with model.lora on 8 fake devices (data=4 x model=2): two steps, then
  one more after a resume from the step-2 checkpoint, then ``rft-jax export``, which
  transformers loads; the base weights in the checkpoint are the starting ones."""
  from hf_fixtures import hf_logits, hf_model
  from loop_fixtures import make_loop_files, overrides
  from rft_jax import cli
  from rft_jax.train.checkpoint import restore_policy
  from rft_jax.train.metrics_log import read_metrics

  setup = make_loop_files(tmp_path)
  run = tmp_path / "run"
  lora = ["model.lora.rank=4", "model.lora.alpha=8", "learner.optim.lr=1e-2", "eval.every=0",
          "checkpoint_every=2", "rewards.functions=[reward_fixtures:odd_length]"]
  assert cli.main(["train", *overrides(setup, run, 2, *lora)]) == 0
  assert cli.main(["train", *overrides(setup, run, 3, *lora)]) == 0
  records = [r for r in read_metrics(str(run)) if "actor/loss" in r]
  assert [r["step"] for r in records] == [1, 2, 3]
  assert all(np.isfinite(r["actor/loss"]) for r in records)
  assert any(r["actor/grad_norm"] > 0 for r in records)  # groups with reward variance
  out = tmp_path / "hf"
  assert cli.main(["export", str(run), str(out)]) == 0
  model, _, step = restore_policy(str(run))
  assert step == 3 and not has_adapters(model)
  ids = np.random.default_rng(0).integers(0, 128, (2, 9))
  exported = hf_logits(hf_model(out), ids)
  np.testing.assert_allclose(exported, np.asarray(model(jnp.asarray(ids))), atol=HF_ATOL, rtol=1e-5)
  assert np.max(np.abs(exported - hf_logits(hf_model(setup[1]), ids))) > 1e-4  # trained


def test_kl_reference_of_a_lora_policy():
  """kl_coef > 0: the reference is the starting policy (base and zero ``B``), so the first
  on-policy step measures no KL; another checkpoint as reference takes the adapters' structure."""
  base = tiny_model()
  batch, _ = synthetic_batch(base)
  model = add_adapters(base, LORA)
  learner = Learner(model, learner_config(kl_coef=0.1))
  state, metrics = learner.step(learner.init(model), batch)
  assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)
  other = add_adapters(tiny_model(seed=7), LORA)  # as build_run adapts model.ref_path's model
  policy = add_adapters(tiny_model(), LORA)
  learner = Learner(policy, learner_config(kl_coef=0.1), reference=other)
  state = learner.init(policy)
  _, metrics = learner.step(state, batch)
  assert metrics["kl"] > 1e-4


def test_a_bfloat16_base_trains_float32_adapters():
  """A bfloat16 base (param_dtype) with bfloat16 compute: the adapters and their moments stay
  float32, the step moves them only, and the merged weights are bfloat16."""
  base = tiny_model(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  batch, _ = synthetic_batch(tiny_model())
  model = add_adapters(base, LORA)
  learner = Learner(model, learner_config(micro_batch_size=8))
  state = learner.init(model)
  assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim > 0} == {jnp.dtype(jnp.float32)}
  before = _flat(state.params)
  state, metrics = learner.step(state, batch)
  assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
  after = _flat(state.params)
  changed = {k for k in before if not np.array_equal(before[k], after[k])}
  assert changed and all("lora" in k for k in changed)
  assert {after[k].dtype for k in after if "lora" in k} == {np.dtype(np.float32)}
  plain = learner.model(state)
  assert {v.get_value().dtype for _, v in nnx.to_flat_state(nnx.state(plain))} == {jnp.dtype(jnp.bfloat16)}
