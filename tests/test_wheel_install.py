"""rft_jax installed as users install it (a wheel, not the repository), and a quiet start.

* The wheel, built offline from a copy of the package's sources (no ``configs/``, no tests),
  holds the demo's config and checkpoint; installed with ``pip install --target``, its
  ``rft-jax`` runs from an empty directory: ``demo --help`` names the installed config, the
  demo's paths resolve inside the installed package and its checkpoint and tokenizer load, and
  ``verify`` passes.
* transformers imported by rft_jax without torch prints no "PyTorch was not found" notice (and
  its other messages still show).
* A JAX command of rft_jax on a machine without a TPU prints none of libtpu's probing lines,
  although the test extra installs libtpu.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import rft_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What libtpu prints when jax probes it for a TPU that is not there (about six lines: "Failed to
# find host bounds for accelerator type", "E0000 ... INVALID_ARGUMENT: ... TPU_WORKER_HOSTNAMES").
TPU_NOISE = re.compile(r"tpu|INVALID_ARGUMENT|InitGoogle", re.IGNORECASE)
TORCH_NOTICE = "PyTorch was not found"


def _env(**extra: str) -> dict[str, str]:
  """The suite's environment without the settings these checks are about (tests/conftest.py
  sets JAX_PLATFORMS=cpu), nor a PYTHONPATH of its own."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "PYTHONPATH", "TRANSFORMERS_NO_ADVISORY_WARNINGS",
                      "TRANSFORMERS_VERBOSITY")}
  env.update(extra)
  return env


def _run(args: list[str], cwd, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """(wheel, target, empty directory): the wheel built from a copy of the sources with the
  environment's setuptools (no build isolation, no index: offline) and installed into ``target``
  without dependencies (the environment has them)."""
  base = tmp_path_factory.mktemp("wheel")
  src = base / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(ROOT, name), src / name)
  shutil.copytree(os.path.join(ROOT, "rft_jax"), src / "rft_jax",
                  ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info"))
  wheels, target, empty = base / "wheels", base / "target", base / "empty"
  empty.mkdir()
  pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
  built = _run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index",
                "-w", str(wheels)], cwd=base, env=_env(), timeout=180)
  assert built.returncode == 0, built.stdout + built.stderr
  (wheel,) = wheels.glob("rft_jax-*.whl")
  done = _run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
              cwd=base, env=_env(), timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr
  return wheel, target, empty


def test_the_wheel_holds_the_package_data(installed):
  wheel, _, _ = installed
  names = set(zipfile.ZipFile(wheel).namelist())
  for name in ("rft_jax/configs/demo.yaml", "rft_jax/demo/checkpoint/config.json",
               "rft_jax/demo/checkpoint/model.safetensors", "rft_jax/demo/checkpoint/tokenizer.json",
               "rft_jax/demo/checkpoint/tokenizer_config.json", "rft_jax/models/decode/cpu_attention.cc"):
    assert name in names, name
  assert any(n.startswith("rft_jax/plan/gpu_specs/") and n.endswith(".txtpb") for n in names)
  checkpoint = os.path.join(ROOT, "rft_jax", "demo", "checkpoint")
  assert {f"rft_jax/demo/checkpoint/{f}" for f in os.listdir(checkpoint)} <= names
  assert not any(n.startswith(("tests/", "configs/", "benchmarks/")) for n in names)


def test_the_installed_cli_runs_from_an_empty_directory(installed):
  """``rft-jax`` of the wheel (its console script, on the installed copy): the package is the
  installed one, ``demo --help`` names its config, the demo's config and checkpoint are found
  inside it and load, and ``verify`` passes, with no TPU probing on the way."""
  _, target, empty = installed
  env = _env(PYTHONPATH=str(target))
  check = ("import os, rft_jax, rft_jax.cli\n"
           "from rft_jax.demo.paths import DEFAULT_CONFIG, load_demo_config\n"
           "from rft_jax.models import load_hf, load_tokenizer\n"
           "cfg = load_demo_config()\n"
           "load_hf(cfg.model.path), load_tokenizer(cfg.model.path)\n"
           "print(rft_jax.__file__, rft_jax.cli.__file__, DEFAULT_CONFIG, cfg.model.path, cfg.run_dir, sep='\\n')\n")
  done = _run([sys.executable, "-c", check], cwd=empty, env=env)
  assert done.returncode == 0, done.stderr
  package, cli, config, model, run_dir = done.stdout.split("\n")[-6:-1]
  inside = os.path.join(str(target), "rft_jax") + os.sep
  for path in (package, cli, config, model):
    assert path.startswith(inside), (path, str(target))  # the installed copy, not the repository
  assert config == inside + os.path.join("configs", "demo.yaml")
  assert model == inside + os.path.join("demo", "checkpoint")
  assert run_dir == os.path.join(str(empty), "runs", "demo")  # outputs go where it runs

  script = os.path.join(str(target), "bin", "rft-jax")
  assert os.path.isfile(script)
  helped = _run([sys.executable, script, "demo", "--help"], cwd=empty, env=env)
  assert helped.returncode == 0, helped.stderr
  # help lines wrap, a long path anywhere
  assert f"(default:{config})" in "".join(helped.stdout.split()), helped.stdout
  verified = _run([sys.executable, script, "verify", "--cases", "8", "--vocab", "16"], cwd=empty, env=env)
  assert verified.returncode == 0, verified.stdout + verified.stderr
  assert "all statistics finite on extreme logits: yes" in verified.stdout
  assert " NO" not in verified.stdout
  if not (rft_jax._tpu_attached() or rft_jax._other_pjrt_plugin()):  # else jax's own choice
    assert not TPU_NOISE.search(verified.stderr), verified.stderr
  assert os.listdir(empty) == []  # verify writes nothing


def test_the_repositorys_demo_config_is_the_packages():
  """One source of truth: the repository's configs/demo.yaml is the package's file (a link)."""
  from rft_jax.demo.paths import DEFAULT_CONFIG

  assert os.path.samefile(os.path.join(ROOT, "configs", "demo.yaml"), DEFAULT_CONFIG)


def test_no_torch_notice_without_torch(tmp_path):
  """With torch unimportable, transformers loaded through rft_jax (the demo's tokenizer) says
  nothing of it; transformers' other warnings still show. The same import without rft_jax
  prints the notice (the check would see it)."""
  no_torch = "import sys; sys.modules['torch'] = None\n"
  checkpoint = os.path.join(ROOT, "rft_jax", "demo", "checkpoint")
  code = (no_torch + "from rft_jax.models import load_tokenizer\n"
          f"load_tokenizer({checkpoint!r})\n"
          "from transformers.utils import logging\n"
          "logging.get_logger('transformers').warning('another transformers warning')\n")
  done = _run([sys.executable, "-c", code], cwd=tmp_path, env=_env())
  assert done.returncode == 0, done.stderr
  assert TORCH_NOTICE not in done.stderr, done.stderr
  assert "another transformers warning" in done.stderr
  bare = _run([sys.executable, "-c", no_torch + "import transformers"], cwd=tmp_path, env=_env())
  assert TORCH_NOTICE in bare.stderr, bare.stderr


def test_no_tpu_probing_without_a_tpu(tmp_path):
  """``rft-jax verify`` (jax's CPU backend, float64) prints none of libtpu's lines on a machine
  without a TPU, libtpu installed or not; ``JAX_PLATFORMS=`` gives jax's own probing back (where
  libtpu is installed, its lines then show: the check would see them)."""
  if rft_jax._tpu_attached() or rft_jax._other_pjrt_plugin():
    pytest.skip("a TPU or another PJRT plugin is here: jax's own choice of platforms is kept")
  done = _run([sys.executable, "-m", "rft_jax.cli", "verify", "--cases", "4", "--vocab", "8"],
              cwd=tmp_path, env=_env())
  assert done.returncode == 0, done.stdout + done.stderr
  assert not TPU_NOISE.search(done.stderr), done.stderr
  assert "all statistics finite on extreme logits: yes" in done.stdout
  if importlib.util.find_spec("libtpu") is not None:
    probed = _run([sys.executable, "-c", "import rft_jax, jax; print(jax.devices())"], cwd=tmp_path,
                  env=_env(JAX_PLATFORMS=""))
    assert probed.returncode == 0, probed.stderr
    assert "CpuDevice" in probed.stdout and TPU_NOISE.search(probed.stderr), probed.stderr
