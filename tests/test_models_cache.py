"""KV-cache decoding equals the full forward at every step (as flax gemma's
``test_forward_no_cache``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import make_tiny_qwen
from rft_jax.models import KVCache, Qwen, QwenConfig, load_hf

from rft_jax.models.decode import cpu_attention, feature_major

LENGTHS = (6, 3, 1)
STEPS = 5
MAX_LEN = 16


def left_padded_batch(lengths=LENGTHS, vocab=128, seed=0):
  t = max(lengths)
  rng = np.random.default_rng(seed)
  mask = (np.arange(t)[None] >= (t - np.asarray(lengths))[:, None]).astype(np.int32)
  return rng.integers(1, vocab, (len(lengths), t)) * mask, mask


@pytest.fixture(scope="module", params=[("qwen2", False, 2), ("qwen3", True, 1),
                                        ("qwen3", False, 4)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}-kv{p[2]}")
def model(request, tmp_path_factory):
  family, tie, kv = request.param
  return load_hf(make_tiny_qwen(tmp_path_factory.mktemp("ckpt"), family, tie=tie, kv_heads=kv))


_forward = nnx.jit(lambda m, ids, mask: m(ids, mask))
_prefill = nnx.jit(lambda m, ids, mask, cache: m.prefill(ids, mask, cache))
_decode = nnx.jit(lambda m, tokens, cache: m.decode_step(tokens, cache), donate_argnums=2)


def test_feature_major_decode_step_equals_decode_step(model):
  """The CPU decode loop's step (weights transposed once, feature-major activations, ``[V, B]``
  logits, elementwise attention scores) equals ``Qwen.decode_step``: logits and every cache field,
  over two steps (the second reads the first one's cache)."""
  _check_feature_major(model)


def test_feature_major_decode_step_with_the_attention_kernel_equals_decode_step(model, cpu_kernel):
  """The same with the step's attention by the compiled CPU kernel (the sampler's default on one
  CPU device), which reads only each row's live slots: the left-padded prompts' padding and the
  slots not yet written are skipped. On the CPU backend, also where the default one is an
  accelerator (the kernel has a handler on CPU only)."""
  cpu = jax.devices("cpu")[0]
  graphdef, state = nnx.split(model)
  with jax.default_device(cpu):
    _check_feature_major(nnx.merge(graphdef, jax.device_put(state, cpu)),
                         attention=cpu_attention.attend)


@pytest.mark.parametrize("kernel", [False, True], ids=["attend", "kernel"])
def test_feature_major_rows_not_live_leave_the_live_rows_and_the_cache_as_they_were(
    model, kernel, request):
  """``live``: the rows left out (a continuous pool's stopped slots) attend to the slot they
  write only, so the kernel skips their caches; the live rows' logits and cache rows are the same
  bits as without ``live``, so are the slot masks, positions and indices, and the other rows'
  logits and cache rows stay finite, also at a write index past the cache's end (clamped, as
  the write is)."""
  attention = feature_major.attend
  if kernel:
    request.getfixturevalue("cpu_kernel")
    attention = cpu_attention.attend
  prompt, mask = left_padded_batch()
  cache = model.init_cache(len(LENGTHS), MAX_LEN)
  _, cache = _prefill(model, jnp.asarray(prompt), jnp.asarray(mask), cache)
  cache = cache.replace(index=jnp.asarray([6, 9, MAX_LEN + 3], jnp.int32))
  live = jnp.asarray([True, False, False])
  step = nnx.jit(lambda m, c, live: feature_major.decode_step(
      m, feature_major.decode_weights(m), jnp.asarray([3, 5, 7]), c, attention, live=live))
  with jax.default_device(jax.devices("cpu")[0]):
    want, want_cache = step(model, cache, None)
    got, got_cache = step(model, cache, live)
  np.testing.assert_array_equal(np.asarray(got)[:, 0], np.asarray(want)[:, 0])
  assert np.isfinite(np.asarray(got)).all()
  assert not np.array_equal(np.asarray(got)[:, 1], np.asarray(want)[:, 1])  # one slot, not ten
  for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
    np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])
    assert np.isfinite(np.asarray(a)).all()
  for name in ("slot_mask", "positions", "index"):
    np.testing.assert_array_equal(getattr(got_cache, name), getattr(want_cache, name))


def test_unstacked_layers_at_traced_indices_equal_the_constant_slices(model):
  """``unstacked_layers(at=...)`` (the sampler's form: indices that are arguments of the
  program) gives every layer's parameters exactly; a wrong count of indices is an error."""
  layers = model.config.num_hidden_layers
  at = jax.jit(lambda m, ids: nnx.state(m.unstacked_layers(at=ids)))(
      model, tuple(jnp.int32(i) for i in range(layers)))
  jax.tree.map(np.testing.assert_array_equal, at, nnx.state(model.unstacked_layers()))
  with pytest.raises(ValueError, match=f"1 layer indices for {layers} layers"):
    model.unstacked_layers(at=(jnp.int32(0),))


def test_state_in_compute_dtype():
  """The accelerator sampler's weights: matrices and biases cast to the compute dtype as the
  layers cast them, the norm scales (Qwen3's q/k norms too) as stored, so a model merged from
  them computes the same logits."""
  config = QwenConfig("qwen3", 128, 64, 96, 2, 4, 2, head_dim=16, attention_bias=True,
                      dtype=jnp.bfloat16, param_dtype=jnp.float32)
  model = Qwen(config, rngs=nnx.Rngs(2))
  graphdef, stored = nnx.split(model)
  cast = model.state_in_compute_dtype()
  names = set()
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(stored), jax.tree.leaves(cast)):
    name = jax.tree_util.keystr(path)
    names.add(name)
    expected = a if "scale" in name else a.astype(jnp.bfloat16)
    assert b.dtype == expected.dtype, name
    np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(expected, np.float32))
  assert {"['layers']['attn']['q_norm']['scale'].value", "['embed_tokens'].value",
          "['layers']['attn']['q_bias'].value"} <= names
  ids = jnp.asarray([[3, 7, 11, 5]])
  np.testing.assert_array_equal(nnx.merge(graphdef, cast)(ids), model(ids))


def test_feature_major_with_output_bias_and_a_bfloat16_cache():
  """The same with the parts the checkpoints above lack: Qwen3 with q/k/v and output biases
  (random, not zero), and a bfloat16 cache under float32 compute."""
  config = QwenConfig("qwen3", 128, 64, 96, 2, 4, 2, head_dim=16, attention_bias=True)
  model = Qwen(config, rngs=nnx.Rngs(0))
  assert config.attention_out_bias and config.qk_norm
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  state = jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
                                       for x, k in zip(leaves, keys)])
  _check_feature_major(nnx.merge(graphdef, state), cache_dtype=jnp.bfloat16)


def _check_feature_major(model, cache_dtype=None, attention=feature_major.attend):
  prompt, mask = left_padded_batch()
  cache = model.init_cache(len(LENGTHS), MAX_LEN, dtype=cache_dtype)
  _, cache = _prefill(model, jnp.asarray(prompt), jnp.asarray(mask), cache)

  @nnx.jit
  def two_steps(m, cache):
    weights = feature_major.decode_weights(m)
    out = []
    for tokens in (jnp.asarray([3, 5, 7]), jnp.asarray([11, 2, 9])):
      logits, cache_rows = m.decode_step(tokens, cache[0] if out else cache)
      vocab_major, cache_feat = feature_major.decode_step(m, weights, tokens,
                                                          cache[1] if out else cache, attention)
      out.append((logits, vocab_major))
      cache = (cache_rows, cache_feat)
    return out, cache

  steps, (cache_rows, cache_feat) = two_steps(model, cache)
  for logits, vocab_major in steps:
    assert vocab_major.shape == logits.shape[::-1]
    np.testing.assert_allclose(vocab_major.T, logits, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(cache_rows), jax.tree.leaves(cache_feat)):
    assert a.dtype == b.dtype
    # The cached keys and values are products summed in another order (weight-first): within
    # float32 rounding of their sums, the logits' tolerance (atol 1e-6 failed by 1.2e-6 on an
    # AMD EPYC, at HEAD before per-row cache indices). Step 2's entries also carry step 1's
    # attention (layer by layer): by the kernel, within rtol 2e-5 / atol 2e-6 of attend's
    # (tests/test_cpu_attention.py; the same bits on any x86-64 CPU), scaled by values of order
    # 1; max |diff| 1.3e-6 with either attention on the EPYC of 2026-11-27, so 1e-5 holds both.
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-5, atol=1e-5)


def _reference(model, prompt, mask, tokens):
  """Full-forward logits of the prompt plus ``tokens`` at the last prompt position and after."""
  ids = np.concatenate([prompt, tokens], axis=1)
  full_mask = np.concatenate([mask, np.ones_like(tokens)], axis=1)
  logits = np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(full_mask)))
  return logits[:, prompt.shape[1] - 1:]  # [B, STEPS + 1, V]


def test_prefill_then_decode_equals_full_forward(model):
  prompt, mask = left_padded_batch()
  tokens = np.random.default_rng(1).integers(1, 128, (len(LENGTHS), STEPS))
  expected = _reference(model, prompt, mask, tokens)
  cache = model.init_cache(len(LENGTHS), MAX_LEN)
  logits, cache = _prefill(model, jnp.asarray(prompt), jnp.asarray(mask), cache)
  diffs = [float(np.abs(logits - expected[:, 0]).max())]
  for step in range(STEPS):
    logits, cache = _decode(model, jnp.asarray(tokens[:, step]), cache)
    diffs.append(float(np.abs(logits - expected[:, step + 1]).max()))
  print(f"\n[cache vs full forward] max |diff| per step: {['%.1e' % d for d in diffs]}")
  assert max(diffs) <= 1e-5
  assert int(cache.index) == prompt.shape[1] + STEPS
  np.testing.assert_array_equal(cache.positions, np.asarray(LENGTHS) + STEPS)
  np.testing.assert_array_equal(cache.slot_mask[:, :prompt.shape[1]], mask.astype(bool))
  assert not np.asarray(cache.slot_mask[:, prompt.shape[1] + STEPS:]).any()


def test_split_merge_jax_jit_and_while_loop_carry(tmp_path):
  """The cache is a plain pytree: jax.jit over (graphdef, state) and a while_loop carry work."""
  model = load_hf(make_tiny_qwen(tmp_path, "qwen3", tie=True, kv_heads=1))
  graphdef, state = nnx.split(model)
  prompt, mask = left_padded_batch()
  batch = len(LENGTHS)

  @functools.partial(jax.jit, donate_argnums=1)
  def greedy(state, cache, prompt, mask):
    m = nnx.merge(graphdef, state)
    logits, cache = m.prefill(prompt, mask, cache)

    def body(carry):
      i, logits, cache, out = carry
      token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      logits, cache = m.decode_step(token, cache)
      return i + 1, logits, cache, out.at[:, i].set(token)

    out = jnp.zeros((batch, STEPS), jnp.int32)
    _, _, cache, out = jax.lax.while_loop(lambda c: c[0] < STEPS, body,
                                          (0, logits, cache, out))
    return out, cache

  cache = model.init_cache(batch, MAX_LEN)
  assert isinstance(cache, KVCache)
  tokens, cache = greedy(state, cache, jnp.asarray(prompt), jnp.asarray(mask))
  assert int(cache.index) == prompt.shape[1] + STEPS
  # Each greedy token is the argmax of the full forward over the prompt and earlier tokens.
  expected = _reference(model, prompt, mask, np.asarray(tokens))
  np.testing.assert_array_equal(expected[:, :STEPS].argmax(-1), tokens)


def test_cache_shapes_and_dtype(model):
  c = model.config
  cache = model.init_cache(2, 8, dtype=jnp.bfloat16)
  assert len(cache.k) == len(cache.v) == c.num_hidden_layers
  assert cache.k[0].shape == (2, c.num_key_value_heads, c.head_dim, 8)
  assert cache.v[0].shape == (2, c.num_key_value_heads, 8, c.head_dim)
  assert cache.dtype == jnp.bfloat16 and cache.max_len == 8
  with pytest.raises(ValueError, match="exceed the cache length 8"):
    model.prefill(jnp.ones((2, 9), jnp.int32), jnp.ones((2, 9), jnp.int32), cache)
