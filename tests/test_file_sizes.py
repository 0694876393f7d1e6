"""No module of the package exceeds 400 lines (issue 53): a file that grows past it is split by
concern, as ``rft_jax/cli/`` (one module per command group) and ``rft_jax/rl/learner/`` were."""

from __future__ import annotations

from pathlib import Path

import rft_jax

ROOT = Path(rft_jax.__file__).parent
MAX_LINES = 400


def test_no_module_is_over_400_lines():
  sizes = {str(path.relative_to(ROOT.parent)): len(path.read_text().splitlines()) for path in ROOT.rglob("*.py")}
  assert len(sizes) > 100  # the walk found the package
  over = sorted((lines, path) for path, lines in sizes.items() if lines > MAX_LINES)
  assert not over, "split these by concern (at most 400 lines a module): " + ", ".join(
      f"{path} ({lines})" for lines, path in reversed(over))
