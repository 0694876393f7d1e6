"""Rollout throughput of :func:`rft_jax.sampling.generate`, against transformers, and a roofline.

Default mode: a random Qwen2.5-style model (hidden 256, 4 layers, vocab 8192 by default) built
with transformers in a temporary directory and loaded with ``load_hf``; the same 32 prompts
(random lengths) sampled at the same temperature for the same ``max_new_tokens`` (no stop
tokens, so every row generates them all) by ``rft_jax`` and by transformers' ``generate``
(torch, ``do_sample=True``, ``torch.set_num_threads(cores)``; the two alternate run by run, so
that both see the same machine load). Prints tokens/s of both and their
ratio; rft_jax's first call (compilation) is timed separately and excluded.

    python benchmarks/speed/sampler.py [--batch 32] [--new-tokens 128] [--repeats 3]

``--segments 1 2 4`` mode: the first call's (compile) time and the steady tokens/s of a random
Qwen3 built in memory for each ``cache_segments`` value (what ``min_segment_tokens`` rests on).

``--roofline`` mode (meant for a GPU): for a preset config and batch sizes, the bytes one
decode step must read (the weights once, plus each row's KV cache), the step time those bytes
take at the device's memory bandwidth (the faster of two measured copies, or ``--hbm-gbps``),
and the measured step time of ``generate`` (a random bfloat16 model, ``(t(M) - t(1)) / (M -
1)``, best of ``--repeats``), i.e. the achieved fraction of the bandwidth; ``--transformers``
times transformers' ``generate`` on the same GPU alike. KV bytes are given both as the useful
amount (the live context, averaged over the steps) and as what the decoder reads (every slot of
the last segment's cache, masked or not: a bound).

    python benchmarks/speed/sampler.py --roofline --preset 0.5b --batches 64 256 --transformers
    python benchmarks/speed/sampler.py --roofline --preset 1.5b --dry-run --hbm-gbps 3350  # bytes only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from peers.runners.hf_runner import left_padded  # noqa: E402
from rft_jax.models import Qwen, QwenConfig, load_hf  # noqa: E402
from rft_jax.sampling import SamplingParams, generate, prompt_length_bucket  # noqa: E402

PRESETS = {
    "0.5b": QwenConfig.qwen2_5_0_5b,
    "1.5b": QwenConfig.qwen2_5_1_5b,
    "7b": QwenConfig.qwen2_5_7b,
    "tiny": lambda **kw: QwenConfig("qwen2", 8192, 256, 704, 4, 4, 2, tie_word_embeddings=True,
                                    **kw),
}


# ---------------------------------------------------------------------------------------------
# rft_jax vs transformers on CPU.

def build_checkpoint(root: str, hidden: int, layers: int, vocab: int) -> str:
  """A random Qwen2.5-style checkpoint saved with transformers; returns its directory."""
  import torch
  from transformers import AutoModelForCausalLM, Qwen2Config
  from transformers.utils import logging

  logging.set_verbosity_error()
  config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64,
                       num_key_value_heads=max(hidden // 128, 1), tie_word_embeddings=True,
                       max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})
  torch.manual_seed(0)
  model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  path = os.path.join(root, "ckpt")
  model.save_pretrained(path)
  return path


def add_decode_shape_arguments(parser) -> None:
  """``--preset``, ``--batch``, ``--prompt``, ``--new-tokens``: a GPU script's decode shapes."""
  parser.add_argument("--preset", choices=sorted(PRESETS), default="0.5b")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--prompt", type=int, default=256)
  parser.add_argument("--new-tokens", type=int, default=128)


def make_prompts(batch: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, rng.integers(lo, hi + 1)).tolist() for _ in range(batch)]


class RftJax:
  """rft_jax's sampler on the checkpoint; the first call (compilation) is timed separately."""

  def __init__(self, path: str, prompts, new_tokens: int, temperature: float):
    self.model = load_hf(path)
    self.prompts = prompts
    self.params = SamplingParams(n=1, temperature=temperature, max_new_tokens=new_tokens)
    start = time.perf_counter()
    generate(self.model, prompts, self.params, seed=0)
    self.first_call = time.perf_counter() - start

  def __call__(self, seed: int) -> tuple[float, int]:
    start = time.perf_counter()
    out = generate(self.model, self.prompts, self.params, seed=seed + 1)
    return time.perf_counter() - start, int(out.completion_lengths.sum())


class Transformers:
  """transformers' ``generate`` (torch, eager, one thread per core) on the same prompts."""

  def __init__(self, path: str, prompts, new_tokens: int, temperature: float, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    self.torch = torch
    self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask = left_padded(prompts)
    self.width = ids.shape[1]
    sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature \
        else dict(do_sample=False)  # --temperature 0: greedy
    self.kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=0, **sampling)
    with torch.inference_mode():  # warm-up
      self.model.generate(**{**self.kwargs, "max_new_tokens": 2, "min_new_tokens": 2})

  def __call__(self, seed: int) -> tuple[float, int]:
    self.torch.manual_seed(seed)
    with self.torch.inference_mode():
      start = time.perf_counter()
      out = self.model.generate(**self.kwargs)
      elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - self.width) * out.shape[0]


def compare(args) -> None:
  """Alternates the two samplers, so that both see the same machine load."""
  with tempfile.TemporaryDirectory() as root:
    path = build_checkpoint(root, args.hidden, args.layers, args.vocab)
    prompts = make_prompts(args.batch, args.vocab, args.min_prompt, args.max_prompt)
    print(f"backend {jax.default_backend()} ({jax.device_count()} devices), {os.cpu_count()} "
          f"cores; Qwen2-style hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          f"batch {args.batch}, prompts {args.min_prompt}-{args.max_prompt} tokens, "
          f"{args.new_tokens} new tokens, T={args.temperature}, torch threads "
          f"{args.torch_threads}, load average {os.getloadavg()[0]:.1f}")
    samplers = {"rft_jax": RftJax(path, prompts, args.new_tokens, args.temperature),
                "transformers": Transformers(path, prompts, args.new_tokens, args.temperature,
                                             args.torch_threads)}
    runs = {name: [] for name in samplers}
    for r in range(args.repeats):
      for name, sampler in samplers.items():
        runs[name].append(sampler(r))
  print(f"rft_jax      first call (compile + run) {samplers['rft_jax'].first_call:7.2f} s")
  rate = {}
  for name, results in runs.items():
    times = [t for t, _ in results]
    tokens = results[0][1]
    rate[name] = tokens / statistics.median(times)
    print(f"{name:<12} {rate[name]:8.0f} tokens/s  (median of {args.repeats} runs of {tokens} "
          f"tokens: {', '.join(f'{t:.2f}' for t in times)} s)")
  print(f"ratio rft_jax / transformers: {rate['rft_jax'] / rate['transformers']:.2f}x")


# ---------------------------------------------------------------------------------------------
# Roofline.

def weight_arrays(config: QwenConfig) -> list[jax.ShapeDtypeStruct]:
  """The parameters of a Qwen of ``config``, abstract (no memory): what a decode step reads."""
  model = nnx.eval_shape(lambda: Qwen(config, rngs=nnx.Rngs(0)))
  return jax.tree.leaves(nnx.state(model, nnx.Param))


def kv_bytes_per_token(config: QwenConfig) -> int:
  """Bytes of keys and values one token holds in the cache, over every layer."""
  return (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
          * jnp.dtype(config.dtype).itemsize)


def decode_bytes(config: QwenConfig, batch: int, prompt: int, new_tokens: int) -> dict:
  """Bytes one decode step reads: weights once, KV per row (useful and as allocated)."""
  weight_bytes = sum(x.size * x.dtype.itemsize for x in weight_arrays(config))
  kv_per_token = kv_bytes_per_token(config)
  slots = prompt_length_bucket(prompt) + new_tokens - 1
  live = prompt + new_tokens / 2  # average context over the decode steps
  return {"weights": weight_bytes, "kv_useful": batch * live * kv_per_token,
          "kv_read": batch * slots * kv_per_token}


def median_seconds(fn, *args, repeats: int = 10) -> float:
  """Median wall time of ``fn(*args)`` (a jitted function, waited for) over ``repeats`` calls,
  after one call that compiles and warms up."""
  fn(*args).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def copy_gbps(gib: float = 2.0, repeats: int = 10) -> float:
  """Measured device memory bandwidth: bytes read plus written by ``x + 1`` over ``gib`` GiB of
  bfloat16, median of ``repeats`` runs, GB/s."""
  x = jnp.ones((int(gib * 2 ** 30) // 2,), jnp.bfloat16)
  return 2 * x.nbytes / median_seconds(jax.jit(lambda x: x + 1), x, repeats=repeats) / 1e9


def torch_copy_gbps(gib: float = 4.0) -> float | None:
  """Device-to-device copy through torch, bytes read + written per second (None without CUDA)."""
  try:
    import torch
    if not torch.cuda.is_available():
      return None
  except ImportError:
    return None
  src = torch.empty(int(gib * 2 ** 30), dtype=torch.uint8, device="cuda")
  dst = torch.empty_like(src)
  for _ in range(3):
    dst.copy_(src)
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  start.record()
  for _ in range(10):
    dst.copy_(src)
  end.record()
  torch.cuda.synchronize()
  seconds = start.elapsed_time(end) / 1e3 / 10
  del src, dst
  torch.cuda.empty_cache()
  return 2 * gib * 2 ** 30 / seconds / 1e9


def _best_seconds(run, repeats: int) -> float:
  run(0)  # compile, warm up
  times = []
  for r in range(repeats):
    start = time.perf_counter()
    run(r + 1)
    times.append(time.perf_counter() - start)
  return min(times)


def _transformers_step(config: QwenConfig, prompts, new_tokens: int, repeats: int) -> float:
  """Seconds per decode step of transformers' ``generate`` (torch, CUDA, bfloat16, sampling at
  T = 1, every row generating ``new_tokens``) on a random model of ``config``'s shapes."""
  import torch
  from transformers import AutoModelForCausalLM, Qwen2Config

  hf_config = Qwen2Config(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                          intermediate_size=config.intermediate_size,
                          num_hidden_layers=config.num_hidden_layers,
                          num_attention_heads=config.num_attention_heads,
                          num_key_value_heads=config.num_key_value_heads,
                          tie_word_embeddings=config.tie_word_embeddings,
                          max_position_embeddings=4096, bos_token_id=1, eos_token_id=None)
  model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).cuda().eval()
  ids, mask = left_padded(prompts)
  ids, mask = ids.cuda(), mask.cuda()

  def run(m):
    def once(seed):
      torch.manual_seed(seed)
      with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m,
                       do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
      torch.cuda.synchronize()
    return _best_seconds(once, repeats)

  step = (run(new_tokens) - run(1)) / (new_tokens - 1)
  model = None  # frees its GPU memory; `run` above reads the name, so it is not deleted
  torch.cuda.empty_cache()
  return step


def roofline(args) -> None:
  config = PRESETS[args.preset](dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  measured = args.hbm_gbps is None  # the better of two copies: XLA's x + 1, torch's copy_
  bandwidth = (max(copy_gbps(), torch_copy_gbps() or 0) if measured else args.hbm_gbps) * 1e9
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}): preset {args.preset}, "
        f"prompt {args.prompt} tokens, {args.new_tokens} new tokens, bfloat16, memory "
        f"{bandwidth / 1e9:.0f} GB/s ({'measured: a copy, read + write' if measured else 'given'})",
        flush=True)
  models = {}  # decode_kernels -> a random model of the preset (the same weights)
  for batch in args.batches:
    b = decode_bytes(config, batch, args.prompt, args.new_tokens)
    useful = b["weights"] + b["kv_useful"]
    read = b["weights"] + b["kv_read"]
    print(f"batch {batch:4d}: weights {b['weights'] / 1e6:8.1f} MB, KV useful "
          f"{b['kv_useful'] / 1e6:8.1f} MB / read {b['kv_read'] / 1e6:8.1f} MB per step; "
          f"bound {useful / bandwidth * 1e3:7.3f} ms (useful) {read / bandwidth * 1e3:7.3f} ms "
          f"(read)", flush=True)
    if args.dry_run:
      continue
    for kind in args.decode_kernels:
      if kind not in models:
        models[kind] = Qwen(config.replace(decode_kernels=kind), rngs=nnx.Rngs(0))
    prompts = make_prompts(batch, config.vocab_size, args.prompt, args.prompt)

    def rft_jax(model, m):
      params = SamplingParams(temperature=1.0, max_new_tokens=m)
      return _best_seconds(lambda seed: generate(model, prompts, params, seed=seed), args.repeats)

    contenders = {
        f"rft_jax {kind}": lambda model=model: (rft_jax(model, args.new_tokens) - rft_jax(model, 1))
        / (args.new_tokens - 1) for kind, model in models.items()}
    if args.transformers:
      contenders["transformers generate"] = lambda: _transformers_step(
          config, prompts, args.new_tokens, args.repeats)
    for name, per_step in contenders.items():
      try:
        seconds = per_step()
      except Exception as e:  # a contender that fails on this machine is reported, not fatal
        print(f"  {name:<22} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        continue
      print(f"  {name:<22} {seconds * 1e3:7.3f} ms/step, {batch / seconds:9.0f} tokens/s; "
            f"{useful / seconds / bandwidth:6.1%} (useful bytes) "
            f"{read / seconds / bandwidth:6.1%} (read bytes) of the bandwidth", flush=True)


def segments(args) -> None:
  """First-call (compile) time and steady throughput of ``generate`` for each ``cache_segments``
  value (segments down to 16 new tokens allowed), on a random model built in memory."""
  import dataclasses

  import jax
  from flax import nnx

  config = QwenConfig("qwen3", args.vocab, args.hidden, args.hidden * 3, args.layers, args.hidden // 64,
                      max(args.hidden // 128, 1), head_dim=64, tie_word_embeddings=True)
  model = Qwen(config, rngs=nnx.Rngs(0))
  prompts = make_prompts(args.batch, args.vocab, args.min_prompt, args.max_prompt)
  base = SamplingParams(n=1, temperature=args.temperature, max_new_tokens=args.new_tokens, min_segment_tokens=16)
  for count in args.segments:
    params = dataclasses.replace(base, cache_segments=count)
    jax.clear_caches()
    start = time.perf_counter()
    generate(model, prompts, params, seed=0)
    first = time.perf_counter() - start
    times = []
    for r in range(args.repeats):
      start = time.perf_counter()
      generate(model, prompts, params, seed=r + 1)
      times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"cache_segments {count}: first call {first:6.2f} s, then {median:6.3f} s median "
          f"({args.batch * args.new_tokens / median:7.0f} tokens/s)", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--min-prompt", type=int, default=16)
  parser.add_argument("--max-prompt", type=int, default=48)
  parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                      help="torch.set_num_threads for transformers (default: the core count)")
  parser.add_argument("--roofline", action="store_true")
  parser.add_argument("--preset", choices=sorted(PRESETS), default="0.5b")
  parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
  parser.add_argument("--prompt", type=int, default=256)
  parser.add_argument("--hbm-gbps", type=float, default=None,
                      help="memory bandwidth, GB/s (default: measured with a copy)")
  parser.add_argument("--transformers", action="store_true",
                      help="also time transformers' generate on the GPU (torch with CUDA)")
  parser.add_argument("--dry-run", action="store_true", help="roofline bytes only, no run")
  parser.add_argument("--decode-kernels", nargs="+", default=["auto"],
                      help="QwenConfig.decode_kernels of each rft_jax contender (auto, xla, fused)")
  parser.add_argument("--segments", type=int, nargs="+",
                      help="time the first call and throughput for these cache_segments values instead")
  args = parser.parse_args()
  if args.segments:
    segments(args)
  elif args.roofline:
    roofline(args)
  else:
    compare(args)


if __name__ == "__main__":
  main()
