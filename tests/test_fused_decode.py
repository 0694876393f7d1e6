"""The fused decode step (``rft_jax.models.decode.fused_decode``: five Pallas kernels a layer, here in
Pallas' interpret mode) equals XLA's ``Qwen.decode_step``: logits, caches and the samples of a
seed, over several steps, with one write index shared or one per row; and which step a config
and a device set choose."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rft_jax.models import Qwen, QwenConfig
from rft_jax.models.decode import fused_decode
from rft_jax.models.lora import LoraConfig
from rft_jax.sampling import decoder

STEPS = 6
# The compiled kernels on a GPU (benchmarks/accelerator/gpu.sh tests), elsewhere interpret mode.
FUSED = "fused" if jax.default_backend() == "gpu" else "fused_interpret"


def random_model(family: str, dtype=jnp.float32, seed: int = 0) -> Qwen:
  """A tiny model whose every parameter is random (the biases and norm scales too)."""
  config = QwenConfig(family, vocab_size=96, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, attention_bias=True,  # Qwen3: the output bias too
                      dtype=dtype, param_dtype=jnp.float32, tie_word_embeddings=False)
  model = Qwen(config, rngs=nnx.Rngs(seed))
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [(1.0 if bool(jnp.all(x == 1)) else 0.0)  # norm scales about 1, the rest about 0
            + 0.15 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def prefilled(model: Qwen, rows: int = 8, prompt: int = 5, slots: int = 32, per_row: bool = False):
  """A cache after left-padded prompts of lengths 1 .. ``prompt`` (slots ``[0, prompt)``), and
  the first tokens; ``per_row``: one write index per row, as continuous batching keeps."""
  rng = np.random.default_rng(0)
  lengths = 1 + np.arange(rows) % prompt
  mask = (np.arange(prompt)[None] >= (prompt - lengths)[:, None]).astype(np.int32)
  ids = rng.integers(1, model.config.vocab_size, (rows, prompt)) * mask
  logits, cache = nnx.jit(lambda m, i, k, c: m.prefill(i, k, c))(
      model, jnp.asarray(ids), jnp.asarray(mask), model.init_cache(rows, slots))
  if per_row:  # rows at different write slots, as a pool's are
    cache = cache.replace(index=jnp.asarray(prompt + np.arange(rows) % 3, jnp.int32))
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def run_steps(model: Qwen, tokens, cache, kind: str, seed: int = 0):
  """``STEPS`` decode steps, each row's next token drawn from its logits with a seed's keys."""
  layers = model.unstacked_layers()
  step = nnx.jit(lambda m, t, c: fused_decode.decode_step(m, t, c, layers, kind))
  drawn, all_logits = [], []
  for i in range(STEPS):
    logits, cache = step(model, tokens, cache)
    tokens = jax.random.categorical(jax.random.key(seed * 100 + i), logits).astype(jnp.int32)
    drawn.append(tokens)
    all_logits.append(logits)
  return np.stack(drawn), np.stack(all_logits), cache


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared_index", "per_row_index"])
def test_fused_step_equals_the_xla_step(family, per_row):
  """Float32: the same samples for a seed, logits within float32 rounding, the same caches."""
  model = random_model(family)
  tokens, cache = prefilled(model, per_row=per_row)
  ours = run_steps(model, tokens, cache, FUSED)
  theirs = run_steps(model, tokens, cache, "xla")
  np.testing.assert_array_equal(ours[0], theirs[0])
  np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-4, atol=1e-4)
  for a, b in zip(jax.tree.leaves(ours[2]), jax.tree.leaves(theirs[2])):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-5, atol=1e-5)


def test_fused_step_in_bfloat16_stays_near_the_xla_step():
  """Bfloat16 compute: the kernels round at the XLA step's points but accumulate in another
  order, so logits agree to bfloat16's resolution (a few 1e-2 of logits of size ~3)."""
  model = random_model("qwen2", dtype=jnp.bfloat16)
  tokens, cache = prefilled(model)
  model_state = nnx.merge(nnx.graphdef(model), model.state_in_compute_dtype())  # as samplers do
  ours = run_steps(model_state, tokens, cache, FUSED)
  theirs = run_steps(model_state, tokens, cache, "xla")
  np.testing.assert_allclose(ours[1][0], theirs[1][0], atol=0.1)


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_the_gpu_program_samples_the_same_tokens_with_the_fused_step(monkeypatch, scheduler):
  """The sampler's accelerator program (run here on CPU, told it is a GPU's) with the fused step
  draws the same completions for a seed as with XLA's step, and the same log-probabilities up to
  float32 rounding."""
  from rft_jax.sampling import SamplingParams, generate
  from rft_jax.sampling.generate import program_for

  monkeypatch.setattr(decoder, "platform_of", lambda mesh: "gpu")
  traced = []  # the kinds whose fused step the programs traced
  step = fused_decode.fused_decode_step
  monkeypatch.setattr(fused_decode, "fused_decode_step", lambda *a, **kw: (
      traced.append(kw["interpret"]), step(*a, **kw))[1])
  prompts = [[5, 17, 9, 33, 71, 2, 40], [88, 3], [12, 60, 64, 90, 7], [91]]
  params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, scheduler=scheduler,
                          decode_slots=4)
  base = random_model("qwen3")
  graphdef, state = nnx.split(base)
  outputs = {}
  for kind in ("xla", "fused_interpret"):
    model = nnx.merge(graphdef, state)
    model.config = base.config.replace(decode_kernels=kind)
    program_for(params, None).clear_cache()
    outputs[kind] = generate(model, prompts, params, seed=5)
  program_for(params, None).clear_cache()
  assert traced and all(traced)  # the fused step, in interpret mode, and only for that kind
  ours, theirs = outputs["fused_interpret"], outputs["xla"]
  np.testing.assert_array_equal(ours.completion_ids, theirs.completion_ids)
  np.testing.assert_allclose(ours.logprobs, theirs.logprobs, atol=1e-4)


def test_which_step_a_config_chooses():
  config = random_model("qwen2").config
  kind = fused_decode.decode_kernels_kind
  assert kind(config, "gpu", 1, 64) == "fused"
  assert kind(config, "cpu", 1, 64) == "xla" and kind(config, "tpu", 1, 64) == "xla"
  assert kind(config, "gpu", 2, 64) == "xla"  # one device only
  assert kind(config.replace(decode_kernels="xla"), "gpu", 1, 64) == "xla"
  assert kind(config.replace(decode_kernels="fused_interpret"), "cpu", 1, 64) == "fused_interpret"
  lora = config.replace(lora=LoraConfig(rank=4))
  assert kind(lora, "gpu", 1, 64) == "xla"
  assert kind(config.replace(head_dim=48), "gpu", 1, 64) == "xla"  # halves of 24: no Triton block
  for cfg, platform, devices, message in [
      (config.replace(decode_kernels="fused"), "gpu", 2, "a mesh of 2 devices"),
      (config.replace(decode_kernels="fused"), "cpu", 1, "needs a GPU"),
      (lora.replace(decode_kernels="fused"), "gpu", 1, "LoRA adapters")]:
    with pytest.raises(ValueError, match=message) as error:
      kind(cfg, platform, devices, 64)
    assert "\n" not in str(error.value)
  with pytest.raises(ValueError, match="decode_kernels='fast' is not one of"):
    config.replace(decode_kernels="fast")


def test_the_train_config_names_a_bad_kind():
  from rft_jax.train.config import ConfigError, ModelConfig
  with pytest.raises(ConfigError, match=r"model\.decode_kernels='fast' is not one of"):
    ModelConfig(path="x", decode_kernels="fast")
  assert dataclasses.fields(ModelConfig)  # the key exists with its default
  assert ModelConfig(path="x").decode_kernels == "auto"
