"""``benchmarks/accelerator/longtail_peers.py`` end to end on CPU, tiny: every contender reports a
timed round with a positive tokens/s, or one failure line, and rft_jax's token counts respect
``--max-new`` and the stop rule."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "accelerator", "longtail_peers.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from accelerator.longtail_peers import CONTENDERS, check_rows  # noqa: E402

PROMPTS, N, MAX_NEW = 2, 2, 32
ROUND = re.compile(r"^\[(\w+)\] round 1: ([\d.]+) s, (\d+) tokens, (\d+) tokens/s; (\d+) rows, "
                   r"mean length \d+, longest (\d+); rows (.*)$", re.M)


def test_check_rows():
  stops = {2, 3}
  assert check_rows([[5, 6, 2], [7, 3], [5] * 4], stops, 4) == []
  assert check_rows([[5] * 5], stops, 4) == ["row 0: 5 tokens"]
  assert check_rows([[]], stops, 4) == ["row 0: 0 tokens"]
  assert check_rows([[2, 5]], stops, 4) == ["row 0: a stop id before its end"]
  assert check_rows([[5, 6]], stops, 4) == ["row 0: ends at 2 < max-new without a stop id"]


def test_longtail_peers_cpu(tmp_path):
  # The static path eager: its torch.compile on CPU alone takes ~30 s of 2 cores (it runs with
  # --hf-static-compile on, the default, too).
  proc = subprocess.run(
      [sys.executable, SCRIPT, "--device", "cpu", "--preset", "tiny", "--prompts", str(PROMPTS),
       "--n", str(N), "--max-new", str(MAX_NEW), "--rounds", "1", "--hf-static-compile", "off",
       "--timeout", "120", "--log-dir", str(tmp_path)],
      capture_output=True, text=True, timeout=300, cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  out = proc.stdout
  assert proc.returncode == 0, out + proc.stderr[-2000:]
  rounds = {m.group(1): m for m in ROUND.finditer(out)}
  for name in CONTENDERS:
    failures = re.findall(rf"^\[{name}\] failed: .+$", out, re.M)
    assert (name in rounds) != bool(failures), f"{name}: no round and no failure line\n{out}"
    assert len(failures) <= 1, out
    if name in rounds:
      assert int(rounds[name].group(4)) > 0 and float(rounds[name].group(2)) > 0, out
  for name in ("rft_jax", "rft_jax_paged"):  # rft_jax itself must run, within the rules
    assert name in rounds, out
    m = rounds[name]
    tokens, rows, longest = int(m.group(3)), int(m.group(5)), int(m.group(6))
    assert rows == PROMPTS * N, out
    assert rows <= tokens <= rows * MAX_NEW and longest <= MAX_NEW, out
    assert m.group(7) == "ok", out  # every row ends at a stop id or at max-new, no stop before
  assert "| rft_jax continuous |" in out, out
  if rounds.keys() & {"hf_cb", "hf_static"}:  # the ratio to the faster transformers path
    assert re.search(r"^ratio rft_jax continuous / transformers .*: [\d.]+x", out, re.M), out
