"""The paper's six configs compiled for real topologies with `rft-jax plan` (deviceless; slow).

  python benchmarks/plan/plan_paper_configs.py                 # the six configs as shipped (paged), v5p:2x2x1
  python benchmarks/plan/plan_paper_configs.py sampling.kv_pages=null sampling.scheduler=static \
      sampling.max_rollouts_per_call=256 --configs qwen2_5_7b_clip_b   # the dense cache: its own table
  python benchmarks/plan/plan_paper_configs.py --topology v6e:2x4 mesh.model=2 learner.micro_batch_size=8
  python benchmarks/plan/plan_paper_configs.py --topology v5p:2x2x4 --configs qwen3_30b_a3b_clip_b sampling.kv_pages=null  # MoE

Each config is planned in its own process (`rft-jax plan --json`, model.path set to the
architecture-only directories under configs/models/); the per-device figures are printed as the
Markdown table of docs/results/plans.md and written to --out as JSON lines. Full-size compiles take 1-4
minutes each on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {
    "qwen2_5_7b": "configs/models/Qwen2.5-7B-Instruct",
    "qwen3_4b": "configs/models/Qwen3-4B-Base",
    "qwen3_30b_a3b": "configs/models/Qwen3-30B-A3B",  # MoE: Clip_B, full or LoRA (--configs)
}
PAPER = ("qwen2_5_7b", "qwen3_4b")
VARIANTS = ("grpo", "clip_b", "clip_v")
MOE_CONFIGS = ("qwen3_30b_a3b_clip_b", "qwen3_30b_a3b_clip_b_lora")
GiB = 1024**3


def plan(config: str, model_dir: str, topology: str, overrides: list[str]) -> dict:
  cmd = [sys.executable, "-m", "rft_jax.cli", "plan", config, f"model.path={model_dir}",
         *overrides, "--topology", topology, "--json"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  if out.returncode not in (0, 1):  # 1: planned, does not fit
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def row(name: str, r: dict) -> str:
  g = lambda b: f"{b / GiB:.1f}"
  l, s = r["learner"], r["sampler"]
  return (f"| {name} | {r['topology']} data={r['mesh']['data']} model={r['mesh']['model']} | "
          f"{l['micro_batch_size']} | {g(l['parameter_bytes'])} / {g(l['optimizer_state_bytes'])} | "
          f"{g(l['temp_bytes'])} | {g(l['total_bytes'])} | {l['compile_seconds']:.0f} | "
          f"{s['prompts_per_call']} x {s['rollouts_per_call'] // s['prompts_per_call']} | "
          f"{g(s['kv_cache_bytes'])} | {g(s['temp_bytes'])} | {g(s['total_bytes'])} | "
          f"{s['compile_seconds']:.0f} | {g(r['hbm_bytes_per_device'])} | "
          f"{'yes' if r['fits'] else 'NO'} |")


def paged_row(name: str, r: dict) -> str:
  """A plan with ``sampling.kv_pages``: the pages per data shard and the rows they keep in flight."""
  g = lambda b: f"{b / GiB:.1f}"
  s = r["sampler"]
  return (f"| {name} | {r['topology']} data={r['mesh']['data']} model={r['mesh']['model']} | "
          f"{s['prompts_per_call']} x {s['rollouts_per_call'] // s['prompts_per_call']} | "
          f"{s['rows_in_flight']} | {s['kv_pages']} x {s['page_size']} | {g(s['kv_cache_bytes'])} | "
          f"{s['rows_at_full_length'] * r['mesh']['data']} | {s['tokens_per_slot']} | "
          f"{s['max_kv_pages']} | {g(s['temp_bytes'])} | {g(s['total_bytes'])} | "
          f"{s['compile_seconds']:.0f} | {'yes' if r['fits'] else 'NO'} |")


PAGED_HEADER = ("| config | mesh | sampler call | rows in flight | pages per shard x tokens | KV GiB "
                "| rows at full length | tokens per slot | pages that fit | sampler temp | "
                "sampler total | compile s | fits |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
HEADER = ("| config | mesh | micro-batch | params / optimizer GiB | learner temp | learner total | "
          "compile s | sampler call | KV cache | sampler temp | sampler total | compile s | HBM | "
          "fits |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", default="v5p:2x2x1")
  parser.add_argument("--configs", nargs="*", default=[f"{m}_{v}" for m in PAPER for v in VARIANTS],
                      help=f"config names under configs/ (default: the paper's six; also {', '.join(MOE_CONFIGS)})")
  parser.add_argument("--out", default="runs/plan_paper_configs.jsonl")
  parser.add_argument("overrides", nargs="*", help="dotted overrides for every config")
  args = parser.parse_args()
  paged = "sampling.kv_pages=null" not in args.overrides  # the configs ship with pages
  print(PAGED_HEADER if paged else HEADER)
  os.makedirs(os.path.dirname(os.path.join(ROOT, args.out)), exist_ok=True)
  with open(os.path.join(ROOT, args.out), "a") as log:
    for name in args.configs:
      model = next(m for m in CONFIGS if name.startswith(m))
      report = plan(f"configs/{name}.yaml", CONFIGS[model], args.topology, args.overrides)
      log.write(json.dumps({"config": name, **report}) + "\n")
      print((paged_row if paged else row)(name, report), flush=True)


if __name__ == "__main__":
  main()
