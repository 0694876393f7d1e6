"""The ``rft-jax`` command line: one subcommand per job.

Each subcommand lives in its own small function; heavy imports happen inside them so
that ``rft-jax --help`` is instant.
"""

from __future__ import annotations

import argparse
import sys

# Bounds the identities must meet in float64 (``rft-jax verify`` fails above them).
VERIFY_TOLERANCES = {
    "lemma1": 1e-12,
    "theorem1": 1e-12,
    "theorem2": 1e-12,
    "second_order": 0.05,
    "corollary1": 1e-12,
    "corollary1_1": 1e-12,
    "corollary3": 1e-12,
}


def _verify(args: argparse.Namespace) -> int:
  from rft_jax.entropy.identities import identity_errors

  errors = identity_errors(seed=args.seed, num_cases=args.cases, vocab_size=args.vocab)
  print(f"Entropy-dynamics identities, float64, {2 * args.cases} positions x {args.vocab} vocab")
  print(f"{'identity':<14} {'worst error':>12} {'bound':>9}  ok")
  finite = errors.pop("all_finite") == 1.0
  ok = finite
  for name, bound in VERIFY_TOLERANCES.items():
    passed = errors[name] <= bound
    ok &= passed
    print(f"{name:<14} {errors[name]:>12.3e} {bound:>9.0e}  {'yes' if passed else 'NO'}")
  print("all statistics finite on extreme logits:", "yes" if finite else "NO")
  return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="rft-jax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)

  verify = sub.add_parser("verify", help="check Theorems 1-2 and Corollaries 1-3 numerically")
  verify.add_argument("--seed", type=int, default=0)
  verify.add_argument("--cases", type=int, default=256, help="random positions per kind")
  verify.add_argument("--vocab", type=int, default=64, help="vocabulary size")
  verify.set_defaults(func=_verify)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
