"""The splash (TPU) and cuDNN (GPU) self-attention wrappers against :func:`attend`.

On CPU the splash kernel runs in Pallas interpret mode and the cuDNN wrapper with XLA's
implementation (the same roll and sequence-length masking; the cuDNN kernel needs a GPU). A
deviceless TPU compile checks that the sharded splash path lowers and stays small in memory.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rft_jax.models.attention import attend, causal_padding_mask
from rft_jax.models.attention_kernels import cudnn_self_attention, splash_self_attention
from rft_jax.parallel import make_mesh

T = 200  # not a multiple of the 128 block: padded to 256
POS = np.arange(T)
# Rows: left padding, right padding, both, none.
VALID = jnp.array(np.stack([POS >= 50, POS < 150, (POS >= 20) & (POS < 170), POS >= 0]))


def _inputs(kv_heads: int, valid, n: int = 4, h: int = 32):
  """q [B, T, N, H], k and v [B, T, K, H], and loss weights [B, T, N, H] (zero at padding)."""
  keys = jax.random.split(jax.random.key(kv_heads), 4)
  b = valid.shape[0]
  q = jax.random.normal(keys[0], (b, T, n, h))
  k = jax.random.normal(keys[1], (b, T, kv_heads, h))
  v = jax.random.normal(keys[2], (b, T, kv_heads, h))
  weights = jax.random.normal(keys[3], (b, T, n, h)) * valid[:, :, None, None]
  return q, k, v, weights


def _reference(q, k, v, valid):
  return attend(q, k, v, causal_padding_mask(valid.astype(jnp.int32)))


def _errors(fn, kv_heads: int, valid=VALID):
  """Max |fn - reference| of the output at valid positions and of the q, k, v gradients of
  ``sum(weights * out)`` (weights zero at padding)."""
  q, k, v, weights = _inputs(kv_heads, valid)

  def grads(f):
    return jax.jit(jax.grad(lambda *qkv: jnp.sum(weights * f(*qkv, valid)), argnums=(0, 1, 2)))(
        q, k, v)

  out = jax.jit(fn)(q, k, v, valid)
  assert bool(jnp.isfinite(out).all())
  out_err = jnp.max(jnp.abs(out - _reference(q, k, v, valid)) * valid[:, :, None, None])
  grad_err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads(fn), grads(_reference)))
  return float(out_err), grad_err


# G = 1, 2, 4 query heads per kv head; on one device, on a 2x2 CPU mesh with heads sharded
# (2 % 2 == 0), and with heads replicated (1 % 2 != 0).
@pytest.mark.parametrize("kv_heads,mesh", [(4, False), (2, True), (1, True)])
def test_splash_interpret_matches_reference(kv_heads, mesh):
  mesh = make_mesh(data=2, model=2) if mesh else None
  fn = lambda q, k, v, valid: splash_self_attention(q, k, v, valid, mesh=mesh, interpret=True,
                                                    block_size=128)
  out_err, grad_err = _errors(fn, kv_heads)
  assert out_err < 1e-5 and grad_err < 1e-5, (out_err, grad_err)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cudnn_wrapper_xla_matches_reference(kv_heads):
  fn = lambda q, k, v, valid: cudnn_self_attention(q, k, v, valid, implementation="xla")
  out_err, grad_err = _errors(fn, kv_heads)
  assert out_err < 1e-5 and grad_err < 1e-5, (out_err, grad_err)


def test_cudnn_wrapper_all_padding_row_is_finite():
  valid = VALID.at[0].set(False)
  fn = lambda q, k, v, valid: cudnn_self_attention(q, k, v, valid, implementation=None)
  out_err, grad_err = _errors(fn, 2, valid)
  assert out_err < 1e-5 and grad_err < 1e-5, (out_err, grad_err)


@pytest.mark.parametrize("kv_heads", [4, 1])  # heads over 'model' / replicated (1 % 2 != 0)
def test_splash_sharded_tpu_compile(kv_heads):
  """Deviceless compile for a 2x2 v5p mesh, bfloat16: forward and gradient lower to the splash
  kernels (1 and 3 Mosaic calls) without resharding, in far less scratch than the scores take."""
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
  mesh = make_mesh(data=2, model=2, devices=topo.devices)
  b, t, n, h = 4, 1024, 8, 128
  heads = NamedSharding(mesh, P("data", None, "model" if kv_heads % 2 == 0 else None, None))
  shapes = (jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, t, kv_heads, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, t, kv_heads, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, t), jnp.bool_))
  shardings = (heads, heads, heads, NamedSharding(mesh, P("data", None)))

  def forward(q, k, v, valid):
    return splash_self_attention(q, k, v, valid, mesh=mesh)

  def loss(q, k, v, valid):
    return jnp.sum(forward(q, k, v, valid).astype(jnp.float32) * valid[:, :, None, None])

  # A float32 score matrix on one device: [B / 2, N (/ 2 with heads sharded), T, T] * 4 bytes.
  scores_bytes = (b // 2) * n * t * t * 4 // (2 if kv_heads % 2 == 0 else 1)
  for fn, kernels in ((forward, 1), (jax.grad(loss, argnums=(0, 1, 2)), 3)):
    # conftest's "highest" would ask Mosaic for float32 products of bfloat16 operands.
    with jax.default_matmul_precision("default"):
      compiled = jax.jit(fn, in_shardings=shardings).lower(*shapes).compile()
    hlo = compiled.as_text()
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"kv_heads={kv_heads} {fn.__name__}: temp {temp} bytes, scores {scores_bytes}")
    assert hlo.count("tpu_custom_call") == kernels
    assert not any(c in hlo for c in ("all-gather", "all-to-all", "collective-permute"))
    # Replicated heads: each 'model' device computes every gradient, psum'd by shard_map.
    assert ("all-reduce" in hlo) == (fn is not forward and kv_heads % 2 != 0)
    assert temp < scores_bytes // 2, temp
