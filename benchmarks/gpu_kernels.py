"""What one decode step of the sampler launches on a GPU, compiled without one.

Compiles the sampler program (:func:`rft_jax.sampling.loop.sample_loop`) of a random bfloat16
model of a preset's shapes for one GPU of ``--topology`` (deviceless, as ``rft-jax plan`` does:
needs jax's CUDA plugin, run with ``JAX_PLATFORMS=cpu``), then counts the kernels in each decode
loop's body of the optimised HLO by kind (fusions by name, library calls, copies) and prints the
program's memory. A decode step launches one kernel per fusion or library call of its body.

    JAX_PLATFORMS=cpu python benchmarks/gpu_kernels.py --preset 0.5b --batch 64 [--topology h100:1]
"""

from __future__ import annotations

import argparse
import collections
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sampler import PRESETS, add_decode_shape_arguments  # benchmarks/ is this script's directory
from rft_jax.models import Qwen
from rft_jax.parallel import make_mesh, state_shardings, with_shardings
from rft_jax.sampling import SamplingParams
from rft_jax.sampling.generate import sampler_rules
from rft_jax.sampling.loop import LoopSpec, loop_for
from rft_jax.train.gpu_topology import gpu_topology


def loop_bodies(hlo: str) -> dict[str, collections.Counter]:
  """Kernels of each while loop's body in optimised HLO text: ``{body: Counter(kind: count)}``
  (kinds are instruction names without their numbers: ``gemm_fusion_dot``, ``wrapped_slice``,
  ``loop_add_fusion``, ``copy``, ...)."""
  computations, current, bodies = {}, None, []
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
    if header:
      current = computations.setdefault(header.group(1), [])
      continue
    if line.rstrip() == "}":  # a computation's end (multi-line backend configs have "}}, ...")
      current = None
    elif current is not None:
      current.append(line)
      bodies += re.findall(r"while\(.*body=%([^,\s]+)", line)
  kernels = {}
  for body in bodies:
    counts = collections.Counter()
    for line in computations[body]:
      match = re.match(r"\s*(?:ROOT )?%(\S+) = .*? (fusion|custom-call|copy)\(", line)
      if match:
        counts[re.sub(r"[.\d]+$", "", match.group(1))] += 1
    kernels[body] = counts
  return kernels


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_decode_shape_arguments(parser)
  parser.add_argument("--topology", default="h100:1", help="one GPU: h100:1 or h200:1")
  parser.add_argument("--top", type=int, default=12)
  parser.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                      help="the stored parameters' dtype (the paper's configs: float32)")
  args = parser.parse_args()
  topo = gpu_topology(args.topology)
  mesh = make_mesh(data=1, model=1, devices=topo.devices[:1])
  config = PRESETS[args.preset](dtype=jnp.bfloat16, param_dtype=jnp.dtype(args.param_dtype))
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen(config, rngs=nnx.Rngs(0))))
  state = with_shardings(abstract, state_shardings(abstract, mesh))
  rows = NamedSharding(mesh, PartitionSpec("data"))
  scalar = NamedSharding(mesh, PartitionSpec())
  b, p = args.batch, args.prompt
  inputs = [jax.ShapeDtypeStruct(shape, dtype, sharding=rows) for shape, dtype in (
      ((b, p), jnp.int32), ((b, p), jnp.int32), ((b, 3), jnp.uint32), ((b,), jnp.bool_))]
  scalars = [jax.ShapeDtypeStruct((), dtype, sharding=scalar)
             for dtype in (jnp.uint32, jnp.float32, jnp.int32, jnp.float32)]
  layer_ids = tuple(jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar)
                    for _ in range(config.num_hidden_layers))  # as layer_indices(L)
  spec = LoopSpec.of(SamplingParams(max_new_tokens=args.new_tokens))
  start = time.perf_counter()
  compiled = loop_for(mesh).lower(graphdef, state, *inputs, *scalars, layer_ids, spec=spec,
                                  mesh=mesh, rules=sampler_rules()).compile()
  memory = compiled.memory_analysis()
  print(f"{args.topology} ({topo.devices[0].device_kind}), preset {args.preset}, batch {b}, "
        f"prompt {p}, {args.new_tokens} new tokens, {args.param_dtype} parameters: compiled in {time.perf_counter() - start:.0f} "
        f"s; arguments {memory.argument_size_in_bytes / 2 ** 30:.2f} GiB, temporaries "
        f"{memory.temp_size_in_bytes / 2 ** 30:.2f} GiB")
  for body, counts in loop_bodies(compiled.as_text()).items():
    if sum(counts.values()) < config.num_hidden_layers:
      continue  # not a decode loop (e.g. the key schedule's)
    top = ", ".join(f"{name} {n}" for name, n in counts.most_common(args.top))
    print(f"decode loop {body}: {sum(counts.values())} kernels a step ({top})")


if __name__ == "__main__":
  main()
