"""rft_jax: reinforcement fine-tuning of Qwen models in JAX, built around the entropy
dynamics of GRPO (arXiv 2602.03392).

Importing the package (``rft-jax``'s commands do it before anything else) keeps two start-up
messages of its dependencies off a machine that has no use for them:

* jax's probe for a TPU: where libtpu is installed (the ``tpu`` and ``test`` extras) but no TPU
  is attached, jax would load libtpu at its first computation, find no chip and print about six
  lines of libtpu's start-up (``E0000 ... INVALID_ARGUMENT: ... TPU_WORKER_HOSTNAMES ...``)
  before falling back to the CPU. There, when ``JAX_PLATFORMS`` is unset, no other PJRT plugin
  (jax's CUDA or ROCm plugin) is installed and jax is not imported yet, it sets
  ``JAX_PLATFORMS=cpu``, what jax would have chosen anyway. A TPU VM (a TPU chip on the PCI bus,
  as jax finds them, or ``/dev/accel*``, ``/dev/vfio/N``) is left alone, as is any
  ``JAX_PLATFORMS`` of the user's (``JAX_PLATFORMS=`` gives jax's own probing back) and
  ``JAX_FORCE_TPU_INIT``; ``rft-jax plan --topology v5p:...`` compiles for TPUs with libtpu as
  before (deviceless, beside the CPU backend).
* transformers' notice "PyTorch was not found. Models won't be available ...", printed when it is
  imported without torch: rft_jax uses its tokenizers, configs and file utilities, never its
  torch models (torch is a test-only dependency). Only that notice is dropped; every other
  transformers message is kept.
"""

import importlib.util
import logging
import os
import sys

__version__ = "0.1.0"

# Google's PCI vendor id and its TPU chips' device ids, those jax 0.10.2 counts as TPUs
# (jax/_src/hardware_utils.py, num_available_tpu_chips_and_device_id).
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return ""


def _tpu_attached() -> bool:
  """Whether a TPU may be attached: a TPU chip on the PCI bus (jax's rule), or the device files
  TPU VMs expose their chips through."""
  import glob

  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    if (_read(vendor) == _GOOGLE_PCI_VENDOR
        and _read(os.path.join(os.path.dirname(vendor), "device")) in _TPU_PCI_DEVICES):
      return True
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _other_pjrt_plugin() -> bool:
  """Whether jax would load a PJRT plugin besides libtpu (a GPU's), found where jax looks: the
  ``jax_plugins`` namespace, the ``jax_plugins`` entry points, ``PJRT_NAMES_AND_LIBRARY_PATHS``."""
  if os.environ.get("PJRT_NAMES_AND_LIBRARY_PATHS") or importlib.util.find_spec("jax_plugins"):
    return True
  from importlib.metadata import entry_points

  return bool(entry_points(group="jax_plugins"))


def _skip_tpu_probe_without_a_tpu() -> None:
  """``JAX_PLATFORMS=cpu`` where jax would probe libtpu for a TPU that is not there (above)."""
  if "JAX_PLATFORMS" in os.environ or "JAX_FORCE_TPU_INIT" in os.environ or "jax" in sys.modules:
    return  # the user's choice, or jax already read its configuration
  if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
    return  # nothing to probe: jax finds no libtpu and says nothing
  if _tpu_attached() or _other_pjrt_plugin():
    return
  os.environ["JAX_PLATFORMS"] = "cpu"


def _not_the_torch_notice(record: logging.LogRecord) -> bool:
  """False for transformers' import-time notice that torch is missing (above)."""
  return not str(record.msg).startswith("PyTorch was not found.")


_skip_tpu_probe_without_a_tpu()
# The notice is logged on transformers' root logger itself, whose filters see it (a filter of a
# logger applies to the records logged on it, not to its children's).
logging.getLogger("transformers").addFilter(_not_the_torch_notice)
