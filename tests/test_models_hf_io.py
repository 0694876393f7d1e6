"""save_hf / load_hf: transformers reloads identical logits, round trips are bitwise, errors name
what is wrong, and the tokenizer helpers format a chat prompt."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hf_fixtures import hf_logits, hf_model, make_tiny_qwen, make_tiny_tokenizer, read_json
from rft_jax.models import (CheckpointError, apply_chat_template, chat_token_ids, load_hf,
                            load_tokenizer, save_hf)


def _ids(batch=2, t=6, vocab=128):
  return np.random.default_rng(0).integers(0, vocab, (batch, t))


def _assert_states_bitwise_equal(a, b):
  fa, fb = dict(nnx.to_flat_state(nnx.state(a))), dict(nnx.to_flat_state(nnx.state(b)))
  assert fa.keys() == fb.keys()
  for path in fa:
    x, y = np.asarray(fa[path].get_value()), np.asarray(fb[path].get_value())
    assert x.dtype == y.dtype and x.shape == y.shape, path
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=str(path))


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("qwen2", False), ("qwen3", True),
                                        ("qwen3", False)])
def test_save_hf_then_transformers_gives_identical_logits(tmp_path, family, tie):
  src = make_tiny_qwen(tmp_path, family, tie=tie, kv_heads=2)
  model = load_hf(src)
  out = save_hf(model, tmp_path / "saved")
  assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
  names = load_file(out / "model.safetensors").keys()
  assert ("lm_head.weight" in names) == (not tie)
  ids = _ids()
  ours = hf_logits(hf_model(out), ids)
  original = hf_logits(hf_model(src), ids)
  np.testing.assert_array_equal(ours, original)  # same tensors -> same torch computation
  jax_logits = np.asarray(model(jnp.asarray(ids)))
  assert np.abs(jax_logits - ours).max() <= 1e-4


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_load_save_load_is_bitwise_lossless(tmp_path, param_dtype):
  src = make_tiny_qwen(tmp_path, "qwen3", tie=False, kv_heads=2, attention_bias=True,
                       dtype="bfloat16" if param_dtype == jnp.bfloat16 else "float32")
  first = load_hf(src, param_dtype=param_dtype)
  save_hf(first, tmp_path / "a")
  second = load_hf(tmp_path / "a", param_dtype=param_dtype)
  _assert_states_bitwise_equal(first, second)
  # Tensors written are bitwise the source tensors.
  a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "a" / "model.safetensors")
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype
    np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)
  assert read_json(tmp_path / "a" / "config.json")["dtype"] == jnp.dtype(param_dtype).name


def test_sharded_checkpoints_both_ways(tmp_path):
  src = make_tiny_qwen(tmp_path, "qwen2", tie=False, kv_heads=2, max_shard_size="40KB")
  assert (src / "model.safetensors.index.json").is_file()
  model = load_hf(src)
  save_hf(model, tmp_path / "out", max_shard_bytes=30_000)
  index = read_json(tmp_path / "out" / "model.safetensors.index.json")
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 2 and all((tmp_path / "out" / f).is_file() for f in files)
  _assert_states_bitwise_equal(model, load_hf(tmp_path / "out"))
  ids = _ids()
  np.testing.assert_array_equal(hf_logits(hf_model(tmp_path / "out"), ids),
                                hf_logits(hf_model(src), ids))


def test_config_round_trip_through_transformers(tmp_path):
  from transformers import AutoConfig

  src = make_tiny_qwen(tmp_path, "qwen3", tie=True, kv_heads=2, head_dim=16)
  model = load_hf(src)
  save_hf(model, tmp_path / "out")
  theirs = AutoConfig.from_pretrained(tmp_path / "out")
  assert theirs.model_type == "qwen3" and theirs.head_dim == 16
  assert theirs.rope_parameters["rope_theta"] == model.config.rope_theta
  assert load_hf(tmp_path / "out").config == model.config
  gen = read_json(tmp_path / "out" / "generation_config.json")
  assert gen == {"bos_token_id": 1, "eos_token_id": 2}


# ------------------------------------------------------------------------------------------------
# Errors.


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return make_tiny_qwen(tmp_path_factory.mktemp("src"), "qwen2", tie=False, kv_heads=2)


def _copy(src, tmp_path):
  dst = tmp_path / "ckpt"
  shutil.copytree(src, dst)
  return dst


def _edit_tensors(path, edit):
  tensors = load_file(path / "model.safetensors")
  edit(tensors)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path, edit):
  config = read_json(path / "config.json")
  edit(config)
  (path / "config.json").write_text(json.dumps(config))


def test_error_missing_tensor_lists_its_name(ckpt, tmp_path):
  path = _copy(ckpt, tmp_path)
  _edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
  with pytest.raises(CheckpointError, match=r"missing 1 tensor.*model\.layers\.1\.self_attn"
                                            r"\.k_proj\.bias"):
    load_hf(path)


def test_error_unexpected_tensor_lists_its_name(ckpt, tmp_path):
  path = _copy(ckpt, tmp_path)
  extra = {"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32),
           "model.layers.7.mlp.up_proj.weight": np.zeros(3, np.float32)}
  _edit_tensors(path, lambda t: t.update(extra))
  with pytest.raises(CheckpointError, match=r"2 unexpected tensor.*model\.layers\.0\.mlp\.extra"
                                            r"\.weight, model\.layers\.7\.mlp\.up_proj\.weight "
                                            r"\(layer 7 >= num_hidden_layers=2\)"):
    load_hf(path)


def test_error_tensor_of_the_other_family_is_named(ckpt, tmp_path):
  path = _copy(ckpt, tmp_path)
  _edit_tensors(path, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight":
                                          np.ones(8, np.float32)}))
  with pytest.raises(CheckpointError, match=r"1 unexpected tensor.*q_norm\.weight \(not used by "
                                            r"this config\)"):
    load_hf(path)


def test_error_corrupt_safetensors_names_the_file(ckpt, tmp_path):
  path = _copy(ckpt, tmp_path)
  (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
  with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file"):
    load_hf(path)


def test_error_shape_mismatch_names_tensor_and_shapes(ckpt, tmp_path):
  path = _copy(ckpt, tmp_path)
  _edit_tensors(path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight":
                                          np.zeros((64, 31), np.float32)}))
  with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: expected "
                                            r"shape \(64, 32\), found \(64, 31\)"):
    load_hf(path)


def test_error_unsupported_model_type(ckpt, tmp_path):
  path = _copy(ckpt, tmp_path)
  _edit_config(path, lambda c: c.update(model_type="llama"))
  with pytest.raises(CheckpointError, match="unsupported model_type 'llama'"):
    load_hf(path)


@pytest.mark.parametrize("field,value", [
    ("rope_scaling", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
])
def test_error_unsupported_rope_scaling(ckpt, tmp_path, field, value):
  path = _copy(ckpt, tmp_path)
  _edit_config(path, lambda c: c.update({field: value}))
  kind = value.get("rope_type", value.get("type"))
  with pytest.raises(CheckpointError, match=f"unsupported {field} kind '{kind}'"):
    load_hf(path)


def test_error_sliding_window(ckpt, tmp_path):
  path = _copy(ckpt, tmp_path)
  _edit_config(path, lambda c: c.update(use_sliding_window=True, sliding_window=64))
  with pytest.raises(CheckpointError, match="use_sliding_window"):
    load_hf(path)


def test_error_directory_without_config(ckpt, tmp_path):
  path = _copy(ckpt, tmp_path)
  (path / "config.json").unlink()
  with pytest.raises(CheckpointError, match="no config.json"):
    load_hf(path)


def test_error_directory_without_weights(ckpt, tmp_path):
  path = _copy(ckpt, tmp_path)
  (path / "model.safetensors").unlink()
  (path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(CheckpointError, match=r"no weights.*pytorch_model\.bin"):
    load_hf(path)


def test_error_index_naming_missing_shard(ckpt, tmp_path):
  path = _copy(ckpt, tmp_path)
  (path / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
  with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
    load_hf(path)


def test_error_index_naming_tensor_absent_from_its_shard(tmp_path):
  src = make_tiny_qwen(tmp_path, "qwen2", tie=True, kv_heads=2, max_shard_size="40KB")
  index = read_json(src / "model.safetensors.index.json")
  files = sorted(set(index["weight_map"].values()))
  name = next(n for n, f in index["weight_map"].items() if f == files[0])
  index["weight_map"][name] = files[1]
  (src / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(CheckpointError, match=f"do not hold: {name} \\(in {files[1]}\\)"):
    load_hf(src)


def test_errors_are_value_errors():
  assert issubclass(CheckpointError, ValueError)


# ------------------------------------------------------------------------------------------------
# Tokenizer helpers.


def test_tokenizer_chat_template(tmp_path):
  tok = load_tokenizer(make_tiny_tokenizer(tmp_path))
  text = apply_chat_template(tok, "what is 1+1 ?", system="be brief")
  assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is 1+1 ?"
                  "<|im_end|>\n<|im_start|>assistant\n")
  assert apply_chat_template(tok, "what").startswith("<|im_start|>user\nwhat<|im_end|>")
  ids = chat_token_ids(tok, "what is 1+1 ?")
  assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "what", "is", "1+1", "?",
                                            "<|im_end|>", "<|im_start|>", "assistant"]


def test_save_hf_writes_tokenizer(ckpt, tmp_path):
  tok = load_tokenizer(make_tiny_tokenizer(tmp_path))
  out = save_hf(load_hf(ckpt), tmp_path / "with_tok", tokenizer=tok)
  again = load_tokenizer(out)
  assert apply_chat_template(again, "what") == apply_chat_template(tok, "what")


def test_export_keeps_the_sources_config_fields_and_generation_config_and_casts(tmp_path):
  """``save_hf(..., source=..., dtype="bfloat16")``: the source's pad_token_id and sampling defaults
  survive, the weights are bfloat16 and transformers gives the float32 model's logits to bf16
  rounding."""
  src = make_tiny_qwen(tmp_path, "qwen3", kv_heads=2)
  config = read_json(src / "config.json")
  config["pad_token_id"] = 3
  (src / "config.json").write_text(json.dumps(config))
  generation = {"bos_token_id": 1, "eos_token_id": [2, 5], "do_sample": True, "temperature": 0.6, "top_p": 0.95}
  (src / "generation_config.json").write_text(json.dumps(generation))
  out = save_hf(load_hf(src), tmp_path / "out", dtype="bfloat16", source=src)
  written = read_json(out / "config.json")
  assert written["pad_token_id"] == 3 and written["torch_dtype"] == written["dtype"] == "bfloat16"
  assert read_json(out / "generation_config.json") == generation
  assert {v.dtype.name for v in load_file(out / "model.safetensors").values()} == {"bfloat16"}
  ids = _ids()
  np.testing.assert_allclose(hf_logits(hf_model(out), ids), hf_logits(hf_model(src), ids), atol=0.1)
  plain = read_json(save_hf(load_hf(src), tmp_path / "plain") / "config.json")
  assert "pad_token_id" not in plain and plain["torch_dtype"] == "float32"  # no source: the model's own
