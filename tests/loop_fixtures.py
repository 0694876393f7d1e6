"""A tiny random Qwen, its tokenizer and a synthetic dataset for short runs of the loop."""

import json
import shutil

from hf_fixtures import make_tiny_qwen, make_tiny_tokenizer
from rft_jax.train.compilation_cache import persistent_compilation_cache

QUESTIONS = ["what is 1+1 ?", "be brief", "what is ?", "1+1 ?", "what 1+1", "is 1+1 ?", "be what ?", "brief 1+1"]


def make_loop_files(root):
  """``(root, model_dir, data)``: a tiny Qwen3 with a tokenizer, and 8 questions in JSONL."""
  model_dir = make_tiny_qwen(root, "qwen3", vocab=128)
  for f in make_tiny_tokenizer(root).iterdir():
    shutil.copy(f, model_dir / f.name)
  data = root / "train.jsonl"
  data.write_text("".join(json.dumps({"question": q, "answer": str(i % 3)}) + "\n" for i, q in enumerate(QUESTIONS)))
  return root, model_dir, data


def overrides(setup, run_dir, steps, *extra):
  """Dotted overrides of a short run on :func:`make_loop_files`'s files (8 fake devices)."""
  root, model_dir, data = setup
  return [f"run_dir={run_dir}", f"steps={steps}", f"model.path={model_dir}", f"data.train_path={data}",
          "data.val_size=2", "data.prompts_per_step=2", "data.max_prompt_len=64", "sampling.n=4",
          "sampling.max_new_tokens=6", "learner.micro_batch_size=4", "learner.optim.lr=1e-3",
          "learner.forecast_every=2", "rewards.num_workers=1", "mesh.data=4", "mesh.model=2",
          "eval.every=3", "eval.val_k=2", "progress=false", *extra]


def compilation_cache(path, min_compile_seconds=0.0):
  """JAX's persistent compilation cache in ``path`` while inside, for this process and for the
  trainers it starts with ``compilation_cache_dir=path``: a run that compiles programs an earlier
  run (in-process or not) compiled loads them instead. Programs that compiled in under
  ``min_compile_seconds`` are not kept (None: JAX's default threshold)."""
  return persistent_compilation_cache(str(path), min_compile_seconds)
