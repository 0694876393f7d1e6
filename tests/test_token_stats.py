"""The chunked per-token pass: equal to the naive full-logits computation, with
gradients, temperature and float32 statistics, and O(chunk x vocab) memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax import entropy as E


def naive_stats(logits, tokens, temperature):
  """The reference: full [positions, V] float32 logits at temperature T."""
  z = logits.astype(jnp.float32) / temperature
  logp = jnp.take_along_axis(jax.nn.log_softmax(z), tokens[..., None], -1)[..., 0]
  return E.TokenStats(logp, E.entropy(z), E.token_discriminator(z, tokens), E.expected_discriminator(z))


@functools.partial(jax.jit, static_argnames="chunk_size")
def chunked_stats(inputs, tokens, unembedding, temperature, chunk_size):
  return E.token_stats(inputs, tokens, unembedding=unembedding, temperature=temperature,
                       chunk_size=chunk_size)


def random_case(b=3, t=7, d=16, v=50, dtype=jnp.float32, seed=0):
  kh, kw, kt = jax.random.split(jax.random.key(seed), 3)
  hidden = jax.random.normal(kh, (b, t, d)).astype(dtype)
  unembedding = (0.5 * jax.random.normal(kw, (d, v))).astype(dtype)
  tokens = jax.random.randint(kt, (b, t), 0, v)
  return hidden, unembedding, tokens


@pytest.mark.parametrize("chunk_size", [None, 4, 5, 21, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_from_logits_and_from_hidden(chunk_size, temperature):
  hidden, w, tokens = random_case()
  logits = hidden @ w
  want = naive_stats(logits, tokens, temperature)
  from_logits = chunked_stats(logits, tokens, None, temperature, chunk_size)
  from_hidden = chunked_stats(hidden, tokens, w, temperature, chunk_size)
  for got in (from_logits, from_hidden):
    for name, a, b in zip(E.TokenStats._fields, got, want):
      assert a.shape == tokens.shape and a.dtype == jnp.float32
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_logp_gradient_equals_naive_and_stats_carry_none(chunk_size):
  hidden, w, tokens = random_case(seed=1)
  weights = jax.random.normal(jax.random.key(9), tokens.shape)

  def loss(fn):
    return lambda h, w: jnp.sum(weights * fn(h, w).logp)

  naive = loss(lambda h, w: naive_stats(h @ w, tokens, 0.7))
  chunked = loss(lambda h, w: E.token_stats(h, tokens, unembedding=w, temperature=0.7,
                                            chunk_size=chunk_size))
  want = jax.jit(jax.grad(naive, argnums=(0, 1)))(hidden, w)
  got = jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

  def stats_sum(h):
    s = E.token_stats(h, tokens, unembedding=w, chunk_size=chunk_size)
    return jnp.sum(s.entropy + s.s_star + s.expected_s)

  assert float(jnp.max(jnp.abs(jax.jit(jax.grad(stats_sum))(hidden)))) == 0.0


def test_bfloat16_inputs_give_float32_statistics():
  hidden, w, tokens = random_case(dtype=jnp.bfloat16, seed=2)
  got = chunked_stats(hidden, tokens, w, 1.0, 4)
  want = naive_stats(jnp.dot(hidden, w, preferred_element_type=jnp.float32), tokens, 1.0)
  for a, b in zip(got, want):
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_temperature_is_applied_to_every_statistic():
  """Entropy of softmax(z) logged while sampling softmax(z / T) is a known bug: at
  T = 0.5 the two differ by a large margin, and token_stats reports the latter."""
  z = 2.0 * jax.random.normal(jax.random.key(3), (64, 100))
  tokens = jnp.zeros((64,), jnp.int32)
  at_half = E.token_stats(z, tokens, temperature=0.5)
  np.testing.assert_allclose(at_half.entropy, E.entropy(z / 0.5), rtol=1e-5)
  np.testing.assert_allclose(at_half.s_star, E.token_discriminator(z / 0.5, tokens), rtol=1e-4, atol=1e-6)
  assert float(jnp.mean(E.entropy(z) - at_half.entropy)) > 0.5


def test_centered_property_and_shape_errors():
  hidden, w, tokens = random_case()
  s = E.token_stats(hidden, tokens, unembedding=w)
  np.testing.assert_array_equal(s.centered, s.s_star - s.expected_s)
  with pytest.raises(ValueError, match="tokens shape"):
    E.token_stats(hidden, tokens[:, :3], unembedding=w)
  with pytest.raises(ValueError, match="unembedding shape"):
    E.token_stats(hidden, tokens, unembedding=w.T)


def compiled_temp_bytes(fn, *shapes):
  return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def test_chunking_bounds_peak_memory():
  """Forward and backward of the hidden-state path at 2048 positions x 32k vocab:
  chunking keeps temporaries to a few chunks of float32 logits, while the naive path
  holds several full [positions, V] tensors."""
  n, d, v, chunk = 2048, 256, 32_000, 256
  h = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((d, v), jnp.bfloat16)
  t = jax.ShapeDtypeStruct((n,), jnp.int32)
  full_logits_bytes, chunk_logits_bytes = n * v * 4, chunk * v * 4

  def fwd_bwd(chunk_size):
    def loss(h, w, t):
      return jnp.sum(E.token_stats(h, t, unembedding=w, chunk_size=chunk_size).logp)
    return jax.value_and_grad(loss, argnums=(0, 1))

  def fwd(chunk_size):
    return lambda h, w, t: E.token_stats(h, t, unembedding=w, chunk_size=chunk_size)

  naive_fwd, chunked_fwd = (compiled_temp_bytes(fwd(c), h, w, t) for c in (None, chunk))
  naive_bwd, chunked_bwd = (compiled_temp_bytes(fwd_bwd(c), h, w, t) for c in (None, chunk))
  assert naive_fwd > full_logits_bytes and naive_bwd > 2 * full_logits_bytes
  # 3.06 chunks under XLA:CPU's default scheduler, 4.06 under the one tests/conftest.py sets;
  # the naive path holds the 8 chunks of the full logits several times over.
  assert chunked_fwd < 5 * chunk_logits_bytes
  # backward also holds the float32 gradient of the unembedding (d x v)
  assert chunked_bwd < 4 * chunk_logits_bytes + 3 * d * v * 4, (chunked_bwd, naive_bwd)


def test_entropy_grad_option_matches_the_gradient_of_entropy():
  hidden, w, tokens = random_case(seed=4)
  def mean_entropy(h, **kw):
    return jnp.mean(E.token_stats(h, tokens, unembedding=w, temperature=0.7, chunk_size=5, **kw).entropy)
  want = jax.grad(lambda h: jnp.mean(E.entropy((h @ w) / 0.7)))(hidden)
  np.testing.assert_allclose(jax.jit(jax.grad(lambda h: mean_entropy(h, entropy_grad=True)))(hidden), want, rtol=1e-4, atol=1e-6)
  assert float(jnp.max(jnp.abs(jax.grad(mean_entropy)(hidden)))) == 0.0


def float64_reference(logits, tokens, temperature):
  """numpy float64: H, log p_k and S_* of softmax(z / T) for float32 logits z. The normaliser is
  log1p of the non-top mass tau (~1e-20 here, below float64's epsilon too)."""
  z = np.asarray(logits, np.float64) / temperature
  shifted = z - z.max(-1, keepdims=True)
  is_top = np.arange(z.shape[-1]) == z.argmax(-1)[:, None]
  log_p = shifted - np.log1p(np.where(is_top, 0.0, np.exp(shifted)).sum(-1, keepdims=True))
  h = -(np.exp(log_p) * log_p).sum(-1)
  log_p_k = np.take_along_axis(log_p, np.asarray(tokens)[:, None], -1)[:, 0]
  return h, log_p_k, np.exp(log_p_k) * (h + log_p_k)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
@pytest.mark.parametrize("chunk_size", [None, 64])
def test_confident_positions_stay_exact_under_jit(temperature, chunk_size):
  """Near one-hot logits (top logit 15-40 above the rest) at T != 1. Under jit XLA fuses z / T
  into the subtraction of the top logit; computed as a difference, the top entry came out one
  ulp from 0 (log p = +1.9e-6, H = -1.9e-6 at T = 0.7, unchunked; S_* off by up to 2e8 times).
  The top entry is 0 by construction: H >= 0, log p <= 0, S_* within float32 rounding."""
  rng = np.random.default_rng(0)
  n, v = 512, 1000
  logits = rng.normal(size=(n, v)).astype(np.float32)
  top = rng.integers(0, v, n)
  logits[np.arange(n), top] += rng.uniform(15, 40, n).astype(np.float32)
  tokens = np.where(rng.random(n) < 0.8, top, rng.integers(0, v, n)).astype(np.int32)
  got = chunked_stats(jnp.asarray(logits), jnp.asarray(tokens), None, temperature, chunk_size)
  h, log_p_k, s_star = float64_reference(logits, tokens, temperature)
  assert float(jnp.min(got.entropy)) >= 0.0 and float(jnp.max(got.logp)) <= 0.0
  confident = tokens == top
  np.testing.assert_allclose(got.s_star[confident], s_star[confident], rtol=2e-5, atol=0)
  np.testing.assert_allclose(got.entropy, h, rtol=2e-5, atol=0)
  np.testing.assert_allclose(got.logp, log_p_k, rtol=2e-5, atol=1e-6)


def test_one_chunk_is_not_rematerialised():
  """jax.checkpoint only where there are several chunks: a single chunk keeps its logits."""
  hidden, w, tokens = random_case()  # 21 positions

  def traced(chunk_size):
    loss = lambda h: jnp.sum(E.token_stats(h, tokens, unembedding=w, chunk_size=chunk_size).logp)
    return str(jax.make_jaxpr(jax.grad(loss))(hidden))

  assert "remat" not in traced(21) and "remat" not in traced(None)
  assert "remat" in traced(5)
