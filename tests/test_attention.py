"""Memory-efficient causal self-attention against the materialised einsum, and its memory in T."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import make_tiny_qwen
from rft_jax.models import load_hf
from rft_jax.models.attention import (attend, attention_kind, blockwise_self_attention,
                                      causal_padding_mask, causal_self_attention)

PADDINGS = {"left": (9, 0), "right": (0, 7), "both": (5, 6), "none": (0, 0)}


def _inputs(kv_heads: int, t: int = 40, heads: int = 4, h: int = 8, seed: int = 0):
  """q, k, v of 3 rows and their ``valid`` mask: row 0 per ``PADDINGS``, row 1 unpadded, row 2
  all padding."""
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (3, t, heads, h))
  k = jax.random.normal(keys[1], (3, t, kv_heads, h))
  v = jax.random.normal(keys[2], (3, t, kv_heads, h))
  return q, k, v


def _valid(t: int, left: int, right: int) -> np.ndarray:
  valid = np.ones((3, t), bool)
  valid[0, :left] = False
  valid[0, t - right:] = False
  valid[2] = False
  return valid


def _reference(q, k, v, valid):
  return attend(q, k, v, causal_padding_mask(valid))


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=lambda k: f"groups{4 // k}")
@pytest.mark.parametrize("padding", sorted(PADDINGS))
def test_blockwise_equals_einsum_forward_and_gradient(kv_heads, padding):
  """Blocks of 16 queries over T = 40 (a partial last block): equal at every real query, with
  equal gradients of a loss over the real queries; padding outputs finite."""
  q, k, v = _inputs(kv_heads)
  valid = jnp.asarray(_valid(q.shape[1], *PADDINGS[padding]))
  weights = jax.random.normal(jax.random.key(1), q.shape) * valid[:, :, None, None]

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v, valid) * weights)

  blockwise = lambda q, k, v, valid: blockwise_self_attention(q, k, v, valid, block_size=16)
  ours, expected = jax.jit(blockwise)(q, k, v, valid), _reference(q, k, v, valid)
  assert np.isfinite(np.asarray(ours)).all()
  np.testing.assert_allclose(np.asarray(ours)[np.asarray(valid)],
                             np.asarray(expected)[np.asarray(valid)], rtol=1e-5, atol=1e-5)
  grads = jax.jit(jax.grad(lambda *a: loss(blockwise, *a), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(lambda *a: loss(_reference, *a), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(grads, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_attention_kind_by_backend_and_dtype():
  assert attention_kind("auto", "cpu", jnp.bfloat16) == "blockwise"
  assert attention_kind("auto", "tpu", jnp.float32) == "splash"
  assert attention_kind("auto", "gpu", jnp.bfloat16) == "cudnn"
  assert attention_kind("auto", "gpu", jnp.float32) == "blockwise"  # cuDNN flash: 16-bit only
  assert attention_kind("reference", "tpu", jnp.float32) == "reference"
  with pytest.raises(ValueError, match="'flash' is not one of"):
    attention_kind("flash", "cpu", jnp.float32)


@pytest.mark.parametrize("family,extra", [("qwen2", {}), ("qwen3", {"attention_bias": True})],
                         ids=["qwen2-biases", "qwen3-qk-norm-biases"])
def test_model_forward_gradient_and_prefill_blockwise_equal_reference(tmp_path, family, extra):
  """A random Qwen2 (q/k/v biases) and Qwen3 (q/k norm, all biases), GQA 2, on left-padded rows
  longer than one 512-query block: logits, parameter gradients and prefill + decode."""
  path = make_tiny_qwen(tmp_path, family, tie=False, kv_heads=2, **extra)
  blockwise, reference = (load_hf(path, attention=kind) for kind in ("blockwise", "reference"))
  t, lengths = 600, np.array([600, 530, 17])
  rng = np.random.default_rng(0)
  mask = (np.arange(t)[None] >= (t - lengths)[:, None]).astype(np.int32)
  ids = jnp.asarray(rng.integers(1, 128, (3, t)) * mask)
  mask = jnp.asarray(mask)

  def loss(model):
    logits = model(ids, mask)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * mask)

  forward = nnx.jit(lambda m: m(ids, mask))
  real = np.asarray(mask, bool)
  np.testing.assert_allclose(np.asarray(forward(blockwise))[real],
                             np.asarray(forward(reference))[real], rtol=1e-5, atol=1e-5)
  grads = [nnx.state(nnx.jit(nnx.grad(loss))(m)) for m in (blockwise, reference)]
  for g, w in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):  # float32 sums of ~1e3
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-6 * float(np.abs(w).max()))

  @nnx.jit
  def prefill_then_decode(m):
    logits, cache = m.prefill(ids, mask, m.init_cache(3, t + 16))
    step_logits, _ = m.decode_step(jnp.argmax(logits, -1).astype(jnp.int32), cache)
    return logits, step_logits

  logits, step_logits = prefill_then_decode(blockwise)
  full = forward(reference)
  np.testing.assert_allclose(logits, full[:, -1], rtol=1e-5, atol=1e-5)
  extended = jnp.concatenate([ids, jnp.argmax(logits, -1)[:, None].astype(ids.dtype)], axis=1)
  expected = nnx.jit(lambda m: m(extended, jnp.pad(mask, ((0, 0), (0, 1)), constant_values=1)))(
      reference)[:, -1]
  np.testing.assert_allclose(step_logits, expected, rtol=1e-5, atol=1e-5)


def _attention_temp_bytes(kind: str, t: int) -> int:
  """Compiled temporaries (CPU) of the forward and gradient of one row's attention at length t."""
  shape = jax.ShapeDtypeStruct((1, t, 4, 16), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
  valid = jax.ShapeDtypeStruct((1, t), jnp.bool_)

  def loss(q, k, v, valid):
    return jnp.sum(causal_self_attention(q, k, v, valid, kind=kind))

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  return grad.lower(shape, kv, kv, valid).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_in_length():
  """Temporaries at T = 1k, 4k, 8k: blockwise about doubles with T (linear), the einsum about
  quadruples (quadratic)."""
  lengths = (1024, 4096, 8192)
  blockwise = [_attention_temp_bytes("blockwise", t) for t in lengths]
  reference = [_attention_temp_bytes("reference", t) for t in lengths]
  print(f"\n[attention temp MiB at T={lengths}] blockwise {[b >> 20 for b in blockwise]}, "
        f"einsum {[b >> 20 for b in reference]}")
  assert blockwise[2] / blockwise[1] < 2.5 and blockwise[1] / blockwise[0] < 2.5 * 4
  assert reference[2] / reference[1] > 3.5  # the check can tell quadratic from linear
  assert blockwise[2] < reference[2] / 8
