"""How far one learner step moves the demo policy, by advantage sign.

Samples one demo batch (16 prompts x 8 completions) from the shipped checkpoint, takes one
learner step, and prints the mean change of the completions' log-likelihood for A > 0, A < 0
and A = 0, and its correlation with A. Any config override is accepted:

    python benchmarks/analysis/demo_step_direction.py learner.optim.lr=3e-4
    python benchmarks/analysis/demo_step_direction.py learner.optim.lr=3e-5
"""

from __future__ import annotations

import sys
import tempfile

import numpy as np

from rft_jax.demo.run import build_demo_run
from rft_jax.train import loop


def main(overrides: list[str]) -> None:
  with tempfile.TemporaryDirectory() as root:
    cfg, run, state = build_demo_run(root, overrides)
    rollouts = loop.step_rollouts(run, state, step=1)
    batch, rewards, adv = rollouts.batch, rollouts.rewards, rollouts.batch.advantages
    response = batch.response_mask[:, 1:] * batch.attention_mask[:, 1:]

    def sequence_logp(state):
      stats = run.learner.batch_stats(state.params, run.learner.place_batch(batch))
      return (np.asarray(stats.logp) * response).sum(1)

    before = sequence_logp(state)
    state, _ = run.learner.step(state, batch)
    change = sequence_logp(state) - before
  live = adv != 0
  print(f"lr {cfg.learner.optim.lr:g}: reward mean {rewards.mean():.3f}, {live.sum()} of {len(adv)} "
        f"completions with A != 0")
  print(f"mean change of sequence log-likelihood: A > 0 {change[adv > 0].mean():+.3f}, "
        f"A < 0 {change[adv < 0].mean():+.3f}, A = 0 {change[~live].mean():+.3f} nats; "
        f"corr(change, A) over A != 0: {np.corrcoef(change[live], adv[live])[0, 1]:.2f}")


if __name__ == "__main__":
  main(sys.argv[1:])
