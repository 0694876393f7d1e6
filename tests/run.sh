#!/usr/bin/env bash
# The test suite: creates ./.venv if needed, installs rft_jax[test], runs pytest.
# Extra arguments are passed to pytest (e.g. -k entropy).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/_venv.sh" test
cd "$ROOT"
exec python -m pytest -n "${RFT_JAX_TEST_WORKERS:-2}" --dist loadfile "$@"
