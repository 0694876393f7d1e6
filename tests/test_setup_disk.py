"""The set-up scripts on a disk too full for the virtual environment: one line that names the
venv, the free space and the need, and nothing created or installed (CI once ran out of disk
half way through pip, which said only "No space left on device")."""

import hashlib
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_venv(tmp_path, min_free_gib):
  env = dict(os.environ, RFT_JAX_VENV=str(tmp_path / "venv"),
             RFT_JAX_VENV_MIN_FREE_GIB=str(min_free_gib))
  return subprocess.run(["bash", "-c", f"source {ROOT}/launch/_venv.sh test && echo sourced"],
                        env=env, capture_output=True, text=True, timeout=60)


def test_too_little_disk_stops_before_the_install_with_one_line(tmp_path):
  done = _source_venv(tmp_path, 10**9)       # more than any disk has free
  assert done.returncode == 1
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1, done.stderr
  assert str(tmp_path / "venv") in lines[0] and "MiB free" in lines[0]
  assert "1000000000 GiB" in lines[0]
  assert not (tmp_path / "venv").exists()
  assert "sourced" not in done.stdout


def test_an_installed_venv_is_not_held_back_by_the_check(tmp_path):
  venv = tmp_path / "venv"
  os.makedirs(venv / "bin")
  os.symlink(subprocess.check_output(["bash", "-c", "command -v python3"], text=True).strip(),
             venv / "bin" / "python")
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    want = hashlib.sha256(f.read()).hexdigest()[:16] + " test"
  (venv / ".rft_jax_installed").write_text(want + "\n")
  done = _source_venv(tmp_path, 10**9)
  assert done.returncode == 0, done.stderr
  assert "sourced" in done.stdout and "not enough disk" not in done.stderr


def _fake_venv(tmp_path):
  """An installed venv (its stamp names no extras) whose ``python`` answers every check with
  success and whose ``rft-jax`` prints its arguments: what the launch scripts run, without jax."""
  venv = tmp_path / "venv"
  os.makedirs(venv / "bin")
  (venv / "bin" / "python").write_text("#!/bin/sh\necho \"python $*\" >&2\nexit 0\n")
  (venv / "bin" / "rft-jax").write_text("#!/bin/sh\necho \"rft-jax $*\"\n")
  for name in ("python", "rft-jax"):
    os.chmod(venv / "bin" / name, 0o755)
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    (venv / ".rft_jax_installed").write_text(hashlib.sha256(f.read()).hexdigest()[:16] + " \n")
  return venv


def test_the_launch_scripts_pass_their_arguments_to_the_command_not_to_pip(tmp_path):
  """``bash launch/local.sh steps=2`` once tried to install ``rft_jax[steps=2]``: sourced without
  arguments, ``_venv.sh`` read the script's own arguments as the extras."""
  env = dict(os.environ, RFT_JAX_VENV=str(_fake_venv(tmp_path)))
  for script, args, command in (("local.sh", ["steps=2", "variants=grpo"], "rft-jax demo steps=2 variants=grpo"),
                                ("gpu_host.sh", ["c.yaml", "steps=2"], "rft-jax train --config c.yaml steps=2")):
    done = subprocess.run(["bash", os.path.join(ROOT, "launch", script), *args], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert command in done.stdout.splitlines(), done.stdout
    assert "installing" not in done.stdout + done.stderr and "pip" not in done.stderr, done.stderr
