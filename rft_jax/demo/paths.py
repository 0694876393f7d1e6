"""Where the demo's files are, so that ``rft-jax demo`` runs from any working directory and
from any install (a checkout, an editable install or a wheel).

One rule: the demo's config and checkpoint are package data, ``rft_jax/configs/demo.yaml``
(:data:`DEFAULT_CONFIG`; the repository's ``configs/demo.yaml`` is a link to it) and
``rft_jax/demo/checkpoint``, and a relative ``model.path`` of the config file is read against
:data:`REPO_ROOT`, the directory that holds the ``rft_jax`` package: the repository root in a
checkout, ``site-packages`` (or the ``--target`` directory) in an install. The config's
``model.path: rft_jax/demo/checkpoint`` is therefore the package's checkpoint in both. The
outputs go where the user runs the demo: ``run_dir`` (and any path given on the command line)
is relative to the current directory, and the training data and the compilation cache are kept
under the run directory.
"""

from __future__ import annotations

import os
from typing import Sequence

# The directory holding the rft_jax package (the repository root in a checkout).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The shipped config (package data; configs/demo.yaml in the repository links to it).
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "rft_jax", "configs", "demo.yaml")
# The demo's mixture-of-experts checkpoint (package data, rebuilt by `python -m rft_jax.demo.build_moe`),
# which the demo's moe_* variants train (rft_jax/demo/methods.py).
MOE_CHECKPOINT = os.path.join(REPO_ROOT, "rft_jax", "demo", "moe_checkpoint")


def overridden(overrides: Sequence[str], key: str) -> bool:
  """Whether a dotted override (``key=value``) sets ``key``."""
  return any(o.partition("=")[0].strip() == key for o in overrides)


def load_demo_config(config_path: str | None = None, overrides: Sequence[str] = ()):
  """The demo's config (:func:`rft_jax.train.config.load_config` of ``config_path``, default
  :data:`DEFAULT_CONFIG`, and ``overrides``), with:

  * a relative ``model.path`` of the config file read against :data:`REPO_ROOT` (one given as
    an override is relative to the current directory, as everywhere);
  * the compilation cache in ``RUN_DIR/.jax_cache``, or in JAX's ``JAX_COMPILATION_CACHE_DIR``
    where set (:func:`~rft_jax.train.compilation_cache.run_cache_dir`; the file's
    ``compilation_cache_dir`` is ignored; an override ``compilation_cache_dir=...`` is kept,
    ``compilation_cache_dir=`` for none).
  """
  from omegaconf import OmegaConf

  from rft_jax.train.compilation_cache import run_cache_dir
  from rft_jax.train.config import absolute_path, load_config

  path = config_path or DEFAULT_CONFIG
  cfg = load_config(path, overrides)
  file_model_path = OmegaConf.select(OmegaConf.load(path), "model.path", default="")
  if not overridden(overrides, "model.path") and file_model_path and not os.path.isabs(
      os.path.expanduser(file_model_path)):
    cfg.model.path = os.path.join(REPO_ROOT, file_model_path)
  if not overridden(overrides, "compilation_cache_dir"):
    # the demo run's cache, set explicitly: the variants, in their own run directories, share it
    cfg.compilation_cache_dir = absolute_path(run_cache_dir(cfg.run_dir, None))
  return cfg
