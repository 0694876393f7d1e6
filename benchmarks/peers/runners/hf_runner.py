"""transformers' ``generate`` as a contender of ``benchmarks/peers/peers.py`` (rollout only).

torch eager, float32, one thread per core, the 32 prompts left-padded into one batch, sampling
at temperature 1 with no top-k / top-p, ``min_new_tokens = max_new_tokens`` so that no row stops
early (EOS can never end a row). TCMalloc preloaded (``contenders.py``), as PyTorch's CPU
performance tuning guide recommends; the ready line prints torch's threads and the allocator.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import serve  # noqa: E402


def left_padded(prompts: list[list[int]]) -> tuple:
  """``[B, W]`` torch token ids and attention mask of ``prompts``, left-padded with 0 to the longest
  (also ``benchmarks/speed/sampler.py``'s transformers contender)."""
  import torch

  width = max(len(p) for p in prompts)
  ids = torch.zeros((len(prompts), width), dtype=torch.long)
  mask = torch.zeros_like(ids)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1
  return ids, mask


def setup(spec: dict) -> dict:
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(spec["threads"])
  model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32).eval()
  ids, mask = left_padded(spec["rollout_prompts"])
  width = ids.shape[1]
  new = spec["new_tokens"]
  kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=True, temperature=spec["temperature"],
                top_p=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)

  def rollout(seed: int) -> int:
    torch.manual_seed(seed)
    with torch.inference_mode():
      out = model.generate(**kwargs)
    return int((out.shape[1] - width) * out.shape[0])

  return {"rollout": rollout}


if __name__ == "__main__":
  serve(setup, ("torch", "transformers"), about=lambda: {
      "torch threads": str(__import__("torch").get_num_threads()),
      "torch interop threads": str(__import__("torch").get_num_interop_threads())})
