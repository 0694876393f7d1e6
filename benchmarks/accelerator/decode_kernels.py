"""What one decode step of the sampler runs on a GPU or TPU, compiled without one.

Compiles the sampler program (:func:`rft_jax.sampling.loop.sample_loop`) of a random model of a
preset's shapes (bfloat16 compute) for ``--data`` devices of ``--topology`` (deviceless, as
``rft-jax plan`` does: GPUs need jax's CUDA plugin and ``JAX_PLATFORMS=cpu``, TPUs libtpu), the
parameters laid out as the learner keeps them (FSDP over ``data``), then counts the kernels in
each decode loop's body of the optimised HLO by kind (fusions by name, library calls, copies,
collectives) and prints the program's memory per device. A decode step launches one kernel per
fusion or library call of its body, and runs each collective in it.

    JAX_PLATFORMS=cpu python benchmarks/accelerator/decode_kernels.py --preset 0.5b --batch 64 --topology h200:1
    JAX_PLATFORMS=cpu python benchmarks/accelerator/decode_kernels.py --preset 0.5b --batch 64 --topology h100:1 --scheduler continuous
    JAX_PLATFORMS=cpu python benchmarks/accelerator/decode_kernels.py --preset 0.5b --batch 64 --topology h100:1 --kv-pages 2048
    python benchmarks/accelerator/decode_kernels.py --preset 0.5b --batch 64 --topology v5p:2x2x1 --data 4

``--scheduler continuous`` compiles continuous batching's pool instead (the default scheduler; one
slot a row, one stage), ``--kv-pages N`` the same on a paged cache (the paper's configs). At 0.5B,
batch 64, on h100:1 (2026-11-28) the pool's decode step is 366 kernels: per layer the static
loop's, its two cache writes scatters (a write index per slot); its admission's body (54 kernels:
every layer's keys and values of one entering sample's prompt, and its slot mask) runs once per
entering sample. With pages (2026-11-27): 368 kernels a decode step against the static loop's
358; per layer, two scatters into the pages (the token's key and value) and the Pallas kernel
with its wrapper's query padding, exponential and convert. Admission (62 kernels, 48 of them the
copies of the entering samples' partial prompt pages) runs in its own loop body, only when a
slot can take a waiting sample; run at every step, as before, it made the step 427 kernels.
Those are XLA's decode step (``--decode-kernels xla``). The fused step (``auto``, the default
on one GPU: five Pallas kernels a layer, ``rft_jax.models.decode.fused_decode``) is 150 kernels a
step with continuous batching and 143 in the static loop at 0.5B, batch 64, on h200:1
(2026-11-28; 170 at 1.5B): 120 of them the layers' kernels, the rest the embedding, the slot
mask, the final norm and logits, the sampling and the pool's bookkeeping.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from speed.sampler import PRESETS, add_decode_shape_arguments  # noqa: E402
from rft_jax.models import Qwen  # noqa: E402
from rft_jax.parallel import make_mesh, state_shardings, with_shardings  # noqa: E402
from rft_jax.plan.devices import topology  # noqa: E402
from rft_jax.plan.fit import compile_sampler_call, while_loop_bodies  # noqa: E402
from rft_jax.sampling import SamplingParams  # noqa: E402
from rft_jax.sampling.generate import call_spec  # noqa: E402
from rft_jax.sampling.loop import LoopSpec  # noqa: E402


def loop_kernels(hlo: str) -> dict[str, collections.Counter]:
  """Kernels of each while loop's body in optimised HLO text: ``{body: Counter(kind: count)}``
  (kinds are instruction names without their numbers: ``gemm_fusion_dot``, ``wrapped_slice``,
  ``loop_add_fusion``, ``copy``, ...)."""
  kernels = {}
  for body, lines in while_loop_bodies(hlo).items():
    counts = collections.Counter()
    for line in lines:
      match = re.match(r"\s*(?:ROOT )?%(\S+) = .*? (fusion|custom-call|copy|all-gather|all-reduce|"
                       r"all-to-all|reduce-scatter|collective-permute)(?:-start)?\(", line)
      if match:
        counts[re.sub(r"[.\d]+$", "", match.group(1))] += 1
    kernels[body] = counts
  return kernels


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_decode_shape_arguments(parser)
  parser.add_argument("--topology", default="h100:1", help="h100:1, h200:1, v5p:2x2x1, ...")
  parser.add_argument("--data", type=int, default=1, help="devices of the mesh (its data axis)")
  parser.add_argument("--top", type=int, default=12)
  parser.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                      help="the stored parameters' dtype (the paper's configs: float32)")
  parser.add_argument("--scheduler", choices=("static", "continuous"), default="static",
                      help="the sampler's program: the static loop, or continuous batching's "
                           "pool (one slot a row, one stage; the default scheduler)")
  parser.add_argument("--kv-pages", type=int, default=None,
                      help="continuous batching on this many pages of 16 tokens per data shard "
                           "(the paper's configs), one decode slot a row")
  parser.add_argument("--paged-attention", default="auto", help="SamplingParams.paged_attention")
  parser.add_argument("--decode-kernels", default="auto",
                      help="QwenConfig.decode_kernels: auto (fused on one GPU where the kernels "
                           "take the shapes), xla, fused")
  args = parser.parse_args()
  topo = topology(args.topology)
  mesh = make_mesh(data=args.data, model=1, devices=topo.devices[:args.data])
  config = PRESETS[args.preset](dtype=jnp.bfloat16, param_dtype=jnp.dtype(args.param_dtype),
                                decode_kernels=args.decode_kernels)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen(config, rngs=nnx.Rngs(0))))
  state = with_shardings(abstract, state_shardings(abstract, mesh))
  b, p = args.batch, args.prompt
  if args.kv_pages is None and args.scheduler == "static":
    spec = LoopSpec.of(SamplingParams(max_new_tokens=args.new_tokens))
  else:
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_token_ids=(0,),
                            scheduler="continuous", kv_pages=args.kv_pages, pool_stages=1,
                            paged_attention=args.paged_attention)
    spec = call_spec(params, b, args.data)
  start = time.perf_counter()
  compiled = compile_sampler_call(mesh, graphdef, state, spec, b, p)
  memory = compiled.memory_analysis()
  print(f"{args.topology} ({topo.devices[0].device_kind}) x {args.data}, preset {args.preset}, "
        f"batch {b}, prompt {p}, {args.new_tokens} new tokens, {args.param_dtype} parameters, "
        f"decode kernels {args.decode_kernels}: "
        f"compiled in {time.perf_counter() - start:.0f} s; arguments "
        f"{memory.argument_size_in_bytes / 2 ** 30:.2f} GiB, temporaries "
        f"{memory.temp_size_in_bytes / 2 ** 30:.2f} GiB per device")
  for body, counts in loop_kernels(compiled.as_text()).items():
    if sum(counts.values()) < config.num_hidden_layers:
      continue  # not a decode loop (e.g. the key schedule's)
    top = ", ".join(f"{name} {n}" for name, n in counts.most_common(args.top))
    print(f"decode loop {body}: {sum(counts.values())} kernels a step ({top})")


if __name__ == "__main__":
  main()
