"""``python -m rft_jax.cli``: the ``rft-jax`` command."""

import sys

from rft_jax.cli.entry import main

if __name__ == "__main__":
  sys.exit(main())
