"""One process of the multi-process test (``tests/test_multihost.py``), or its one-process reference.

:func:`run` builds the tiny random Qwen of ``test_learner`` on a ``data=2 x model=4`` mesh over
all devices, samples with :func:`rft_jax.sampling.generate` (and again on a paged KV cache), and
takes one learner step on the rollouts, then checkpoints and restores the state. Run as a script
(``python multihost_worker.py OUT.npz CHECKPOINT_DIR``) it first joins the processes named by
``RFT_JAX_COORDINATOR`` / ``RFT_JAX_NUM_PROCESSES`` / ``RFT_JAX_PROCESS_ID``
(:func:`rft_jax.parallel.multihost.initialize_from_env`; without them it runs alone) and saves
what :func:`run` returns.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

PROMPTS = [[5, 17, 9, 33, 61, 2, 40], [8, 3], [12, 19, 44, 7, 7], [51]]
GROUP = 4  # completions per prompt


def run(checkpoint_dir: str) -> dict[str, np.ndarray]:
  """Rollouts, learner metrics (``metric/<name>``) and updated parameters (``param/<path>``).

  Every process returns the same full values; ``spans_processes`` says whether the parameters
  had shards on other processes' devices. The updated state is also checkpointed into
  ``checkpoint_dir`` (orbax, every process taking part) and restored:
  ``restored_equal`` says whether every restored array equals the saved one.
  """
  import jax
  from flax import nnx

  from rft_jax.parallel import host_array, make_mesh, shard_model
  from rft_jax.rl.learner import Learner, learner_batch
  from rft_jax.sampling import SamplingParams, generate
  from rft_jax.train.checkpoint import RunCheckpointer
  from test_learner import config

  mesh = make_mesh(data=2, model=4)
  model = shard_model(tiny_random_model(seed=3), mesh)
  params = SamplingParams(n=GROUP, temperature=1.0, max_new_tokens=8)
  rollouts = generate(model, PROMPTS, params, seed=7, mesh=mesh)
  # The paged pool (the paper's configs): one pool per data shard, here one per process.
  paged = generate(model, PROMPTS, dataclasses.replace(params, kv_pages=16, page_size=4),
                   seed=7, mesh=mesh)

  # Reward: the fraction of even tokens in the completion; GRPO advantages per prompt.
  m = rollouts.completion_ids.shape[1]
  live = np.arange(m)[None] < rollouts.completion_lengths[:, None]
  reward = ((rollouts.completion_ids % 2 == 0) & live).sum(1) / rollouts.completion_lengths
  groups = reward.reshape(-1, GROUP)
  advantages = ((groups - groups.mean(1, keepdims=True))
                / (groups.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1).astype(np.float32)
  batch = learner_batch(rollouts, advantages=advantages)

  learner = Learner(model, config(micro_batch_size=4, forecast_every=0), mesh=mesh)
  state = learner.init(model)
  spans = any(not x.is_fully_addressable for x in jax.tree.leaves(state.params))
  state, metrics = learner.step(state, batch)
  checkpointer = RunCheckpointer(checkpoint_dir)
  checkpointer.save(1, state, {"data": {"epoch": 0}})
  checkpointer.wait()
  restored, meta, step = checkpointer.restore(state)  # the template gives shapes and shardings
  checkpointer.close()
  same = jax.tree.map(lambda a, b: bool(np.array_equal(host_array(a), host_array(b))),
                      restored, state)
  out = {"restored_equal": np.asarray(all(jax.tree.leaves(same)) and step == 1
                                      and meta == {"data": {"epoch": 0}}),
         "completion_ids": rollouts.completion_ids,
         "completion_lengths": rollouts.completion_lengths, "logprobs": rollouts.logprobs,
         "paged/completion_ids": paged.completion_ids, "paged/logprobs": paged.logprobs,
         "paged/evictions": np.asarray(paged.evictions),
         "spans_processes": np.asarray(spans),
         "process_count": np.asarray(jax.process_count())}
  out.update({f"metric/{k}": np.asarray(v) for k, v in metrics.items()})
  for path, x in nnx.to_flat_state(state.params):
    out["param/" + ".".join(map(str, path))] = host_array(x.get_value())
  return out


def tiny_random_model(seed: int):
  """``test_learner.tiny_model``'s architecture with seeded numpy weights, on the host.

  Drawing the weights with numpy skips the per-op initialisation (many seconds per process on
  a loaded CPU) and gives bit-identical values in every process.
  """
  from flax import nnx

  from test_learner import tiny_model

  graphdef, state = nnx.split(nnx.eval_shape(lambda: tiny_model()))
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(state):
    shape, dtype = var.get_value().shape, var.get_value().dtype
    scale = rng.normal(1.0, 0.1, shape) if path[-1] == "scale" else rng.normal(0.0, 0.3, shape)
    var.set_value(scale.astype(dtype))
  return nnx.merge(graphdef, state)


def main(out_path: str, checkpoint_dir: str) -> None:
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process CPU collectives
  from rft_jax.parallel.multihost import initialize_from_env

  joined = initialize_from_env()  # without the variables: one process on its own devices
  np.savez(out_path, **run(checkpoint_dir))
  if joined:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
