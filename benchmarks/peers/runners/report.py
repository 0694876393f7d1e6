"""The tables of ``benchmarks/peers/peers.py``: seconds per contender, then ratios to rft_jax."""

from __future__ import annotations

import statistics

from peers.runners.contenders import CONTENDERS, DECODE_WORKS

WORKS = ("rollout", "learner", "e2e", "longtail_128", "longtail_512", *DECODE_WORKS)
ROLLOUT_WORKS = ("rollout", "longtail_128", "longtail_512", *DECODE_WORKS)


def per_token(runs: list, work: str) -> list[float]:
  """Seconds per run; per generated token for rollouts (contenders may stop rows early, and
  long-tailed rollouts draw their lengths)."""
  return [s / t if work in ROLLOUT_WORKS and t else s for s, t in runs]


def print_details(model: str, results: dict) -> None:
  print(f"\n{model}: seconds per run (median, min-max); the first call (compile) apart, the second "
        f"(warm-up) left out; rollouts also tokens/s")
  print("| work | contender | median s | min-max s | tokens/s | first call s | runs |")
  print("|---|---|---|---|---|---|---|")
  order = sorted(results.items(), key=lambda x: (WORKS.index(x[0][1]), x[0][0] != "rft_jax"))
  for (name, work), r in order:
    label = CONTENDERS[name].label
    if not r["runs"]:
      print(f"| {work} | {label} | — | — | — | — | unavailable: {r['error']} |")
      continue
    times = [s for s, _ in r["runs"]]
    tokens = r["runs"][0][1]
    rate = f"{tokens / statistics.median(times):.0f}" if tokens else ""
    first = f"{r['first']:.2f}" if r.get("first") is not None else "?"
    note = f"; then failed: {r['error']}" if r["error"] else ""
    print(f"| {work} | {label} | {statistics.median(times):.3f} | {min(times):.3f}-{max(times):.3f}"
          f" | {rate} | {first} | {len(times)}{note} |")


def ratio(results: dict, peer: str, work: str, best: bool = False) -> str:
  """``median x (min-max)`` of the per-round ratios peer / rft_jax, or why there is none; with
  ``best``, the ratio of the two fastest runs (what other work on the machine disturbs least)."""
  ours, theirs = results.get(("rft_jax", work)), results.get((peer, work))
  if theirs is None:
    return "—"
  if not theirs["runs"]:
    return "n/a*"
  if not ours or not ours["runs"]:
    return "no rft_jax run"
  peer_times, our_times = per_token(theirs["runs"], work), per_token(ours["runs"], work)
  if best:
    return f"{min(peer_times) / min(our_times):.2f}x"
  rounds = [p / o for p, o in zip(peer_times, our_times)]
  med = statistics.median(rounds)
  return f"{med:.2f}x ({min(rounds):.2f}-{max(rounds):.2f})"


def print_ratios(results: dict, models: list[str], peers: list[str], works: list[str]) -> None:
  for best in (False, True):
    what = ("fastest peer run / fastest rft_jax run" if best else
            "peer time / rft_jax time, median (min-max) of the rounds")
    print(f"\nratio = {what} (>1: rft_jax is faster); cells: {' / '.join(models)}")
    print("| work | " + " | ".join(CONTENDERS[p].label for p in peers) + " |")
    print("|---|" + "---|" * len(peers))
    for work in works:
      cells = [" / ".join(ratio(results[m], p, work, best) for m in models) for p in peers]
      if all(set(c.split(" / ")) == {"—"} for c in cells):
        continue
      print(f"| {work}, {' / '.join(models)} | " + " | ".join(cells) + " |")
  reasons = {(p, r["error"]) for m in models for (p, w), r in results[m].items()
             if p != "rft_jax" and not r["runs"] and r["error"]}
  for p, reason in sorted(reasons):
    print(f"* {CONTENDERS[p].label}: {reason}")
