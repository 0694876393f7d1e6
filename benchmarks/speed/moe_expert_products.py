"""The learner's expert products compiled for a GPU and a TPU without either (issue 54).

One layer of Qwen3-30B-A3B's routed experts (128 experts of 2,048 x 768, top-8, bfloat16) on
``--tokens`` tokens, differentiated (the learner's forward and backward: gradients of the
tokens and the three stacked weights), compiled deviceless for one ``--gpu`` device (jax's CUDA
plugin on ``PYTHONPATH``) and one ``--tpu`` chip (libtpu), each expert product of
:mod:`rft_jax.models.moe`:

* ``ragged``: :func:`jax.lax.ragged_dot` (XLA:GPU copies the rows into ``[N k, E D]``; the TPU
  compiler's weight derivative runs over every expert);
* ``tiles``: :func:`rft_jax.models.expert_tiles.tiled_experts`, differentiable form;
* ``gmm`` (TPU only): :func:`rft_jax.models.expert_gmm.gmm_experts`, megablox's kernels.

It prints, per platform and product, the compiled program's temporaries (``memory_analysis``)
and XLA's FLOPs (``cost_analysis``; a loop's body counted once, so the tiles' and the kernels'
FLOPs read low: the products' own are ``6 N k D I x 3`` for forward and backward, printed as
``model``).

    JAX_PLATFORMS=cpu PYTHONPATH=/path/to/jax-cuda-plugin python benchmarks/speed/moe_expert_products.py
        [--tokens 8192] [--gpu h100:1] [--tpu v5p:2x2x1]
"""

from __future__ import annotations

import argparse
import datetime
import functools

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from rft_jax.models.expert_gmm import gmm_experts
from rft_jax.models.expert_tiles import tiled_experts
from rft_jax.models.moe import _grouped_experts
from rft_jax.plan.devices import topology

PRODUCTS = {"ragged": _grouped_experts, "tiles": functools.partial(tiled_experts, differentiable=True),
            "gmm": gmm_experts}


def compiled(product, device, tokens: int, k: int, d: int, i: int, e: int):
  """The differentiated layer ``product`` compiled for ``device``."""
  sharding = SingleDeviceSharding(device)

  def spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  def loss(x, ids, w, gate, up, down):
    return product(x, ids, w, gate, up, down).astype(jnp.float32).sum()

  args = (spec((tokens, d)), spec((tokens, k), jnp.int32), spec((tokens, k), jnp.float32),
          spec((e, d, i)), spec((e, d, i)), spec((e, i, d)))
  return jax.jit(jax.grad(loss, (0, 3, 4, 5))).lower(*args).compile()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=8192)
  parser.add_argument("--gpu", default="h100:1", help="a GPU topology ('' to skip)")
  parser.add_argument("--tpu", default="v5p:2x2x1", help="a TPU topology ('' to skip)")
  args = parser.parse_args()
  k, d, i, e = 8, 2048, 768, 128
  print(f"{datetime.date.today()}, jax {jax.__version__}: one layer of 128 experts of {d} x {i}, top-{k}, "
        f"{args.tokens} tokens, bfloat16, forward + backward; model {6 * args.tokens * k * d * i * 3 / 1e12:.2f} TFLOP")
  for name, platform_products in ((args.gpu, ("ragged", "tiles")), (args.tpu, ("ragged", "tiles", "gmm"))):
    if not name:
      continue
    device = topology(name).devices[0]
    for product in platform_products:
      c = compiled(PRODUCTS[product], device, args.tokens, k, d, i, e)
      cost = c.cost_analysis()
      cost = (cost[0] if isinstance(cost, list) else cost) or {}  # None: no cost model (deviceless GPU)
      print(f"{name:12s} {product:7s} temporaries {c.memory_analysis().temp_size_in_bytes / 2 ** 30:7.2f} GiB   "
            + (f"XLA {cost['flops'] / 1e12:8.2f} TFLOP" if "flops" in cost else "XLA FLOPs n/a"))


if __name__ == "__main__":
  main()
