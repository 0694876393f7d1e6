"""Model-FLOPs utilisation of the GRPO learner step at Qwen2.5-1.5B shapes (meant for a GPU).

A random Qwen2.5-1.5B (bfloat16 compute, float32 parameters and Adam state, as in the paper's
configs; ``--param-dtype bfloat16 --moment-dtype float32``: bfloat16 parameters, float32 moments) and one synthetic batch (``--rows`` sequences of ``--prompt`` + ``--completion`` tokens,
every position real, benchmarks/speed/learner_step.py's ``synthetic_batch``); times ``Learner.step``
(one update, metrics read back) for each ``--micro`` micro-batch size and ``--remat`` setting,
median of ``--repeats`` steps after a compiling and a warm-up step. Model FLOPs per step, the
PaLM convention (rematerialisation and the entropy statistics not counted):

    6 * N * T  +  6 * L * heads * head_dim * S * T

with N the parameters of the matrix products (embedding lookup excluded, the unembedding
product included), T = rows * S tokens, S the sequence length (causal attention: half of the
S x S scores, forward and backward). MFU is given against the bfloat16 peak ``--peak-tflops``
(datasheet, dense: H100 SXM and H200 989) and against a measured 8192^3 bfloat16 product.

    python benchmarks/accelerator/learner_mfu.py [--rows 16] [--prompt 256] [--completion 768] [--micro 4 16]

``--profile`` then traces one more step of each setting and prints its GPU kernels by name
(``benchmarks/accelerator/decode_profile.py``'s summary, per learner step): where the time goes.

Without a GPU, ``--topology h200:1`` compiles the same step for a deviceless H200 (as ``rft-jax
plan`` does: a one-device mesh, abstract state and batch, the batch's first completion column) and
prints, per setting, the compiled step's FLOPs and bytes accessed per step (XLA's HLO cost analysis
of the optimised program, each while loop's body times its known trip count; cuDNN attention's
FLOPs from its shapes, which the analysis counts as 0), their ratio to the model FLOPs above, the
arithmetic intensity, the roofline at ``--peak-tflops`` and ``--peak-tbps`` (H200: 989 TFLOP/s,
4.8 TB/s; also at the 4.3 TB/s copy rate measured on one), and the kernels (fusions, Triton gemm
fusions, cuDNN calls, copies, as decode_kernels.py counts them) of the entry computation and of
each loop body, with the kernels launched a step:

    JAX_PLATFORMS=cpu PYTHONPATH=/tmp/cudaplug:. python benchmarks/accelerator/learner_mfu.py \
        --topology h200:1 --micro 4 16 --remat 1 0 [--param-dtype bfloat16 --moment-dtype float32]

(``/tmp/cudaplug``: where jax's CUDA plugin is installed, ``pip install --target``.) Figures of
2026-11-28 (jax 0.10.2), 16 x 1,024 tokens, model FLOPs 156.1 T a step:

    params/moments  remat micro  compiled TFLOP (x model)  GB     FLOP/B  roofline ms (bound)   kernels
    f32/f32         1     4      188.9 (1.21)              991    191     191 / 206 (memory)    12,728
    f32/f32         1     16     188.9 (1.21)              771    245     191 / 161 (products)   4,083
    f32/f32         0     4      157.2 (1.01)              1,272  124     159 / 265 (memory)    15,992
    f32/f32         0     16     157.1 (1.01)              974    161     159 / 203 (memory)     4,851
    bf16/f32        1     4      188.9 (1.21)              823    230     191 / 171 (products)  12,728
    bf16/f32        1     16     188.9 (1.21)              682    277     191 / 142 (products)   3,970

(roofline: products at 989 TFLOP/s / bytes at 4.8 TB/s.) Remat recomputes the layers' forward
products but the last of each block's (o_proj, down_proj: their outputs are not needed) in the
backward loop: 121.4 TFLOP there against 89.5 without. The token statistics (chunks of the
unembedding, the completion positions only) cost 5.8 TFLOP forward and 17.3 backward (the logits
recomputed) but 308 GB of the 991 (31 %): 4.4 GB a forward chunk and 8.4 GB a backward one (of
512 tokens at micro 4), where the chunk's float32 logits are 0.31 GB and the tied unembedding
0.93 GB (float32; 11 GB less a step in bfloat16): the logits pass through HBM many times, between
separate reduction fusions. At remat 1, micro 4 the measured step (462 ms, 34.2 % MFU) is 2.2 x this
roofline's 206 ms; it launches 12,728 kernels (24 a layer forward, 78 a layer backward, x 28
layers x 4 micro-batches). Since the token statistics' closed-form derivative per chunk
(``rft_jax/entropy/token_stats.py``; the same command, 2026-11-28): 855 GB at remat 1, micro 4
(the token statistics' loops 45.2 + 127.7 GB: 1.88 GB a forward chunk, 5.32 a backward one, of
which about 3.7 the float32 unembedding read three times and its gradient's accumulator) and
636 GB at micro 16; the FLOPs unchanged.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from accelerator.decode_profile import summarise  # noqa: E402
from speed.learner_step import synthetic_batch  # noqa: E402
from speed.sampler import median_seconds  # noqa: E402
from rft_jax.models import Qwen, QwenConfig  # noqa: E402
from rft_jax.plan.parameters import parameter_report  # noqa: E402
from rft_jax.rl.batching import first_response_column  # noqa: E402
from rft_jax.rl.config import LearnerConfig  # noqa: E402
from rft_jax.rl.learner import Learner  # noqa: E402
from rft_jax.rl.optimizer import MOMENT_DTYPES, OptimizerConfig  # noqa: E402


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
  """Measured bfloat16 rate of an ``n^3`` product (random operands), TFLOP/s."""
  a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in range(2))
  return 2 * n ** 3 / median_seconds(jax.jit(lambda a, b: a @ b), a, b, repeats=repeats) / 1e12


def model_flops(config: QwenConfig, rows: int, length: int) -> float:
  """Model FLOPs of one forward and backward pass over ``rows x length`` tokens (docstring): 6 x the
  active parameters' products per token, plus attention."""
  model = nnx.eval_shape(lambda: Qwen(config, rngs=nnx.Rngs(0)))
  # Those one token's forward uses: a mixture of experts' token multiplies by k of its E experts
  # (rft_jax.plan.parameters; every parameter for a dense model).
  params = parameter_report(nnx.state(model, nnx.Param), config)["active_parameters"]
  # The lookup table is no product; the unembedding's matrix is (tied: the same table).
  matmul = params if config.tie_word_embeddings else params - config.vocab_size * config.hidden_size
  tokens = rows * length
  attention = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * length
  return 6 * matmul * tokens + attention * tokens


def learner_config(args, micro: int) -> LearnerConfig:
  """The learner the script times or compiles: one update, no entropy forecast."""
  return LearnerConfig(optim=OptimizerConfig(lr=1e-6, moment_dtype=args.moment_dtype),
                       micro_batch_size=micro, forecast_every=0)


# --------------------------------------------------------------------------------------------
# Deviceless: the compiled step's cost (--topology).

# A kernel of optimised GPU HLO, as decode_kernels.py's loop_kernels counts them: a fusion, a
# library call, a copy or a collective (kinds: instruction names without their numbers).
KERNEL = re.compile(r"\s*(?:ROOT )?%(\S+) = .*? (fusion|custom-call|copy|all-gather|all-reduce|"
                    r"all-to-all|reduce-scatter|collective-permute)(?:-start)?\(")
WHILE = re.compile(r" while\(.*condition=%([^,\s]+), body=%([^,\s]+)")
TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def hlo_computations(hlo: str) -> tuple[dict[str, list[str]], dict[str, int], str]:
  """Optimised HLO text's computations: ``(instruction lines by name, header line numbers,
  the entry's name)``."""
  computations, headers, current, entry = {}, {}, None, None
  for i, line in enumerate(hlo.splitlines()):
    header = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
    if header:
      current = computations.setdefault(header.group(2), [])
      headers[header.group(2)] = i
      entry = header.group(2) if header.group(1) else entry
    elif line.rstrip() == "}":  # a computation's end (multi-line backend configs have "}}, ...")
      current = None
    elif current is not None:
      current.append(line)
  return computations, headers, entry


def computation_cost(hlo: str, headers: dict[str, int], entry: str, name: str) -> tuple[float, float]:
  """``(FLOPs, bytes accessed)`` of computation ``name`` run once, by XLA's HLO cost analysis (the
  CPU client's; the deviceless GPU executable has none): the module re-parsed with ``name`` as its
  entry. Counts each while loop's body once, library calls (cuBLAS, cuDNN) as 0 FLOPs."""
  from jax._src.lib import _jax  # noqa: PLC0415
  from jaxlib import _hlo  # noqa: PLC0415

  lines = hlo.splitlines()
  lines[0] = "HloModule step"  # the entry's layout and aliasing belong to the old entry
  lines[headers[entry]] = lines[headers[entry]].removeprefix("ENTRY ")
  lines[headers[name]] = "ENTRY " + lines[headers[name]]
  cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client,
                                       _hlo.hlo_module_from_text("\n".join(lines)))
  return cost.get("flops", 0.0), cost.get("bytes accessed", 0.0)


def attention_flops(line: str) -> float:
  """FLOPs of a cuDNN flash-attention call, from its ``[B, N, T, S]`` score shape and head size:
  forward 2 products (4 B N T S H), backward 5 (10 B N T S H: the scores again, dP, dV, dQ, dK);
  half with a causal mask (cuDNN skips the masked tiles). 0 for any other line."""
  target = re.search(r'custom_call_target="__cudnn\$fmha(\w*)"', line)
  scores = re.search(r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*"dimensions":'
                     r'\s*\[([^\]]*)\]', line)
  if target is None or scores is None:
    return 0.0
  b, n, t, s = (int(d.strip().strip('"')) for d in scores.group(1).split(","))
  head = int(re.search(r"\[\d+,\d+,\d+,(\d+)\]", line).group(1))  # the first result: [B, N, T, H]
  products = 5 if "Backward" in target.group(1) else 2
  causal = 0.5 if "CAUSAL" in line else 1.0
  return products * 2 * b * n * t * s * head * causal


def step_cost(hlo: str) -> dict:
  """The compiled step's cost per step from its optimised HLO: XLA's cost analysis of every
  computation that runs (the entry and each while loop's body) times the times it runs (known trip
  counts, nested), plus cuDNN attention's FLOPs (:func:`attention_flops`); and its kernels by kind
  per computation. Returns ``flops``, ``bytes``, ``attention_flops``, ``launches`` (kernels a step)
  and ``parts``: ``(name, runs per step, trips, flops, bytes, kernels by kind, kernels by
  class, attention flops)`` per computation, its cost per step without the loops inside it."""
  computations, headers, entry = hlo_computations(hlo)
  once = {}
  cost = lambda name: once.setdefault(name, computation_cost(hlo, headers, entry, name))
  parts, pending = [], [(entry, 1, 1)]
  while pending:
    name, runs, trips = pending.pop(0)
    flops, bytes_ = cost(name)  # this computation, each loop's body and condition once
    kernels, classes, attention = collections.Counter(), collections.Counter(), 0.0
    for line in computations[name]:
      match = KERNEL.match(line)
      if match:
        kernels[re.sub(r"[.\d]+$", "", match.group(1))] += 1
        classes[kernel_class(match.group(2), match.group(1), line)] += 1
      attention += attention_flops(line)
      loop = WHILE.search(line)
      if loop:
        n = TRIPS.search(line)
        if n is None:
          print(f"warning: a while loop of {name} has no known trip count: counted once")
        for inner in loop.groups():
          flops, bytes_ = flops - cost(inner)[0], bytes_ - cost(inner)[1]
        pending.append((loop.group(2), runs * (int(n.group(1)) if n else 1), int(n.group(1)) if n else 1))
        cond_flops, cond_bytes = cost(loop.group(1))  # runs trips + 1 times; tiny
        flops, bytes_ = flops + cond_flops, bytes_ + cond_bytes
    parts.append((name, runs, trips, (flops + attention) * runs, bytes_ * runs, kernels, classes,
                  attention * runs))
  return {"flops": sum(p[3] for p in parts), "bytes": sum(p[4] for p in parts),
          "attention_flops": sum(p[7] for p in parts),
          "launches": sum(p[1] * sum(p[5].values()) for p in parts), "parts": parts}


def kernel_class(op: str, name: str, line: str) -> str:
  """A kernel's class: ``gemm`` (a Triton gemm fusion, a cuBLAS call), ``attention`` (a cuDNN
  call), ``fusion`` (any other fusion), ``library call``, ``copy`` or ``collective``."""
  if (op == "fusion" and "gemm" in name) or "__cublas" in line:
    return "gemm"
  if "__cudnn" in line:
    return "attention"
  return {"fusion": "fusion", "custom-call": "library call", "copy": "copy"}.get(op, "collective")


def deviceless(args, batch) -> None:
  """``--topology``: each setting's learner step compiled for the topology's first device (as
  ``rft-jax plan`` compiles it, abstract state and batch laid out on a one-device mesh; the
  statistics from the batch's first completion column, as :meth:`Learner.step` passes them);
  prints its FLOPs and bytes per step, against the model FLOPs, and its kernels."""
  from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

  from rft_jax.parallel import make_mesh, state_shardings, with_shardings  # noqa: PLC0415
  from rft_jax.plan.devices import topology  # noqa: PLC0415

  topo = topology(args.topology)
  mesh = make_mesh(data=1, model=1, devices=topo.devices[:1])
  rows = NamedSharding(mesh, PartitionSpec("data"))
  abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), batch)
  column = first_response_column(batch.response_mask)
  length = args.prompt + args.completion
  peak, bandwidth = args.peak_tflops * 1e12, args.peak_tbps * 1e12
  print(f"{args.topology} ({topo.devices[0].device_kind}), deviceless; Qwen2.5-1.5B shapes, "
        f"{args.rows} rows x {length} tokens, bfloat16 compute, {args.param_dtype} parameters, "
        f"moments {args.moment_dtype}; roofline {args.peak_tflops:.0f} TFLOP/s, "
        f"{args.peak_tbps} TB/s", flush=True)
  for remat in args.remat:
    config = QwenConfig.qwen2_5_1_5b(dtype=jnp.bfloat16, param_dtype=jnp.dtype(args.param_dtype),
                                     remat=bool(remat))
    useful = model_flops(config, args.rows, length)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen(config, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, with_shardings(abstract, state_shardings(abstract, mesh)))
    for micro in args.micro:
      learner = Learner(model, learner_config(args, micro), mesh=mesh)
      state = learner.abstract_state(nnx.state(model, nnx.Param))
      start = time.perf_counter()
      compiled = learner.lower_step(state, abstract_batch, stats_from_column=column).compile()
      compile_s = time.perf_counter() - start
      memory = compiled.memory_analysis()
      cost = step_cost(compiled.as_text())
      flops, bytes_ = cost["flops"], cost["bytes"]
      t_flops, t_bytes = flops / peak, bytes_ / bandwidth
      bound = max(t_flops, t_bytes)
      print(f"remat {remat} micro {micro:3d} (compiled in {compile_s:.0f} s): compiled "
            f"{flops / 1e12:.1f} TFLOP (cuDNN attention {cost['attention_flops'] / 1e12:.1f}) = "
            f"{flops / useful:.2f} x the model's {useful / 1e12:.1f}; {bytes_ / 1e9:.0f} GB accessed, "
            f"{flops / bytes_:.0f} FLOP/byte (ridge {peak / bandwidth:.0f}); roofline: products "
            f"{t_flops * 1e3:.0f} ms, memory {t_bytes * 1e3:.0f} ms ({bytes_ / 4.3e12 * 1e3:.0f} ms "
            f"at 4.3 TB/s): {'compute' if t_flops >= t_bytes else 'memory'}-bound, at least "
            f"{bound * 1e3:.0f} ms, MFU at most {useful / bound / peak:.1%}; "
            f"{cost['launches']} kernels a step; arguments "
            f"{memory.argument_size_in_bytes / 2 ** 30:.1f} GiB, temporaries "
            f"{memory.temp_size_in_bytes / 2 ** 30:.1f} GiB", flush=True)
      for name, runs, trips, part_flops, part_bytes, kernels, classes, _ in cost["parts"]:
        top = ", ".join(f"{kind} {n}" for kind, n in kernels.most_common(args.top))
        summary = ", ".join(f"{kind} {n}" for kind, n in classes.most_common())
        print(f"  {name} x {runs} ({trips} trips): {part_flops / 1e12:.1f} TFLOP, "
              f"{part_bytes / 1e9:.1f} GB a step; {sum(kernels.values())} kernels a run "
              f"({summary}): {top}", flush=True)
      del learner, state, compiled


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=16)
  parser.add_argument("--prompt", type=int, default=256)
  parser.add_argument("--completion", type=int, default=768)
  parser.add_argument("--micro", type=int, nargs="+", default=[4, 16])
  parser.add_argument("--remat", type=int, nargs="+", default=[1], help="1: remat, 0: none")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--peak-tflops", type=float, default=989.0)
  parser.add_argument("--profile", action="store_true", help="trace one more step, by kernel")
  parser.add_argument("--top", type=int, default=25,
                      help="kernel kinds listed with --profile (and per loop with --topology)")
  parser.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                      help="the stored parameters' dtype (model.param_dtype)")
  parser.add_argument("--moment-dtype", choices=MOMENT_DTYPES, default="auto",
                      help="Adam's moments' dtype (learner.optim.moment_dtype)")
  parser.add_argument("--topology", default=None,
                      help="compile for this topology's first device, deviceless (h200:1; needs "
                           "JAX_PLATFORMS=cpu and jax's CUDA plugin) and print the compiled step's "
                           "cost instead of timing it")
  parser.add_argument("--peak-tbps", type=float, default=4.8,
                      help="memory bandwidth, TB/s, of --topology's roofline (H200: 4.8)")
  args = parser.parse_args()
  length = args.prompt + args.completion
  batch = synthetic_batch(151936, rows=args.rows, prompt=args.prompt, completion=args.completion)
  # every position real: the FLOPs count all rows x length tokens
  batch = batch.replace(attention_mask=jnp.ones_like(batch.attention_mask))
  if args.topology:
    deviceless(args, batch)
    return
  measured = matmul_tflops()
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), Qwen2.5-1.5B "
        f"shapes, {args.rows} rows x {length} tokens, bfloat16 compute, {args.param_dtype} "
        f"parameters, moments {args.moment_dtype}; 8192^3 bfloat16 product {measured:.0f} "
        f"TFLOP/s", flush=True)
  for remat in args.remat:
    config = QwenConfig.qwen2_5_1_5b(dtype=jnp.bfloat16, param_dtype=jnp.dtype(args.param_dtype),
                                     remat=bool(remat))
    flops = model_flops(config, args.rows, length)
    for micro in args.micro:
      model = Qwen(config, rngs=nnx.Rngs(0))
      learner = Learner(model, learner_config(args, micro))
      state = learner.init(model)
      del model
      start = time.perf_counter()
      state, _ = learner.step(state, batch)
      compile_s = time.perf_counter() - start
      state, _ = learner.step(state, batch)
      times = []
      for _ in range(args.repeats):
        start = time.perf_counter()
        state, _ = learner.step(state, batch)  # reads the metrics back: the step has finished
        jax.block_until_ready(state.params)
        times.append(time.perf_counter() - start)
      step = statistics.median(times)
      print(f"remat {remat} micro {micro:3d}: step {step * 1e3:8.1f} ms (min "
            f"{min(times) * 1e3:.1f}, first {compile_s:.1f} s), {flops / step / 1e12:6.1f} TFLOP/s model: MFU "
            f"{flops / step / 1e12 / args.peak_tflops:6.1%} of {args.peak_tflops:.0f}, "
            f"{flops / step / 1e12 / measured:6.1%} of the measured product", flush=True)
      if args.profile:
        root = tempfile.mkdtemp()
        with jax.profiler.trace(root):
          state, _ = learner.step(state, batch)
          jax.block_until_ready(state.params)
        summarise(glob.glob(f"{root}/**/*.xplane.pb", recursive=True)[0], 1, args.top,
                  unit="learner step")
      del state, learner


if __name__ == "__main__":
  main()
