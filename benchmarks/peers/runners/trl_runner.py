"""TRL's ``GRPOTrainer`` as a contender of ``benchmarks/peers/peers.py`` (learner step, e2e step).

torch eager, float32, one thread per core, on the CPU. ``loss_type="dapo"`` (token-mean over
the batch, as rft_jax's ``token-mean``), clip 0.2, no KL (``beta=0``), AdamW at lr 1e-5 with
global-norm clipping at 1.0 (the Trainer's optimizer), gradient checkpointing off (TRL's default
is on: it only saves memory). TRL computes log p and the entropy of the completion positions
only.

learner: ``compute_loss`` on the saved batch (prompt / completion blocks; old log p = the
  forward's own, detached, as on a first update), backward, clip, optimizer step.
e2e: ``_generate_and_score_completions`` (transformers ``generate`` of 8 prompts x 4 samples,
  ``min_new_tokens = 128`` so that none stops early; the reward function; group advantages),
  then the same update: what one ``Trainer.train`` step does, without its data loader.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import load_batch, reward, serve, split_batch  # noqa: E402


def setup(spec: dict) -> dict:
  import torch
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, AutoTokenizer
  from trl import GRPOConfig, GRPOTrainer

  torch.set_num_threads(spec["threads"])
  tokenizer = AutoTokenizer.from_pretrained(spec["checkpoint"])
  model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32)
  vocab, group, new = spec["vocab_size"], spec["group_size"], spec["new_tokens"]
  texts = [" ".join(f"w{t}" for t in p) for p in spec["group_prompts"]]

  def reward_fn(completion_ids, **_):
    return [reward(c, vocab) for c in completion_ids]

  config = GRPOConfig(
      output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none",
      per_device_train_batch_size=group * len(texts), num_generations=group,
      max_completion_length=new, generation_kwargs={"min_new_tokens": new},
      temperature=spec["temperature"], top_p=1.0, top_k=0, learning_rate=spec["lr"],
      max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="dapo", num_iterations=1,
      steps_per_generation=1, gradient_accumulation_steps=1, save_strategy="no", max_steps=1000,
      lr_scheduler_type="constant", weight_decay=0.0, logging_steps=10**6,
      gradient_checkpointing=False)  # TRL turns it on by default: ~20% slower, only saves memory
  trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=config,
                        train_dataset=Dataset.from_dict({"prompt": texts}),
                        processing_class=tokenizer)
  trainer.create_optimizer_and_scheduler(num_training_steps=config.max_steps)
  trainer.current_gradient_accumulation_steps = 1  # what Trainer.train sets before its steps
  model = trainer.model
  model.train()
  arrays = split_batch(load_batch(spec["batch"]))
  batch = {k: torch.as_tensor(arrays[k]) for k in
           ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
  for key in ("prompt_ids", "completion_ids"):
    batch[key] = batch[key].long()
  batch["num_items_in_batch"] = batch["completion_mask"].sum()

  def update(inputs: dict) -> None:
    loss = trainer.compute_loss(model, inputs)
    trainer.accelerator.backward(loss)
    trainer.accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad()

  def learner(seed: int) -> None:
    update(batch)

  def e2e(seed: int) -> int:
    torch.manual_seed(seed)
    inputs = trainer._generate_and_score_completions(
        [{"prompt": t} for t in texts for _ in range(group)])
    update(inputs)
    return int(inputs["completion_mask"].sum())

  return {"learner": learner, "e2e": e2e}


if __name__ == "__main__":
  serve(setup, ("torch", "transformers", "trl"), about=lambda: {
      "torch threads": str(__import__("torch").get_num_threads())})
