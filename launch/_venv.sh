# Sourced by the set-up scripts: make sure ./.venv exists and holds rft_jax with the
# given extras, reinstalling only when pyproject.toml (or the extras) changed.
# Usage: source launch/_venv.sh EXTRAS     e.g.  source launch/_venv.sh test;  source launch/_venv.sh ""
# Always pass EXTRAS ("" for none): sourced without arguments, this script sees the caller's own
# arguments as its $1 and would install them as extras.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RFT_JAX_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "rft_jax needs Python >= 3.11; '$PYTHON' is $("$PYTHON" --version 2>&1)" >&2
  exit 1
fi
# A fresh install (jax, torch's CPU build, transformers, ...) takes about 3.2 GiB: with less free,
# say so in one line now rather than let pip fail half way with "No space left on device".
NEED_GIB="${RFT_JAX_VENV_MIN_FREE_GIB:-4}"
if [ ! -f "$VENV/.rft_jax_installed" ]; then
  PARENT="$(dirname "$VENV")"
  mkdir -p "$PARENT"
  FREE_KIB="$(df -Pk "$PARENT" | awk 'NR == 2 {print $4}')"
  if [ "$FREE_KIB" -lt $((NEED_GIB * 1024 * 1024)) ]; then
    echo "not enough disk for $VENV: $((FREE_KIB / 1024)) MiB free on $(df -P "$PARENT" | awk 'NR == 2 {print $6}'), installing rft_jax needs about ${NEED_GIB} GiB (RFT_JAX_VENV_MIN_FREE_GIB)" >&2
    exit 1
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating virtual environment in $VENV"
  "$PYTHON" -m venv "$VENV"
fi
SPEC="."
[ -n "$EXTRAS" ] && SPEC=".[$EXTRAS]"
STAMP="$VENV/.rft_jax_installed"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16) $EXTRAS"
if [ ! -f "$STAMP" ] || ! grep -qxF "$WANT" "$STAMP"; then
  echo "installing rft_jax$([ -n "$EXTRAS" ] && echo "[$EXTRAS]") into $VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  (cd "$ROOT" && "$VENV/bin/python" -m pip install --quiet -e "$SPEC")
  echo "$WANT" >> "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
