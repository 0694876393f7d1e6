"""QwenConfig from and to HF config.json dicts, both RoPE spellings, presets, and rejections."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from rft_jax.models import CheckpointError, QwenConfig

# Legacy (transformers 4.x) spelling, as in Qwen/Qwen2.5-0.5B-Instruct's config.json.
QWEN2_5_0_5B_HF = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936, "rope_scaling": None,
}
# transformers 5.x spelling, as in Qwen/Qwen3-4B re-saved.
QWEN3_4B_HF = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
    "intermediate_size": 9728, "max_position_embeddings": 40960, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_from_hf_dict_legacy_and_5x_spellings_match_presets():
  assert QwenConfig.from_hf_dict(QWEN2_5_0_5B_HF) == QwenConfig.qwen2_5_0_5b()
  assert QwenConfig.from_hf_dict(QWEN3_4B_HF) == QwenConfig.qwen3_4b()


def test_family_features():
  q2, q3 = QwenConfig.qwen2_5_7b(), QwenConfig.qwen3_4b()
  assert (q2.attention_bias, q2.attention_out_bias, q2.qk_norm) == (True, False, False)
  assert (q3.attention_bias, q3.attention_out_bias, q3.qk_norm) == (False, False, True)
  assert q2.head_dim == 128 and q2.num_groups == 7 and not q2.tie_word_embeddings
  assert q3.head_dim == 128 and q3.num_groups == 4


def test_round_trip_and_runtime_options():
  for config in (QwenConfig.qwen2_5_1_5b(), QwenConfig.qwen3_4b()):
    assert QwenConfig.from_hf_dict(config.to_hf_dict()) == config
  c = QwenConfig.from_hf_dict(QWEN3_4B_HF, dtype=jnp.bfloat16, param_dtype="bfloat16", remat=True)
  assert c.dtype == jnp.bfloat16 and c.param_dtype == jnp.bfloat16 and c.remat
  assert hash(c) == hash(c.replace())  # static in jit: must hash
  assert c.replace(remat=False) != c


def test_transformers_reads_our_config_json():
  from transformers import Qwen2Config, Qwen3Config

  for config, cls in ((QwenConfig.qwen2_5_7b(), Qwen2Config), (QwenConfig.qwen3_4b(), Qwen3Config)):
    theirs = cls.from_dict(config.to_hf_dict())
    assert theirs.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert QwenConfig.from_hf_dict(theirs.to_dict()) == config


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "llama"}, "unsupported model_type 'llama'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "unsupported rope_scaling kind 'yarn'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "unsupported rope_scaling kind 'dynamic'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
     "unsupported rope_parameters kind 'llama3'"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
])
def test_rejections_name_the_field_and_value(changes, message):
  with pytest.raises(CheckpointError, match=message):
    QwenConfig.from_hf_dict({**QWEN2_5_0_5B_HF, **changes})


def test_default_rope_accepted_in_both_spellings():
  d = {**QWEN2_5_0_5B_HF, "rope_scaling": {"rope_type": "default"}, "rope_theta": 5e5}
  assert QwenConfig.from_hf_dict(d).rope_theta == 5e5
  d = {**QWEN2_5_0_5B_HF, "rope_parameters": {"rope_type": "default", "rope_theta": 2e4}}
  assert QwenConfig.from_hf_dict(d).rope_theta == 2e4


def test_inconsistent_shapes_and_features_rejected():
  with pytest.raises(ValueError, match="num_attention_heads=6 is not a multiple of "
                                       "num_key_value_heads=4"):
    QwenConfig("qwen3", 128, 32, 64, 2, 6, 4, head_dim=8)
  with pytest.raises(ValueError, match="attention_bias=False is not expressible for model_type "
                                       "'qwen2'"):
    QwenConfig("qwen2", 128, 32, 64, 2, 4, 2, attention_bias=False)
  with pytest.raises(ValueError, match="qk_norm=False"):
    QwenConfig("qwen3", 128, 32, 64, 2, 4, 2, qk_norm=False)
