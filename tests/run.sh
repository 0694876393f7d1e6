#!/usr/bin/env bash
# The test suite: creates ./.venv if needed, installs rft_jax[test], runs pytest.
# Extra arguments are passed to pytest (e.g. -k entropy).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/_venv.sh" test
cd "$ROOT"
# tests/test_figures.py opens a page in Chromium: Debian's, driven by Playwright (whose own browser
# download needs a network these machines do not have).
if ! command -v chromium >/dev/null 2>&1; then
  echo "installing chromium (apt) for the browser test"
  apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } \
    || echo "could not install chromium (apt-get install chromium): tests/test_figures.py's browser test will fail" >&2
fi
# tests/test_sandbox.py runs model code in bubblewrap; without it those tests fail (they are not skipped).
if ! command -v bwrap >/dev/null 2>&1; then
  echo "installing bubblewrap (apt) for the sandbox tests"
  apt-get install -y -qq bubblewrap >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } \
    || echo "could not install bubblewrap (apt-get install bubblewrap): tests/test_sandbox.py will fail" >&2
fi
exec python -m pytest -n "${RFT_JAX_TEST_WORKERS:-2}" --dist loadfile "$@"
