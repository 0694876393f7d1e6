"""vLLM (the ``vllm-cpu`` build) called turn by turn as a contender of
``benchmarks/peers/multi_turn.py``.

multi_turn: the work of ``turns_work.py``, one ``generate`` call a turn on every trajectory at
once, each trajectory's whole history (prompt, its turns and replies so far) as its prompt's token
ids: ``max_tokens = min_tokens = turn_tokens``, ``ignore_eos``, temperature 1, no top-k / top-p,
``detokenize=False``; then each trajectory's reply appended on the host. Automatic prefix caching
on (``enable_prefix_caching=True``): a turn's prompt finds the blocks of the history its earlier
turns computed, and only the rest (the last partial block, the reply) is prefilled. The cache is
emptied at the start of each call (``reset_prefix_cache``), so that a call does not find the
prompts of the call before (the rounds repeat the same work; an RL step's prompts are new).
``RFT_JAX_BENCH_PREFIX_CACHING=0`` in the environment turns the caching off (the history
prefilled again every turn, for comparison).

Configured as ``vllm_runner.py`` (vLLM's CPU installation page, for a wheel install): TCMalloc and
Intel OpenMP in ``LD_PRELOAD`` (``contenders.py``), a KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB (4
by default here), ``OMP_NUM_THREADS`` = the core count, the engine in this process,
``max_num_seqs`` = the trajectories; the ready line prints the settings as vLLM resolved them.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import turns_work  # noqa: E402
from common import serve  # noqa: E402
from vllm_runner import SETTINGS, effective_settings  # noqa: E402


def setup(spec: dict) -> dict:
  os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
  os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
  os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))  # else vLLM drops to 1 thread
  from vllm import LLM, SamplingParams
  from vllm.inputs import TokensPrompt

  work = turns_work.load(spec)
  prompts, replies = work["prompts"], work["replies"]
  turns, new = work["turns"], work["turn_tokens"]
  caching = os.environ.get("RFT_JAX_BENCH_PREFIX_CACHING", "1") != "0"
  llm = LLM(model=spec["checkpoint"], dtype="float32", seed=0,
            max_model_len=turns_work.longest(work), max_num_seqs=len(prompts),
            enable_prefix_caching=caching)
  SETTINGS.update(effective_settings(llm))
  SETTINGS["enable_prefix_caching"] = str(
      llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
  params = SamplingParams(n=1, temperature=spec["temperature"], top_p=1.0, top_k=-1,
                          max_tokens=new, min_tokens=new, ignore_eos=True, detokenize=False)

  def run(seed: int) -> int:
    # No per-request seed (see vllm_runner.py); the engine's seed is set once.
    if caching:
      llm.reset_prefix_cache()
    history = [list(p) for p in prompts]
    drawn = 0
    for turn in range(turns):
      outs = llm.generate([TokensPrompt(prompt_token_ids=h) for h in history], params,
                          use_tqdm=False)
      for i, out in enumerate(outs):
        tokens = list(out.outputs[0].token_ids)
        drawn += len(tokens)
        history[i] += tokens + (replies[i][turn] if turn < turns - 1 else [])
    return drawn

  return {"multi_turn": run}


if __name__ == "__main__":
  serve(setup, ("torch", "transformers", "vllm-cpu"), about=lambda: SETTINGS)
