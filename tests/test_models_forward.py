"""The NNX decoder against the Hugging Face torch model on left-padded batches (float32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import hf_logits, hf_model, make_tiny_qwen
from rft_jax.models import load_hf

VOCAB = 128
# (family, tied, kv_heads, extra config): heads=4, so kv_heads 4 is GQA ratio 1, 2 is ratio 2.
VARIANTS = {
    "qwen2-tied-gqa1": ("qwen2", True, 4, {}),
    "qwen2-tied-gqa2": ("qwen2", True, 2, {}),
    "qwen2-untied-gqa1": ("qwen2", False, 4, {}),
    "qwen2-untied-gqa4": ("qwen2", False, 1, {}),
    "qwen3-tied-gqa1": ("qwen3", True, 4, {}),
    "qwen3-tied-gqa2": ("qwen3", True, 2, {}),
    "qwen3-untied-gqa1": ("qwen3", False, 4, {}),
    "qwen3-untied-gqa2-hd16-bias": ("qwen3", False, 2, {"head_dim": 16, "attention_bias": True}),
}
LENGTHS = (7, 4, 1, 6)


def left_padded_batch(lengths=LENGTHS, vocab=VOCAB, seed=0):
  """Random ids ``[B, T]`` (T = max length), left-padded with id 0, and their mask."""
  t = max(lengths)
  rng = np.random.default_rng(seed)
  mask = (np.arange(t)[None] >= (t - np.asarray(lengths))[:, None]).astype(np.int32)
  return rng.integers(1, vocab, (len(lengths), t)) * mask, mask


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
  """(name, checkpoint directory, loaded model) of one variant."""
  family, tie, kv, extra = VARIANTS[request.param]
  path = make_tiny_qwen(tmp_path_factory.mktemp(request.param), family, tie=tie, kv_heads=kv,
                        **extra)
  return request.param, path, load_hf(path)


_forward = nnx.jit(lambda model, ids, mask: model(ids, mask))
_hidden = nnx.jit(lambda model, ids, mask: model(ids, mask, return_hidden=True))


def test_logits_match_hf_per_sequence_on_left_padded_batch(variant):
  name, path, model = variant
  reference = hf_model(path)
  ids, mask = left_padded_batch()
  ours = np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(mask)))
  assert ours.dtype == np.float32 and ours.shape == (*ids.shape, VOCAB)
  t = ids.shape[1]
  worst = 0.0
  for b, n in enumerate(LENGTHS):
    alone = hf_logits(reference, ids[b:b + 1, t - n:])[0]
    worst = max(worst, float(np.abs(ours[b, t - n:] - alone).max()))
  # The padded batch through HF (same mask, positions counted from the first real token).
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  batched = hf_logits(reference, ids, mask, positions)
  worst_batched = float(np.abs((ours - batched)[mask.astype(bool)]).max())
  print(f"\n[max |logit diff| vs HF] {name}: per-sequence {worst:.2e}, "
        f"padded batch {worst_batched:.2e}")
  assert worst <= 1e-4 and worst_batched <= 1e-4


@pytest.mark.parametrize("tie", [True, False])
def test_hidden_states_times_unembedding_are_the_logits(tmp_path, tie):
  model = load_hf(make_tiny_qwen(tmp_path, "qwen2", tie=tie, kv_heads=2))
  ids, mask = (jnp.asarray(a) for a in left_padded_batch())
  hidden = _hidden(model, ids, mask)
  w = model.unembedding()
  assert hidden.shape == (*ids.shape, model.config.hidden_size)
  assert w.shape == (model.config.hidden_size, VOCAB)
  if tie:
    np.testing.assert_array_equal(w, model.embed_tokens[...].T)
  np.testing.assert_allclose(hidden @ w, _forward(model, ids, mask), atol=1e-5, rtol=1e-5)


def test_default_mask_and_positions(tmp_path):
  path = make_tiny_qwen(tmp_path, "qwen3", kv_heads=2)
  model = load_hf(path)
  ids, _ = left_padded_batch(lengths=(5, 5))
  ones = jnp.ones(ids.shape, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(5), ids.shape)
  both = nnx.jit(lambda m, x: (m(x), m(x, ones, positions)))
  implicit, explicit = both(model, jnp.asarray(ids))
  np.testing.assert_array_equal(implicit, explicit)


def test_remat_same_loss_and_gradients(tmp_path):
  path = make_tiny_qwen(tmp_path, "qwen2", tie=False, kv_heads=2)
  ids, mask = left_padded_batch()

  def loss(model):
    logits = model(jnp.asarray(ids), jnp.asarray(mask))
    return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * mask)

  results = []
  for remat in (False, True):
    model = load_hf(path, remat=remat)
    results.append(nnx.jit(nnx.value_and_grad(loss))(model))
  (l0, g0), (l1, g1) = results
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), g0, g1)


def test_bfloat16_compute_and_params_close_to_float32(tmp_path):
  path = make_tiny_qwen(tmp_path, "qwen3", kv_heads=2)
  ids, mask = left_padded_batch()
  f32 = load_hf(path)
  bf16 = load_hf(path, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  leaves = jax.tree.leaves(nnx.state(bf16))
  assert all(x.dtype == jnp.bfloat16 for x in leaves)
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)
  hidden = nnx.eval_shape(lambda m: m(ids, mask, return_hidden=True), bf16)
  assert hidden.dtype == jnp.bfloat16
  a = np.asarray(_forward(f32, ids, mask))
  b = np.asarray(_forward(bf16, ids, mask))
  assert b.dtype == np.float32
  valid = np.asarray(mask).astype(bool)
  assert np.abs(a - b)[valid].max() < 0.25  # bf16 has ~3 significant digits; logits are O(3)
  assert (a.argmax(-1) == b.argmax(-1))[valid].mean() > 0.8
