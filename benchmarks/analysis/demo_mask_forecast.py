"""Which tokens the entropy masks remove on demo batches, and how much of the forecast
entropy decrease goes with them.

Samples ``--batches`` demo batches from the shipped checkpoint and, per response token,
takes the learner's pre-update statistics. By Theorem 2 a GRPO step changes the entropy at
a position by about ``-eta A (S_* - E_p[S])`` (Corollary 4 sums it over the batch), so the
sum over the tokens a mask removes is the part of the first-order entropy change that the
mask takes out of the update. Prints, for Clip_B (cut on ``S_*``) and Clip_V (cut on
``S_* - E_p[S]``) on negative samples at several ``mu-``: the masked share of the tokens and
the forecast change (per token, in units of the learning rate) before and after masking.

    python benchmarks/analysis/demo_mask_forecast.py [--batches 3] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np

from rft_jax.demo.run import build_demo_run
from rft_jax.entropy import clip_b_mask, clip_v_mask
from rft_jax.train import loop


def demo_token_stats(overrides: list[str], batches: int) -> dict[str, np.ndarray]:
  """Per response token of ``batches`` demo batches: ``s_star``, ``centered``, ``advantage``
  (each ``[batches, B, L - 1]``) and the response ``mask``."""
  with tempfile.TemporaryDirectory() as root:
    cfg, run, state = build_demo_run(root, overrides)
    out = {"s_star": [], "centered": [], "advantage": [], "mask": []}
    for step in range(batches):
      batch = loop.step_rollouts(run, state, step).batch
      stats = run.learner.batch_stats(state.params, run.learner.place_batch(batch))
      mask = batch.response_mask[:, 1:] * batch.attention_mask[:, 1:]
      out["s_star"].append(np.asarray(stats.s_star))
      out["centered"].append(np.asarray(stats.centered))
      out["advantage"].append(np.broadcast_to(batch.advantages[:, None], mask.shape))
      out["mask"].append(mask > 0)
  width = max(x.shape[1] for x in out["mask"])  # batches may differ in prompt width
  return {k: np.stack([np.pad(x, ((0, 0), (width - x.shape[1], 0))) for x in v]) for k, v in out.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, default=3)
  args, overrides = parser.parse_known_args()
  t = demo_token_stats(overrides, args.batches)
  valid = t["mask"]
  # -A (S_* - E_p[S]): each token's first-order entropy change per unit learning rate.
  change = np.where(valid, -t["advantage"] * t["centered"], 0.0)
  count = valid.sum()
  print(f"{args.batches} batches, {count} response tokens; forecast entropy change per token "
        f"(x lr) with no mask: {change.sum() / count:+.5f}")
  print(f"{'mask':<8} {'mu-':>5} {'masked %':>9} {'removed':>9} {'left':>9}")
  for kind, cut, field in (("clip_b", clip_b_mask, "s_star"), ("clip_v", clip_v_mask, "centered")):
    for mu in ((2.5, 1.5, 1.0) if kind == "clip_b" else (8.5, 3.0, 2.0)):
      extra = {"max_frac": None} if kind == "clip_v" else {}
      keep = np.stack([np.asarray(cut(x, a, m, mu_low=mu, **extra))
                       for x, a, m in zip(t[field], t["advantage"], valid)])
      masked = valid & ~keep
      print(f"{kind:<8} {mu:>5} {100 * masked.sum() / count:>9.2f} {change[masked].sum() / count:>+9.5f} "
            f"{change[valid & keep].sum() / count:>+9.5f}")


if __name__ == "__main__":
  main()
