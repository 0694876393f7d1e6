"""Reading and writing (sharded) safetensors checkpoints, one tensor at a time.

A Hugging Face checkpoint directory holds either ``model.safetensors``, or shards listed in
``model.safetensors.index.json`` (``{"weight_map": {name: file}}``). A safetensors file is an
8-byte little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``, then
the raw bytes. Tensors are read with plain positioned reads into a fresh array, not through a
memory map: pages of a mapped multi-GB shard would otherwise count in the resident set while
the shard is open.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from rft_jax.models.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2,
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor lies in its file."""

  dtype: np.dtype
  shape: tuple[int, ...]
  start: int  # absolute byte offset in the file
  nbytes: int


def read_header(file: Path) -> dict[str, TensorInfo]:
  """The tensors of one safetensors file, from its header only.

  Raises:
    CheckpointError: a truncated or malformed header, or an unknown dtype (naming the file).
  """
  try:
    with open(file, "rb") as f:
      (length,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    out = {}
    for name, entry in header.items():
      begin, end = entry["data_offsets"]
      if entry["dtype"] not in _DTYPES:
        raise CheckpointError(f"{file}: tensor {name} has unsupported dtype {entry['dtype']}")
      out[name] = TensorInfo(np.dtype(_DTYPES[entry["dtype"]]), tuple(entry["shape"]),
                             8 + length + begin, end - begin)
    return out
  except (struct.error, json.JSONDecodeError, KeyError, ValueError, TypeError) as e:
    if isinstance(e, CheckpointError):
      raise
    raise CheckpointError(f"{file}: not a valid safetensors file ({e})") from e


def weight_map(path: Path) -> dict[str, Path]:
  """Tensor name -> the safetensors file holding it.

  Raises:
    CheckpointError: no safetensors weights in ``path``, or an index naming a missing file.
  """
  index = path / INDEX_FILE
  if index.is_file():
    try:
      names = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
      files = {f: path / f for f in set(names.values())}
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
      raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); "
                            'expected JSON {"weight_map": {tensor name: file}}') from e
    missing = sorted(f for f, p in files.items() if not p.is_file())
    if missing:
      raise CheckpointError(f"{index}: lists shard files that do not exist: {missing}")
    return {name: files[f] for name, f in names.items()}
  files = [path / SINGLE_FILE] if (path / SINGLE_FILE).is_file() else sorted(
      path.glob("*.safetensors"))
  if not files:
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = f" (found {others}; convert them to safetensors)" if others else ""
    raise CheckpointError(
        f"{path}: no weights: neither {SINGLE_FILE} nor {INDEX_FILE} nor any *.safetensors{hint}")
  return {name: f for f in files for name in read_header(f)}


def read_tensors(names_by_file: dict[Path, list[str]], consume: Callable[[str, np.ndarray], None]
                 ) -> None:
  """Calls ``consume(name, array)`` for each tensor, one in host memory at a time."""
  for file, names in names_by_file.items():
    infos = read_header(file)
    with open(file, "rb") as f:
      for name in names:
        info = infos[name]
        array = np.empty(info.shape, info.dtype)
        f.seek(info.start)
        if f.readinto(array.reshape(-1).view(np.uint8)) != info.nbytes:
          raise CheckpointError(f"{file}: truncated data for tensor {name}")
        consume(name, array)
        del array


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
  """Groups names (in order) into shards of at most ``max_shard_bytes`` (one tensor at least)."""
  shards: list[list[str]] = [[]]
  used = 0
  for name, size in sizes.items():
    if shards[-1] and used + size > max_shard_bytes:
      shards.append([])
      used = 0
    shards[-1].append(name)
    used += size
  return shards


def write_sharded(path: Path, sizes: dict[str, int], fetch: Callable[[str], np.ndarray],
                  max_shard_bytes: int) -> list[Path]:
  """Writes tensors ``fetch(name)`` for ``name in sizes``, one shard in host memory at a time.

  A single shard is written as ``model.safetensors``; several as
  ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``. Each file gets the
  mode of any other file written here (0666 less the umask): safetensors' writer creates its
  files 0600, unreadable by those who can read the config and tokenizer beside them.
  """
  shards = plan_shards(sizes, max_shard_bytes)
  n = len(shards)
  files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                        for i in range(n)]
  for names, fname in zip(shards, files):
    save_file({name: fetch(name) for name in names}, str(path / fname), metadata={"format": "pt"})
    os.chmod(path / fname, 0o666 & ~_umask())
  if n > 1:
    index = {"metadata": {"total_size": int(sum(sizes.values()))},
             "weight_map": {name: f for names, f in zip(shards, files) for name in names}}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
  return [path / f for f in files]


def _umask() -> int:
  """The process's umask, read without changing it where Linux shows it (``/proc/self/status``)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except OSError:
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask
