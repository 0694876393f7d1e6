"""rft_jax's sampler against transformers' two fast generation paths on long-tailed rollouts, on
one GPU (or, small, on CPU): tokens per second side by side.

The work: one random Qwen2.5 checkpoint of a preset's shapes (``benchmarks/speed/sampler.py``'s
``PRESETS``: ``0.5b``, ``1.5b``, ``tiny``), built by transformers (seed 0) and saved in a
temporary directory in bfloat16 on a GPU (float32 on CPU), which every contender loads: rft_jax
with ``rft_jax.models.load_hf``, transformers with ``from_pretrained``, so all run the same
weights. ``--prompts`` prompts of 16-48 random tokens (``benchmarks/peers/runners/spec.py``'s
``longtail_prompts`` for 16 and 64 prompts, else its ``prompts``, seed 2) x ``--n`` samples,
temperature 1 (no top-k / top-p), at most ``--max-new`` new tokens, ending at any of the
peers' long-tailed stop ids (``spec.stop_token_ids``: ``vocab / 200`` ids from 2 on, so a
random model's rows stop with probability ~1/200 a step: lengths about geometric, mean ~200, a
few reaching the limit).

The contenders, each in its own subprocess (so that JAX and torch never share the GPU's memory
and a crash ends one contender only), one after the other:

* ``rft_jax``: ``rft_jax.sampling.generate`` with its default sampler, continuous batching on a
  dense KV cache (``SamplingParams`` defaults: one decode slot per row, the pool shrinking in
  stages as the queue drains);
* ``rft_jax_paged``: the same on a paged KV cache, ``--rft-paged SLOTS:PAGES[:KIND]``
  (``benchmarks/accelerator/longtail_sampler.py``'s ``paged:`` setting; the default
  ``-:auto``: one slot per row and pages of 16 tokens for every row's longest sequence, so that
  no sample waits for pages);
* ``hf_cb``: transformers' continuous batching, ``model.generate_batch`` on its paged KV cache,
  configured as its continuous-batching guide (``docs/source/en/continuous_batching.md``, and
  ``ContinuousBatchingConfig``'s docstring in ``generation/configuration_utils.py``) recommends
  on a GPU: bfloat16, a flash attention implementation where the GPU image has one
  (``flash_attention_3``, else ``flash_attention_2``; else ``sdpa``, and no automatic switch,
  which would fetch a kernel from the Hub), ``ContinuousBatchingConfig`` defaults otherwise:
  pages of 256 tokens ("works well in most cases", the ``flash_attn_with_kvcache`` decode
  kernel's size), ``num_blocks`` and ``max_batch_tokens`` sized from the free GPU memory, the
  decode fast path, CUDA graphs and async batching as it decides them (on with flash
  attention); plus ``torch.compile`` at ``default_compile_level`` ``--hf-compile-level``
  (default 1 on a GPU: "modest speedup, short warmup"; 3 is its "best throughput, longest
  warmup", minutes of autotuning), ``num_return_sequences = n`` (a prompt's samples fork from
  its prefill), one persistent manager (``persistent_manager=True``: the warm-up call creates
  it and captures its graphs, the timed calls reuse it). On CPU: ``sdpa``, no compile, and a
  cache of just the blocks the work needs (its default takes 60% of the RAM);
* ``hf_static``: transformers' ``generate`` with ``cache_implementation="static"`` and
  ``torch.compile`` as its inference-optimization guide (``docs/source/en/llm_optims.md``,
  "Static kv-cache and torch.compile": static cache, forward compiled with
  ``mode="reduce-overhead", fullgraph=True``) recommends, through transformers 5's own
  mechanism: ``generate`` compiles its decode steps itself for a static cache on a GPU, with
  ``CompileConfig()`` (``mode="reduce-overhead"``: CUDA graphs; ``fullgraph=False``, which
  compiles the same graph as the guide's ``fullgraph=True`` where there is no graph break and
  does not fail where there is one), ``sdpa``, the rows left-padded into one batch
  (``num_return_sequences = n``): every row decodes until the longest one stops. On CPU the
  compile is forced (``CompileConfig._compile_all_devices``; ``--hf-static-compile off`` turns
  it off).

Each contender makes one warm-up call (compiles; timed apart), then ``--rounds`` timed calls
(seeds 1, 2, ...); each prints a line as it ends (seconds, generated tokens counted up to and
including the stop token, tokens/s, mean and longest length, and whether every row respects
``--max-new`` and the stop rule), and a contender that fails prints one line with its error
(its stderr is in ``--log-dir``) while the rest go on. The table gives each contender's median
tokens/s and the ratio of rft_jax's to the faster transformers path's (the target: >= 3x).
Each samples its own lengths (the token counts are printed). ``--budget``: seconds for the
whole run; a contender gets what is left (at most ``--timeout``).

    python benchmarks/accelerator/longtail_peers.py --preset 0.5b --prompts 16 --n 8 --max-new 1024
    python benchmarks/accelerator/longtail_peers.py --device cpu --preset tiny --prompts 2 --n 2 --max-new 32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCHMARKS)
ROOT = os.path.dirname(BENCHMARKS)
if ROOT not in sys.path:
  sys.path.insert(1, ROOT)

CONTENDERS = ("rft_jax", "hf_cb", "hf_static", "rft_jax_paged")
HF = ("hf_cb", "hf_static")
LABELS = {"rft_jax": "rft_jax continuous", "rft_jax_paged": "rft_jax paged",
          "hf_cb": "transformers generate_batch", "hf_static": "transformers static+compile"}
RESULT = "@@ "  # a child's result line: RESULT + JSON
PROMPT_SEED = 2  # spec.longtail_prompts' seed of its first work
MAX_PROMPT = 48  # spec.prompts' longest prompt


# ---------------------------------------------------------------------------------------------
# The work, the same in every process.

def preset_config(preset: str):
  from speed.sampler import PRESETS
  return PRESETS[preset]()


def work(args) -> tuple[list[list[int]], list[int]]:
  """The prompts and the stop ids of the peers' long-tailed works at this preset's vocabulary:
  the prompts of the work with ``--prompts`` prompts (16: ``longtail_128``'s, 64:
  ``longtail_512``'s), else as many drawn as theirs (seed 2)."""
  from peers.runners.spec import LONGTAIL, longtail_prompts, prompts, stop_token_ids
  vocab = preset_config(args.preset).vocab_size
  same = [w for w, (count, *_) in LONGTAIL.items() if count == args.prompts]
  drawn = (longtail_prompts(same[0], vocab) if same
           else prompts(args.prompts, vocab, seed=PROMPT_SEED))
  return drawn, stop_token_ids(vocab)


def check_rows(rows: list[list[int]], stops: set[int], max_new: int) -> list[str]:
  """What breaks the rules in ``rows`` (each a completion): at most ``max_new`` tokens, at least
  one, a stop id only as the last token, and a row shorter than ``max_new`` ends with one."""
  bad = []
  for i, row in enumerate(rows):
    if not 1 <= len(row) <= max_new:
      bad.append(f"row {i}: {len(row)} tokens")
    elif any(t in stops for t in row[:-1]):
      bad.append(f"row {i}: a stop id before its end")
    elif len(row) < max_new and row[-1] not in stops:
      bad.append(f"row {i}: ends at {len(row)} < max-new without a stop id")
  return bad


def build_checkpoint(path: str, preset: str, dtype: str) -> None:
  """A random transformers Qwen2.5 of ``preset``'s shapes (its config as ``QwenConfig`` writes
  it), saved in ``dtype``."""
  import torch
  from transformers import AutoConfig, AutoModelForCausalLM
  from transformers.utils import logging

  logging.set_verbosity_error()
  logging.disable_progress_bar()
  hf = preset_config(preset).to_hf_dict()
  hf.update(bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype=dtype, torch_dtype=dtype)
  config = AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
  torch.manual_seed(0)
  model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
  model.save_pretrained(path)


# ---------------------------------------------------------------------------------------------
# The contenders (each in a child process): setup returns (description, call(seed) -> rows).

def rft_jax_contender(args, prompts, stops, paged: bool):
  import jax
  import jax.numpy as jnp

  from accelerator.longtail_sampler import setting_params
  from rft_jax.models import load_hf
  from rft_jax.sampling import SamplingParams, generate

  dtype = jnp.bfloat16 if args.device == "cuda" else jnp.float32
  model = load_hf(args.checkpoint, dtype=dtype, param_dtype=dtype)
  base = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new,
                        stop_token_ids=tuple(stops))
  setting = "continuous:-"
  if paged:
    slots, pages, *kind = args.rft_paged.split(":")
    if pages == "auto":  # every row's longest sequence: no sample waits for pages
      pages = str(args.prompts * args.n * math.ceil((MAX_PROMPT + args.max_new) / base.page_size))
    setting = ":".join(["paged", slots, pages, *kind])
  params = setting_params(setting, base)
  described = (f"{setting} (decode_slots {params.decode_slots or 'one per row'}, kv_pages "
               f"{params.kv_pages}, page_size {params.page_size}, paged_attention "
               f"{params.paged_attention if paged else '-'}), {jnp.dtype(dtype).name} on "
               f"{jax.devices()[0].device_kind}, jax {jax.__version__}")

  def call(seed: int) -> list[list[int]]:
    return generate(model, prompts, params, seed=seed).completions()
  return described, call


def _hf_model(args, attn: str):
  import torch
  from transformers import AutoModelForCausalLM
  from transformers.utils import logging

  logging.set_verbosity_error()
  torch.set_num_threads(os.cpu_count() or 1)
  dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
  model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype,
                                               attn_implementation=attn)
  return model.to(args.device).eval()


def _torch_device(args) -> str:
  import torch
  return torch.cuda.get_device_name() if args.device == "cuda" else "cpu"


def _flash_attention() -> str | None:
  from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available
  if is_flash_attn_3_available():
    return "flash_attention_3"
  if is_flash_attn_2_available():
    return "flash_attention_2"
  return None


def hf_cb_contender(args, prompts, stops):
  import torch
  import transformers
  from transformers import GenerationConfig
  from transformers.generation import ContinuousBatchingConfig

  flash = _flash_attention() if args.device == "cuda" else None
  model = _hf_model(args, flash or "sdpa")
  level = args.hf_compile_level
  if level is None:
    level = 1 if args.device == "cuda" else 0
  cb = dict(default_compile_level=level, auto_switch_to_flash=False, seed=0)
  if args.hf_cuda_graphs != "auto":
    cb["use_cuda_graph"] = args.hf_cuda_graphs == "on"
  if args.device == "cpu":  # its default sizes the cache to 60% of the RAM
    cb.update(num_blocks=args.prompts * args.n * math.ceil((MAX_PROMPT + args.max_new) / 256) + 4,
              max_batch_tokens=256)
  config = ContinuousBatchingConfig(**cb)
  generation = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                max_new_tokens=args.max_new, num_return_sequences=args.n,
                                eos_token_id=list(stops), pad_token_id=0)
  described = (f"attn {model.config._attn_implementation}, default_compile_level {level}, "
               f"cuda graphs {cb.get('use_cuda_graph', 'auto')}, page_size {config.page_size}, "
               f"persistent manager; {model.dtype} on {_torch_device(args)}, torch "
               f"{torch.__version__}, "
               f"transformers {transformers.__version__}")

  def call(seed: int) -> list[list[int]]:
    torch.manual_seed(seed)
    out = model.generate_batch(prompts, generation_config=generation,
                               continuous_batching_config=config, persistent_manager=True)
    errors = [o.error for o in out.values() if o.error]
    if errors or len(out) != len(prompts) * args.n:
      raise RuntimeError(f"{len(out)} of {len(prompts) * args.n} rows back; {errors[:1]}")
    if args.device == "cuda":
      torch.cuda.synchronize()
    return [list(o.generated_tokens) for o in out.values()]
  return described, call


def hf_static_contender(args, prompts, stops):
  import torch
  import transformers
  from transformers import CompileConfig

  from peers.runners.hf_runner import left_padded

  model = _hf_model(args, "sdpa")
  compiled = args.hf_static_compile == "on"
  compile_config = CompileConfig()  # mode reduce-overhead; fullgraph only makes a break an error
  if args.device != "cuda":
    compile_config._compile_all_devices = compiled  # transformers compiles on a GPU only
  ids, mask = (x.to(args.device) for x in left_padded(prompts))
  width = ids.shape[1]
  kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=args.max_new, num_return_sequences=args.n,
                eos_token_id=list(stops), pad_token_id=0, cache_implementation="static",
                compile_config=compile_config, disable_compile=not compiled)
  stop_set = set(stops)
  described = (f"cache_implementation static, "
               f"{'torch.compile mode reduce-overhead' if compiled else 'eager (no compile)'}, "
               f"attn {model.config._attn_implementation}, one batch of "
               f"{len(prompts) * args.n} rows; {model.dtype} on {_torch_device(args)}, torch "
               f"{torch.__version__}, transformers {transformers.__version__}")

  def call(seed: int) -> list[list[int]]:
    torch.manual_seed(seed)
    with torch.inference_mode():
      out = model.generate(**kwargs)
    rows = []
    for row in out[:, width:].tolist():
      end = next((i + 1 for i, t in enumerate(row) if t in stop_set), len(row))
      rows.append(row[:end])
    return rows
  return described, call


def child(args) -> None:
  """One contender: setup, a warm-up call, ``--rounds`` timed calls; a line and a result each."""
  name = args.child
  tag = f"[{name}]"

  def emit(line: str, **result) -> None:
    print(f"{tag} {line}", flush=True)
    if result:
      print(RESULT + json.dumps(result), flush=True)

  try:
    prompts, stops = work(args)
    start = time.perf_counter()
    if name.startswith("rft_jax"):
      described, call = rft_jax_contender(args, prompts, stops, paged=name == "rft_jax_paged")
    elif name == "hf_cb":
      described, call = hf_cb_contender(args, prompts, stops)
    else:
      described, call = hf_static_contender(args, prompts, stops)
    emit(f"{described}; set up in {time.perf_counter() - start:.1f} s", kind="setup",
         config=described)
    for rnd in range(args.rounds + 1):
      start = time.perf_counter()
      rows = call(rnd)
      seconds = time.perf_counter() - start
      lengths = [len(r) for r in rows]
      tokens = sum(lengths)
      bad = check_rows(rows, set(stops), args.max_new)
      what = "warm-up (compile + run)" if rnd == 0 else f"round {rnd}"
      emit(f"{what}: {seconds:.2f} s, {tokens} tokens, {tokens / seconds:.0f} tokens/s; "
           f"{len(rows)} rows, mean length {tokens / len(rows):.0f}, longest {max(lengths)}; "
           f"rows {'ok' if not bad else 'BROKEN: ' + '; '.join(bad[:3])}",
           kind="warmup" if rnd == 0 else "round", seconds=seconds, tokens=tokens,
           rows=len(rows), mean=tokens / len(rows), longest=max(lengths), bad=bad[:5])
  except Exception as e:  # one line, the traceback to stderr (the log)
    import traceback
    traceback.print_exc()
    emit(f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}", kind="error",
         error=f"{type(e).__name__}: {e}"[:500])
    sys.exit(1)


# ---------------------------------------------------------------------------------------------
# The driver.

def run_child(name: str, args, log_dir: str, timeout: float, procs: list) -> list[dict]:
  """Runs contender ``name`` in a subprocess, relaying its lines; returns its results."""
  argv = [sys.executable, os.path.abspath(__file__), "--child", name]
  for key in ("preset", "prompts", "n", "max_new", "rounds", "device", "checkpoint", "rft_paged",
              "hf_compile_level", "hf_cuda_graphs", "hf_static_compile"):
    value = getattr(args, key)
    if value is not None:
      argv.append(f"--{key.replace('_', '-')}={value}")  # "=": a value may start with "-"
  env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
  if args.device == "cpu":
    env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
  log = os.path.join(log_dir, f"{name}.log")
  results = []
  with open(log, "w") as err:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    procs.append(proc)
    deadline = time.monotonic() + timeout
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    timed_out = False
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        timed_out = True
        break
      if not sel.select(min(left, 5.0)):
        continue
      line = proc.stdout.readline()
      if not line:
        break
      if line.startswith(RESULT):
        results.append(json.loads(line[len(RESULT):]))
      else:
        print(line.rstrip("\n"), flush=True)
    if timed_out:
      proc.kill()
    proc.wait()
    procs.remove(proc)
  if timed_out:
    print(f"[{name}] failed: no end in {timeout:.0f} s (killed; its log: {log})", flush=True)
    results.append({"kind": "error", "error": f"timeout {timeout:.0f} s"})
  elif proc.returncode != 0 and not any(r["kind"] == "error" for r in results):
    with open(log, errors="replace") as f:
      lines = [x.strip() for x in f.read().splitlines() if x.strip()]
    last = lines[-1][-300:] if lines else "(no output)"
    print(f"[{name}] failed: exit {proc.returncode}: {last}", flush=True)
    results.append({"kind": "error", "error": f"exit {proc.returncode}: {last}"})
  return results


def summary(results: dict[str, list[dict]]) -> None:
  print("\n| contender | generated tokens | median s | tokens/s | mean length | longest | "
        "warm-up s | rows |")
  print("|---|---|---|---|---|---|---|---|")
  rates = {}
  for name, res in results.items():
    rounds = [r for r in res if r["kind"] == "round"]
    warm = [r for r in res if r["kind"] == "warmup"]
    error = next((r["error"] for r in res if r["kind"] == "error"), None)
    if not rounds:
      print(f"| {LABELS[name]} | failed: {(error or 'no timed round').splitlines()[0][:120]} "
            "| | | | | | |")
      continue
    rates[name] = statistics.median(r["tokens"] / r["seconds"] for r in rounds)
    ok = "ok" if not any(r["bad"] for r in rounds + warm) else "BROKEN"
    print(f"| {LABELS[name]} | {'/'.join(str(r['tokens']) for r in rounds)} | "
          f"{statistics.median(r['seconds'] for r in rounds):.2f} | {rates[name]:.0f} | "
          f"{rounds[-1]['mean']:.0f} | {max(r['longest'] for r in rounds)} | "
          f"{warm[0]['seconds'] if warm else float('nan'):.1f} | {ok} |")
  hf = {k: v for k, v in rates.items() if k in HF}
  if not hf:
    print("no transformers path ran: no ratio", flush=True)
    return
  faster = max(hf, key=hf.get)
  for name in ("rft_jax", "rft_jax_paged"):
    if name in rates:
      ratio = rates[name] / hf[faster]
      print(f"ratio {LABELS[name]} / {LABELS[faster]} (the faster transformers path): "
            f"{ratio:.2f}x (target >= 3x: {'met' if ratio >= 3 else 'not met'})", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=("0.5b", "1.5b", "7b", "tiny"), default="0.5b")
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--n", type=int, default=8)
  parser.add_argument("--max-new", type=int, default=1024)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                      help="default: cuda where torch sees a GPU, else cpu")
  parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
  parser.add_argument("--rft-paged", default="-:auto",
                      help="rft_jax_paged's SLOTS:PAGES[:KIND] (longtail_sampler's paged: "
                           "setting; PAGES auto: every row's longest sequence)")
  parser.add_argument("--hf-compile-level", type=int, default=None,
                      help="hf_cb's ContinuousBatchingConfig.default_compile_level (default: 1 "
                           "on a GPU, 0 on CPU)")
  parser.add_argument("--hf-cuda-graphs", choices=("auto", "on", "off"), default="auto",
                      help="hf_cb's use_cuda_graph (auto: transformers decides)")
  parser.add_argument("--hf-static-compile", choices=("on", "off"), default="on")
  parser.add_argument("--timeout", type=float, default=600, help="seconds per contender")
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds for the whole run; each contender gets what is left")
  parser.add_argument("--log-dir", default=None, help="each contender's stderr (default: a "
                                                      "temporary directory)")
  parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
  parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    child(args)
    return

  begin = time.monotonic()
  procs: list = []

  def stop(signum, frame):  # a `timeout` around this script ends the running contender too
    for p in procs:
      p.kill()
    sys.exit(128 + signum)
  signal.signal(signal.SIGTERM, stop)
  import torch
  if args.device is None:
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = "bfloat16" if args.device == "cuda" else "float32"
  prompts, stops = work(args)  # (no CUDA context here: the GPU is the contenders')
  print(f"longtail_peers: {args.preset} ({dtype}) on {args.device} ({os.cpu_count()} cores); "
        f"{args.prompts} prompts x {args.n} = {args.prompts * args.n} rows, prompts "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, at most {args.max_new} new "
        f"tokens, temperature 1, "
        f"{len(stops)} stop ids ({stops[0]}..{stops[-1]}); warm-up + {args.rounds} rounds each",
        flush=True)
  with tempfile.TemporaryDirectory() as root:
    log_dir = args.log_dir or root
    os.makedirs(log_dir, exist_ok=True)
    args.checkpoint = os.path.join(root, "checkpoint")
    start = time.perf_counter()
    build_checkpoint(args.checkpoint, args.preset, dtype)
    print(f"checkpoint (random, transformers, seed 0) written in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    results = {}
    for name in args.contenders:
      left = args.timeout
      if args.budget is not None:
        left = min(left, args.budget - (time.monotonic() - begin))
      if left < 10:
        print(f"[{name}] failed: not run, the budget ({args.budget:.0f} s) is spent", flush=True)
        results[name] = [{"kind": "error", "error": "budget spent"}]
        continue
      results[name] = run_child(name, args, log_dir, left, procs)
  summary(results)


if __name__ == "__main__":
  main()
