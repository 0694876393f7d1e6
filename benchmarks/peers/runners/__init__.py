"""The contenders of ``benchmarks/peers/peers.py``: the driver's helpers (spec, contenders,
report) and one runner script per contender (``*_runner.py``, run with that contender's
virtualenv)."""
