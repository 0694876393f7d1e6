"""vLLM (the ``vllm-cpu`` build) as a contender of ``benchmarks/peers/peers.py`` (rollout only).

The offline ``LLM`` engine on the checkpoint, float32, given the 32 prompts as token ids in one
``generate`` call: temperature 1, no top-k / top-p, ``max_tokens = min_tokens = 128`` and
``ignore_eos``, so that every row generates 128 tokens. vLLM's own CPU attention kernels and
scheduler (continuous batching, paged KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB, 1 by default
here), its engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``OMP_NUM_THREADS`` = the
core count (vLLM binds one OpenMP thread per core).

Configured as vLLM's CPU installation page asks for a wheel install: TCMalloc and Intel OpenMP
in ``LD_PRELOAD`` (``contenders.py`` sets it, and refuses to run vLLM without them), a KV cache
sized by ``VLLM_CPU_KVCACHE_SPACE``, ``max_num_seqs`` = the most rows a work has (every row of a
work may run at once, as rft_jax's pool may), and ``detokenize=False`` (rft_jax returns token ids
and so does this runner: nothing reads vLLM's text). The ready line prints the effective
settings, vLLM's scheduler limits included.

longtail_128 / longtail_512: the spec's long-tailed work (``peers.spec.LONGTAIL``): ``n = 8``
samples a prompt, the spec's stop token ids, no ``min_tokens``; a 4 GiB KV cache.

decode_1 ... decode_128: ``common.decode_steps`` on the work's rows (``max_tokens = min_tokens``,
``ignore_eos``), all of them in one batch.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import decode_steps, serve  # noqa: E402


SETTINGS: dict[str, str] = {}


def effective_settings(llm) -> dict[str, str]:
  """What vLLM's engine runs with, as it resolved it (its config objects), for the ready line."""
  out = {name: os.environ.get(name, "unset") for name in
         ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING")}
  try:
    config = llm.llm_engine.vllm_config
    sched, cache = config.scheduler_config, config.cache_config
    out |= {"max_num_seqs": str(sched.max_num_seqs),
            "max_num_batched_tokens": str(sched.max_num_batched_tokens),
            "block_size": str(cache.block_size), "dtype": str(config.model_config.dtype),
            "compilation mode": str(getattr(config.compilation_config, "mode",
                                            getattr(config.compilation_config, "level", "?")))}
  except AttributeError as e:  # another vLLM's config layout: say so rather than guess
    out["engine config"] = f"unreadable ({e})"
  import torch
  out |= {"torch threads": str(torch.get_num_threads()), "detokenize": "False"}
  return out


def setup(spec: dict) -> dict:
  longtail = spec.get("longtail", {})
  os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4" if longtail or spec.get("decode") else "1")
  os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
  os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))  # else vLLM drops to 1 thread
  from vllm import LLM, SamplingParams
  from vllm.inputs import TokensPrompt

  decode = spec.get("decode", {})
  longest = max([512] + [max(map(len, w["prompts"])) + w["new_tokens"] for w in longtail.values()]
                + [max(map(len, w["prompts"])) + 4 + w["steps"] for w in decode.values()])
  rows = max([len(spec["rollout_prompts"])] + [len(w["prompts"]) * w["n"] for w in longtail.values()]
             + [len(w["prompts"]) for w in decode.values()])
  llm = LLM(model=spec["checkpoint"], dtype="float32", seed=0, max_model_len=longest,
            max_num_seqs=rows)
  SETTINGS.update(effective_settings(llm))
  prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["rollout_prompts"]]
  new = spec["new_tokens"]

  def rollout(seed: int) -> int:
    params = SamplingParams(n=1, temperature=spec["temperature"], top_p=1.0, top_k=-1,
                            max_tokens=new, min_tokens=new, ignore_eos=True, seed=seed,
                            detokenize=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)

  def longtail_work(work: dict):
    work_prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]

    def run(seed: int) -> int:
      params = SamplingParams(n=work["n"], temperature=spec["temperature"], top_p=1.0, top_k=-1,
                              max_tokens=work["new_tokens"],
                              stop_token_ids=spec["stop_token_ids"], detokenize=False)
      # No per-request seed: with one, vLLM-CPU 0.32 fails at 512 sequences ("CPU Generator
      # does not use offset"); the engine's seed (0) is set once, each call draws anew.
      outs = llm.generate(work_prompts, params, use_tqdm=False)
      return sum(len(c.token_ids) for o in outs for c in o.outputs)
    return run

  def decode_work(work: dict):
    work_prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]

    def run(seed: int) -> dict:
      def call(new: int):
        params = SamplingParams(n=1, temperature=spec["temperature"], top_p=1.0, top_k=-1,
                                max_tokens=new, min_tokens=new, ignore_eos=True,
                                detokenize=False)
        llm.generate(work_prompts, params, use_tqdm=False)
      return decode_steps(call, len(work_prompts), work["steps"])
    return run

  return {"rollout": rollout, **{name: longtail_work(w) for name, w in longtail.items()},
          **{name: decode_work(w) for name, w in decode.items()}}


if __name__ == "__main__":
  serve(setup, ("torch", "transformers", "vllm-cpu"), about=lambda: SETTINGS)
