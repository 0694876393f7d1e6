"""The demo's mixture-of-experts variants (issue 54): the builder's model, the shipped
checkpoint, the ``moe_*`` variants' configs and a two-step run of one that prints its router line."""

import filecmp
import functools
import os

import jax
import numpy as np
import pytest
from flax import nnx

from rft_jax.demo import run as demo_run
from rft_jax.demo.build import demo_model_config
from rft_jax.demo.build_moe import moe_demo_model_config
from rft_jax.demo.methods import METHODS
from rft_jax.demo.paths import MOE_CHECKPOINT, REPO_ROOT, load_demo_config
from rft_jax.demo.run import run_demo, split_variants
from rft_jax.models import Qwen, load_hf
from rft_jax.train.preflight import check_routing_replay

DENSE_CHECKPOINT = os.path.join(REPO_ROOT, "rft_jax", "demo", "checkpoint")
MOE_VARIANTS = ("moe_grpo", "moe_grpo_replay", "moe_clip_b", "moe_clip_b_replay")


def _parameters(config) -> int:
  model = nnx.eval_shape(lambda: Qwen(config, rngs=nnx.Rngs(0)))
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


def test_moe_demo_model_is_the_dense_layout_with_8_experts_top_2():
  dense, moe = demo_model_config(40), moe_demo_model_config(40)
  assert moe.is_moe and moe.model_type == "qwen3_moe"
  assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (8, 2, True)
  for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "tie_word_embeddings", "eos_token_id"):
    assert getattr(moe, key) == getattr(dense, key), key
  total = _parameters(moe)
  expert = 3 * moe.hidden_size * moe.moe_intermediate_size
  active = total - moe.num_hidden_layers * (moe.num_experts - moe.num_experts_per_tok) * expert
  assert 0.9e6 < total < 1.05e6  # under 4 MB in float32
  assert 0.35e6 < active < 0.45e6 < _parameters(dense)  # the dense model: 0.8M


def test_shipped_moe_checkpoint_loads_with_the_dense_demos_tokenizer():
  model = load_hf(MOE_CHECKPOINT)
  assert model.config.is_moe and model.config.num_experts == 8
  assert filecmp.cmp(os.path.join(MOE_CHECKPOINT, "tokenizer.json"),
                     os.path.join(DENSE_CHECKPOINT, "tokenizer.json"), shallow=False)
  size = sum(os.path.getsize(os.path.join(MOE_CHECKPOINT, f)) for f in os.listdir(MOE_CHECKPOINT))
  assert size < 4.2e6


@pytest.mark.parametrize("name", MOE_VARIANTS)
def test_moe_variants_train_the_moe_checkpoint_from_any_directory(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # the checkpoint is found from anywhere
  cfg = load_demo_config(None, list(METHODS[name]))
  assert cfg.model.path == MOE_CHECKPOINT
  assert cfg.learner.routing_replay == name.endswith("_replay")
  assert cfg.learner.entropy_mask.kind == ("clip_b" if "clip_b" in name else "none")
  check_routing_replay(cfg)  # the preflight's: replay is allowed, the model is a mixture of experts


def test_moe_variants_leave_the_default_demo_alone():
  variants, _ = split_variants([])
  assert variants == ("grpo", "clip_b", "clip_v")
  assert not any("model.path" in o for v in variants for o in METHODS[v])


def test_two_steps_of_an_moe_variant_print_its_row_and_router_line(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(demo_run, "write_demo_data", functools.partial(demo_run.write_demo_data, heldout_size=8))
  overrides = [f"run_dir={tmp_path}", "steps=2", "eval.every=2", "progress=false", "data.prompts_per_step=4",
               "sampling.n=4", "learner.micro_batch_size=16", "eval.at_start=false", "compilation_cache_dir="]
  variants, overrides = split_variants([*overrides, "variants=moe_clip_b_replay"])
  summaries = run_demo(None, overrides, variants=variants)
  out = capsys.readouterr().out
  assert "moe_clip_b_replay" in out and "routing mismatch" in out
  s = summaries["moe_clip_b_replay"]
  assert 0 <= s["heldout_avg"] <= s["heldout_pass"] <= 1 and np.isfinite(s["entropy_final"])
  assert 0 <= s["routing_mismatch"] <= 1 and np.isfinite(s["load_balancing_loss"])
