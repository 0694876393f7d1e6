"""Load time and peak host memory of ``load_hf`` on a Qwen2.5-0.5B-size checkpoint.

Builds a randomly initialised Qwen2.5-0.5B-shaped model with transformers (torch, bfloat16),
saves it as safetensors in 2+ shards in a temporary directory, then, in a fresh subprocess per
case, loads it with :func:`rft_jax.models.load_hf` and reports the load time and the peak
resident set (``ru_maxrss``) next to the checkpoint size. The baseline is the RSS after
importing JAX/rft_jax and starting the backend; what load_hf adds above it is the placed
parameters (host memory on CPU) plus transients (one tensor at a time).

    python benchmarks/speed/load_hf.py [--shard-size 400MB] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30


def _rss_gib() -> float:
  """Peak RSS of this process (``ru_maxrss``; KiB on Linux).

  ``ru_maxrss`` survives fork+exec, so the parent never grows large: the checkpoint is built in
  its own subprocess as well.
  """
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def _hwm_gib() -> float:
  """``VmHWM`` of this address space (Linux), a cross-check of ``ru_maxrss``."""
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmHWM:"):
      return int(line.split()[1]) * 1024 / GIB
  return float("nan")


def build_checkpoint(path: Path, shard_size: str) -> None:
  """A random Qwen2.5-0.5B-size bfloat16 checkpoint (torch init, no download)."""
  import torch
  from transformers import AutoModelForCausalLM, Qwen2Config
  from transformers.utils import logging

  logging.disable_progress_bar()
  from rft_jax.models import QwenConfig

  config = Qwen2Config(**{k: v for k, v in QwenConfig.qwen2_5_0_5b().to_hf_dict().items()
                          if k not in ("architectures", "torch_dtype", "dtype", "model_type")})
  torch.manual_seed(0)
  with torch.device("cpu"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
  model.save_pretrained(path, max_shard_size=shard_size)


def measure(path: Path, param_dtype: str, mesh: str | None) -> dict:
  """Runs in the subprocess: imports, warms the backend, loads, reports."""
  import jax
  import jax.numpy as jnp

  from rft_jax.models import load_hf
  from rft_jax.parallel import make_mesh

  jax.block_until_ready(jnp.zeros(1) + 1)
  baseline = _rss_gib()
  m = None
  if mesh:
    data, model = map(int, mesh.split("x"))
    m = make_mesh(data=data, model=model)
  t0 = time.perf_counter()
  loaded = load_hf(path, dtype=jnp.bfloat16, param_dtype=getattr(jnp, param_dtype), mesh=m)
  from flax import nnx
  leaves = jax.tree.leaves(nnx.state(loaded))
  jax.block_until_ready(leaves)
  seconds = time.perf_counter() - t0
  params_gib = sum(x.size * x.dtype.itemsize for x in leaves) / GIB
  return {"seconds": seconds, "peak_gib": _rss_gib(), "hwm_gib": _hwm_gib(),
          "baseline_gib": baseline,
          "params_gib": params_gib, "devices": len(jax.devices())}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shard-size", default="400MB")
  parser.add_argument("--keep", type=Path, help="write the checkpoint here (and keep it)")
  parser.add_argument("--_measure", nargs=3, help=argparse.SUPPRESS)
  parser.add_argument("--_build", nargs=2, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._build:
    build_checkpoint(Path(args._build[0]), args._build[1])
    return
  if args._measure:
    path, dtype, mesh = args._measure
    print(json.dumps(measure(Path(path), dtype, None if mesh == "none" else mesh)))
    return

  tmp = None if args.keep else tempfile.TemporaryDirectory()
  path = args.keep or Path(tmp.name) / "qwen2_5_0_5b_random"
  t0 = time.perf_counter()
  if not (path / "config.json").exists():
    subprocess.run([sys.executable, __file__, "--_build", str(path), args.shard_size], check=True)
  files = sorted(path.glob("*.safetensors"))
  size = sum(f.stat().st_size for f in files) / GIB
  print(f"checkpoint: Qwen2.5-0.5B size, bfloat16, {len(files)} safetensors files, "
        f"{size:.3f} GiB (built in {time.perf_counter() - t0:.0f} s)")
  cases = [("bfloat16", "none"), ("float32", "none"), ("bfloat16", "4x2")]
  for dtype, mesh in cases:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    if mesh != "none":
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                          " --xla_force_host_platform_device_count=8").strip()
    out = subprocess.run([sys.executable, __file__, "--_measure", str(path), dtype, mesh],
                         env=env, check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    where = "1 device" if mesh == "none" else f"mesh {mesh} on {r['devices']} CPU devices"
    added = r["peak_gib"] - r["baseline_gib"]
    print(f"load_hf -> {dtype} params, {where}: load time {r['seconds']:.2f} s")
    print(f"load_hf -> {dtype} params, {where}: peak RSS {r['peak_gib']:.3f} GiB "
          f"(baseline {r['baseline_gib']:.3f} GiB + {added:.3f} GiB during load; "
          f"params {r['params_gib']:.3f} GiB; checkpoint {size:.3f} GiB; "
          f"added/params = {added / r['params_gib']:.2f}; VmHWM {r['hwm_gib']:.3f} GiB)")
  if tmp is not None:
    tmp.cleanup()


if __name__ == "__main__":
  main()
