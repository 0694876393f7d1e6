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


def test_chunked_path_is_a_closed_form_derivative_with_small_residuals():
  """Several chunks: one jax.custom_jvp per chunk (closed-form derivative, reverse mode its
  transpose) under a jax.checkpoint that keeps only [positions]-sized statistics and the
  inputs, never [., V] logits. One chunk: its closed form without the checkpoint (the block's
  residuals kept, no recomputation). chunk_size=None: plain autodiff, logits kept."""
  hidden, w, tokens = random_case()  # 21 positions, V = 50

  def stats(h, w, chunk_size):
    return E.token_stats(h, tokens, unembedding=w, temperature=0.7, chunk_size=chunk_size,
                         entropy_grad=True)

  def traced(chunk_size):
    loss = lambda h: jnp.sum(stats(h, w, chunk_size).logp)
    return str(jax.make_jaxpr(stats, static_argnums=2)(hidden, w, chunk_size)), str(jax.make_jaxpr(jax.grad(loss))(hidden))

  forward, backward = traced(None)
  assert "custom_jvp" not in forward and "remat" not in backward
  forward, backward = traced(21)
  assert "custom_jvp" in forward and "remat" not in backward
  forward, backward = traced(5)
  assert "custom_jvp" in forward and "remat" in backward

  def residual_shapes(chunk_size):
    _, vjp = jax.vjp(lambda h, w: stats(h, w, chunk_size), hidden, w)
    return [leaf.shape for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "shape")]

  v = w.shape[1]
  for chunk_size in (None, 21):  # the reference and one closed-form chunk keep [21, V]
    assert [s for s in residual_shapes(chunk_size) if v in s and s != w.shape], chunk_size
  chunked = residual_shapes(5)
  assert chunked.count(w.shape) == 1 and not [s for s in chunked if v in s and s != w.shape], chunked


def grad_case(dtype, seed, n=21, d=16, v=50, scale=1.0):
  hidden, w, tokens = random_case(b=1, t=n, d=d, v=v, dtype=dtype, seed=seed)
  weights = jax.random.normal(jax.random.key(seed + 100), (3, 1, n), dtype)
  return hidden, scale * w, tokens, weights


def stats_loss(fn, weights):
  """A scalar of every statistic: gradients flow through logp (and entropy with
  entropy_grad) only, S_* and E_p[S] being stop-gradient in both paths."""
  def loss(*args):
    s = fn(*args)
    return (jnp.sum(weights[0] * s.logp) + jnp.sum(weights[1] * s.entropy)
            + jnp.sum(weights[2] * (s.s_star + s.expected_s))), s
  return loss


def assert_close(got, want, rtol, err_msg=""):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype, err_msg
  assert np.all(np.isfinite(got)), err_msg
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(float(np.max(np.abs(want))), 1e-30),
                             err_msg=err_msg)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk_size", [5, 8, 64])  # 21 positions: 4 chunks + 1, 2 chunks + 5, one chunk
def test_closed_form_values_and_gradients_equal_autodiff_of_reference(dtype, temperature, entropy_grad, chunk_size):
  """The chunked closed-form derivative against JAX's autodiff through the reference
  (chunk_size=None), from hidden states + unembedding (gradients wrt both) and from logits
  (gradient wrt the logits): equal to float32 rounding, float64 to ~1e-12."""
  with jax.enable_x64(dtype == "float64"):
    dt = jnp.dtype(dtype)
    rtol = 2e-5 if dt == jnp.float32 else 1e-11
    hidden, w, tokens, weights = grad_case(dt, seed=11, scale=3.0)  # logits of std ~6

    def from_hidden(chunk_size):
      return stats_loss(lambda h, u: E.token_stats(h, tokens, unembedding=u, temperature=temperature,
                                                   chunk_size=chunk_size, entropy_grad=entropy_grad), weights)

    def from_logits(chunk_size):
      return stats_loss(lambda z: E.token_stats(z, tokens, temperature=temperature,
                                                chunk_size=chunk_size, entropy_grad=entropy_grad), weights)

    for make, args in ((from_hidden, (hidden, w)), (from_logits, (hidden @ w,))):
      argnums = tuple(range(len(args)))
      (want_loss, want), want_grads = jax.jit(jax.value_and_grad(make(None), argnums, has_aux=True))(*args)
      (got_loss, got), got_grads = jax.jit(jax.value_and_grad(make(chunk_size), argnums, has_aux=True))(*args)
      for name, a, b in zip(E.TokenStats._fields, got, want):
        assert a.dtype == dt
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol, err_msg=name)
      for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        assert a.dtype == args[i].dtype
        assert_close(a, b, rtol, err_msg=f"{make.__name__} grad {i}")
      if not entropy_grad:  # the entropy's weight must not reach the gradient
        no_entropy = weights.at[1].set(0.0)
        loss = stats_loss(lambda *a: make(chunk_size)(*a)[1], no_entropy)
        assert_close(jax.grad(lambda *a: loss(*a)[0], argnums)(*args)[0], got_grads[0], rtol)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_closed_form_temperature_gradient_and_bfloat16_cotangents(entropy_grad):
  """A traced temperature gets its exact gradient (d/dT of z / T), as through the reference;
  bfloat16 hidden states and unembedding get bfloat16 gradients of the float32 products."""
  hidden, w, tokens, weights = grad_case(jnp.float32, seed=12, scale=3.0)

  def make(chunk_size):
    return stats_loss(lambda h, u, t: E.token_stats(h, tokens, unembedding=u, temperature=t,
                                                    chunk_size=chunk_size, entropy_grad=entropy_grad), weights)

  args = (hidden, w, jnp.float32(0.7))
  want = jax.jit(jax.grad(lambda *a: make(None)(*a)[0], (0, 1, 2)))(*args)
  got = jax.jit(jax.grad(lambda *a: make(5)(*a)[0], (0, 1, 2)))(*args)
  for i, (a, b) in enumerate(zip(got, want)):
    assert_close(a, b, 5e-5, err_msg=f"grad {i}")
  assert abs(float(got[2])) > 1e-3

  low = tuple(a.astype(jnp.bfloat16) for a in args[:2])
  got16 = jax.jit(jax.grad(lambda h, u: make(5)(h, u, 0.7)[0], (0, 1)))(*low)
  want16 = jax.jit(jax.grad(lambda h, u: make(None)(h, u, 0.7)[0], (0, 1)))(*low)
  for a, b in zip(got16, want16):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(b))))


def test_closed_form_with_minus_inf_logits_keeps_zero_log_zero():
  """-inf logits (a masked vocabulary): p = 0 there, 0 log 0 = 0 in every statistic, no NaN in
  values or gradients, equal to the reference path."""
  hidden, w, tokens, weights = grad_case(jnp.float32, seed=13, scale=2.0)
  logits = (hidden @ w).at[..., 30:].set(-jnp.inf)
  tokens = tokens % 30  # sampled tokens have p > 0
  for entropy_grad in (False, True):
    def make(chunk_size):
      return stats_loss(lambda z: E.token_stats(z, tokens, temperature=0.7, chunk_size=chunk_size,
                                                entropy_grad=entropy_grad), weights)
    (_, want), want_grad = jax.jit(jax.value_and_grad(make(None), has_aux=True))(logits)
    (_, got), got_grad = jax.jit(jax.value_and_grad(make(4), has_aux=True))(logits)
    for name, a, b in zip(E.TokenStats._fields, got, want):
      assert np.all(np.isfinite(a)), name
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=name)
    assert_close(got_grad, want_grad, 2e-5)
    assert float(jnp.max(jnp.abs(got_grad[..., 30:]))) == 0.0


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_forward_mode_equals_reference(entropy_grad):
  """jax.jvp works on the chunked path (the learner's exact first-order entropy change takes
  one through token_stats with entropy_grad=True) and equals the reference's, temperature
  tangent included; S_* and E_p[S] have zero tangents."""
  hidden, w, tokens, _ = grad_case(jnp.float32, seed=14, scale=3.0)
  keys = jax.random.split(jax.random.key(15), 3)
  tangents = (jax.random.normal(keys[0], hidden.shape), 0.1 * jax.random.normal(keys[1], w.shape),
              jnp.float32(0.3))

  def fn(chunk_size):
    return lambda h, u, t: E.token_stats(h, tokens, unembedding=u, temperature=t, chunk_size=chunk_size,
                                         entropy_grad=entropy_grad)

  want = jax.jit(lambda *a: jax.jvp(fn(None), a, tangents))(hidden, w, jnp.float32(0.7))
  got = jax.jit(lambda *a: jax.jvp(fn(5), a, tangents))(hidden, w, jnp.float32(0.7))
  for name, a, b in zip(E.TokenStats._fields, got[1], want[1]):
    assert_close(a, b, 5e-5, err_msg=name)
  assert float(jnp.max(jnp.abs(got[1].logp))) > 0
  assert (float(jnp.max(jnp.abs(got[1].entropy))) > 0) == entropy_grad
  assert float(jnp.max(jnp.abs(got[1].s_star))) == 0 == float(jnp.max(jnp.abs(got[1].expected_s)))


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_product_dtype_gives_the_models_logits_and_float32_unembedding_gradients(chunk_size):
  """With ``product_dtype`` a bfloat16 model's statistics are those of its own logits (bfloat16
  operands, float32 sums: what ``Qwen.logits`` and so the sampler compute), where a float32
  unembedding times bfloat16 hidden states is a float32 product whose log-probabilities sit
  ~1e-2 away; the float32 unembedding's gradient stays float32."""
  hidden, w, tokens = random_case(dtype=jnp.float32, seed=5)
  hidden = (3 * hidden).astype(jnp.bfloat16)
  models = jnp.einsum("...d,dv->...v", hidden, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  want = naive_stats(models, tokens, 0.7)
  got = jax.jit(lambda h, u: E.token_stats(h, tokens, unembedding=u, temperature=0.7, chunk_size=chunk_size,
                                           product_dtype=jnp.bfloat16))(hidden, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  promoted = E.token_stats(hidden, tokens, unembedding=w, temperature=0.7, chunk_size=chunk_size)
  assert float(jnp.max(jnp.abs(promoted.logp - want.logp))) > 1e-3

  def loss(h, u, product_dtype, chunk):
    return jnp.sum(E.token_stats(h, tokens, unembedding=u, temperature=0.7, chunk_size=chunk,
                                 product_dtype=product_dtype).logp)

  grads = jax.jit(jax.grad(lambda h, u: loss(h, u, jnp.bfloat16, chunk_size), (0, 1)))(hidden, w)
  assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32
  exact = jax.grad(lambda h, u: loss(h, u, None, None), (0, 1))(hidden.astype(jnp.float32), w.astype(jnp.bfloat16)
                                                               .astype(jnp.float32))
  for a, b in zip(grads, exact):
    b = np.float32(b)
    np.testing.assert_allclose(np.float32(a), b, atol=2e-2 * float(np.max(np.abs(b))))
