"""The sampler call's temporary bytes per device by scheduler setting, compiled for a TPU
topology (deviceless, ``rft_jax.plan.fit.compile_sampler_call``) on a small model: how many full
KV caches each program holds, the question behind the 7B config's continuous sampler on a
dense cache not fitting v5p:2x2x1 (issue 33).

A random Qwen2-shaped model (``--layers`` layers, 2 by default; 2 kv heads of ``--head-dim``, 64
by default; bfloat16 compute) and one call of ``--prompts`` prompts x ``--n`` samples, prompts of
``--width`` tokens, ``--new`` new tokens, rows over ``data`` of the topology's devices. Each
``NAME=KWARGS`` setting is a ``SamplingParams`` override, e.g.

    python benchmarks/plan/sampler_memory.py 'static=dict(scheduler="static")' 'continuous=dict()' \\
        'one_stage=dict(pool_stages=1)' 'two_stages=dict(pool_stages=2)' \\
        'slots128=dict(decode_slots=128, pool_stages=1)'

prints each program's temporaries in MiB and as a multiple of one full-width cache of the call's
rows (a minute or a few each on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from rft_jax.models import QwenConfig  # noqa: E402
from rft_jax.models.hf import abstract_model  # noqa: E402
from rft_jax.parallel import make_mesh  # noqa: E402
from rft_jax.parallel.sharding import state_shardings, with_shardings  # noqa: E402
from rft_jax.plan.devices import topology  # noqa: E402
from rft_jax.plan.fit import compile_sampler_call  # noqa: E402
from rft_jax.sampling import SamplingParams  # noqa: E402
from rft_jax.sampling.generate import call_spec  # noqa: E402

MiB = 2**20


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("settings", nargs="+", help="NAME=dict(...) SamplingParams overrides")
  parser.add_argument("--topology", default="v5p:2x2x1")
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--n", type=int, default=16)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--new", type=int, default=2048)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--head-dim", type=int, default=64,
                      help="128 for the TPU paged kernel (rft_jax.models.decode.paged_kv.tpu_kernel_fits)")
  args = parser.parse_args()
  topo = topology(args.topology)
  data = len(topo.devices)
  mesh = make_mesh(data=data, model=1, devices=topo.devices)
  config = QwenConfig(model_type="qwen2", vocab_size=4096, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=args.head_dim, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  graphdef, abstract = nnx.split(abstract_model(config))
  state = with_shardings(abstract, state_shardings(abstract, mesh))
  rows = args.prompts * args.n
  cache = (2 * config.num_hidden_layers * rows * (args.width + args.new) * config.num_key_value_heads
           * config.head_dim * 2 / data)  # keys and values, bfloat16, rows over data
  print(f"{args.topology}: {rows} rows x ({args.width} + {args.new}) slots; one full cache "
        f"{cache / MiB:.0f} MiB per device", flush=True)
  print("| setting | temporaries MiB | full caches | compile s |")
  print("|---|---|---|---|")
  for setting in args.settings:
    name, overrides = setting.split("=", 1)
    params = SamplingParams(n=args.n, max_new_tokens=args.new, stop_token_ids=(0,),
                            **eval(overrides, {"dict": dict}))  # noqa: S307 (the user's own flags)
    start = time.perf_counter()
    compiled = compile_sampler_call(mesh, graphdef, state, call_spec(params, rows, data),
                                    args.prompts, args.width)
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"| {name} | {temp / MiB:.0f} | {temp / cache:.2f} | {time.perf_counter() - start:.0f} |",
          flush=True)


if __name__ == "__main__":
  main()
