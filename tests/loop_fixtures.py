"""A tiny random Qwen, its tokenizer and a synthetic dataset for short runs of the loop."""

import contextlib
import json
import shutil

from hf_fixtures import make_tiny_qwen, make_tiny_tokenizer

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
          "sampling.max_new_tokens=6", "learner.micro_batch_size=4", "learner.lr=1e-3",
          "learner.forecast_every=2", "rewards.num_workers=1", "mesh.data=4", "mesh.model=2",
          "eval.every=3", "eval.val_k=2", "progress=false", *extra]


@contextlib.contextmanager
def compilation_cache(path, min_compile_seconds=0.0):
  """JAX's persistent compilation cache in ``path`` while inside, for this process and for the
  trainers it starts with ``compilation_cache_dir=path``: a run that compiles programs an earlier
  run (in-process or not) compiled loads them instead. Programs that compiled in under
  ``min_compile_seconds`` are not kept (None: JAX's default threshold). Off again, and
  forgotten, on leaving."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache as cc

  threshold = jax.config.jax_persistent_cache_min_compile_time_secs
  cc.reset_cache()  # JAX opens its cache once per process, in the directory set at that time
  jax.config.update("jax_compilation_cache_dir", str(path))
  if min_compile_seconds is not None:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  try:
    yield str(path)
  finally:
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
    cc.reset_cache()
