"""Hugging Face checkpoints <-> the NNX decoder: :func:`load_hf` and :func:`save_hf`.

Loading builds the model abstractly (``nnx.eval_shape``, no memory), checks every tensor name
and shape against :mod:`rft_jax.models.hf_keys` from the safetensors headers, then streams the
tensors one at a time: each is converted on the host, placed with its ``NamedSharding`` when a
mesh is given, and written into its (stacked) parameter. Host memory holds one tensor at a time
on top of the placed parameters. Saving walks the same table backwards.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from rft_jax.models import hf_keys, safetensors_io
from rft_jax.models.config import QwenConfig
from rft_jax.models.errors import CheckpointError
from rft_jax.models.lora_model import merged
from rft_jax.models.model import Qwen
from rft_jax.parallel.multihost import global_array
from rft_jax.parallel.sharding import DEFAULT_RULES, Rules, named_sharding, variable_axes

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def _listing(names: list[str], limit: int = 20) -> str:
  shown = ", ".join(names[:limit])
  return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def read_config(path: str | Path, **runtime) -> QwenConfig:
  """``QwenConfig`` from ``path/config.json``; ``runtime``: dtype, param_dtype, remat, attention,
  decode_kernels.

  Raises:
    CheckpointError: no ``config.json``, or one that is not UTF-8 JSON or not a supported Qwen
      config; the message names the file (and the line of a JSON syntax error).
  """
  path = Path(path)
  file = path / CONFIG_FILE
  if not file.is_file():
    raise CheckpointError(f"{path}: no {CONFIG_FILE} (not a Hugging Face model directory?)")
  try:
    data = json.loads(file.read_bytes().decode("utf-8"))
  except UnicodeDecodeError as exc:
    raise CheckpointError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
  except json.JSONDecodeError as exc:
    raise CheckpointError(f"{file}: not valid JSON: line {exc.lineno}, column {exc.colno}: "
                          f"{exc.msg}") from exc
  try:
    return QwenConfig.from_hf_dict(data, **runtime)
  except CheckpointError as exc:
    raise CheckpointError(f"{file}: {str(exc).removeprefix(CONFIG_FILE + ': ')}") from exc


def checkpoint_dtype(path: str | Path) -> str | None:
  """The dtype a Hugging Face directory's ``config.json`` declares (float32 or bfloat16), if any:
  what ``rft-jax export`` writes by default."""
  config = _json_or_empty(Path(path) / CONFIG_FILE)
  dtype = config.get("torch_dtype") or config.get("dtype")
  return dtype if dtype in ("float32", "bfloat16") else None


def abstract_model(config: QwenConfig) -> Qwen:
  """The model with ``jax.ShapeDtypeStruct`` parameters: shapes and metadata, no memory."""
  return nnx.eval_shape(lambda: Qwen(config, rngs=nnx.Rngs(0)))


def _check_names_and_shapes(path: Path, config: QwenConfig, files: dict[str, Path],
                            expected: dict[str, hf_keys.TensorSpec]) -> None:
  experts = hf_keys.checkpoint_experts(files)
  if config.is_moe and experts is not None and experts != config.num_experts:
    raise CheckpointError(f"{path}: the checkpoint holds {experts} experts per layer "
                          f"(model.layers.*.mlp.experts.*), its config.json num_experts="
                          f"{config.num_experts}")
  missing = [n for n in expected if n not in files]
  unexpected = sorted(hf_keys.describe_unexpected(n, config) for n in files
                      if n not in expected and not hf_keys.is_ignored(n, config))
  problems = []
  if missing:
    problems.append(f"missing {len(missing)} tensor(s) required by the {config.model_type} "
                    f"config: {_listing(missing)}")
  if unexpected:
    problems.append(f"{len(unexpected)} unexpected tensor(s): {_listing(unexpected)}")
  if problems:
    raise CheckpointError(f"{path}: " + "; ".join(problems))
  headers = {f: safetensors_io.read_header(f) for f in sorted(set(files[n] for n in expected))}
  absent = [f"{n} (in {files[n].name})" for n in expected if n not in headers[files[n]]]
  if absent:
    raise CheckpointError(f"{path}: the index lists tensor(s) its shard files do not hold: "
                          f"{_listing(absent)}")
  bad = [f"{n}: expected shape {s.hf_shape}, found {headers[files[n]][n].shape}"
         for n, s in expected.items() if headers[files[n]][n].shape != s.hf_shape]
  if bad:
    raise CheckpointError(f"{path}: shape mismatch: " + "; ".join(bad))


@functools.cache
def _zeros(shape: tuple[int, ...], dtype, sharding) -> Any:
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.cache
def _set_row(sharding, depth: int) -> Any:
  """Writes ``row`` at the leading indices ``index`` (``depth`` of them: a layer, or a layer's
  expert) of ``buf``, in place."""
  def set_row(buf, row, index):
    row = row.reshape((1,) * depth + row.shape)
    return jax.lax.dynamic_update_slice(buf, row, tuple(index) + (0,) * (buf.ndim - depth))

  return jax.jit(set_row, donate_argnums=0, out_shardings=sharding)


def load_hf(path: str | Path, *, dtype=jnp.float32, param_dtype=jnp.float32,
            mesh: Mesh | None = None, rules: Rules | None = None, remat: bool = False,
            attention: str = "auto", decode_kernels: str = "auto") -> Qwen:
  """Loads a Qwen2 / Qwen2.5 / Qwen3 (or Qwen2-MoE / Qwen3-MoE) Hugging Face checkpoint
  directory.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` or sharded safetensors.
    dtype: compute dtype; param_dtype: storage dtype of the parameters.
    mesh: place every parameter with its ``NamedSharding`` on this mesh (default: one device).
    rules: logical-axis rules (default :data:`rft_jax.parallel.DEFAULT_RULES`).
    remat: rematerialise each layer in the backward pass.
    attention: the causal self-attention implementation (``QwenConfig.attention``).
    decode_kernels: the sampler's accelerator decode step (``QwenConfig.decode_kernels``).

  Raises:
    CheckpointError: no config / no weights, unsupported config, missing or unexpected tensor
      names (listed), shape mismatches (name, expected and found shapes), an expert count that
      differs from the config's (both named).
  """
  path = Path(path)
  config = read_config(path, dtype=dtype, param_dtype=param_dtype, remat=remat,
                       attention=attention, decode_kernels=decode_kernels)
  files = safetensors_io.weight_map(path)
  expected = hf_keys.expected_tensors(config)
  _check_names_and_shapes(path, config, files, expected)

  graphdef, abstract = nnx.split(abstract_model(config))
  variables = dict(nnx.to_flat_state(abstract))
  rules = DEFAULT_RULES if rules is None else rules
  device = SingleDeviceSharding(jax.devices()[0])

  def sharding_of(var: nnx.Variable) -> NamedSharding | SingleDeviceSharding:
    if mesh is None:
      return device
    return named_sharding(variable_axes(var), var.get_value().shape, mesh, rules)

  values: dict[tuple[str, ...], jax.Array] = {}

  def consume(name: str, x: np.ndarray) -> None:
    spec = expected[name]
    var = variables[spec.rule.nnx]
    target = var.get_value()
    sharding = sharding_of(var)
    depth = len(spec.index)
    if not depth:
      y = hf_keys.to_nnx(x, spec, target.shape).astype(target.dtype, copy=False)
      values[spec.rule.nnx] = global_array(y, sharding)
      return
    y = hf_keys.to_nnx(x, spec, target.shape[depth:]).astype(target.dtype, copy=False)
    row_sharding = (device if mesh is None
                    else NamedSharding(mesh, PartitionSpec(*sharding.spec[depth:])))
    buf = values.get(spec.rule.nnx)
    if buf is None:
      buf = _zeros(target.shape, target.dtype, sharding)()
    values[spec.rule.nnx] = _set_row(sharding, depth)(buf, global_array(y, row_sharding),
                                                      np.asarray(spec.index, np.int32))

  by_file: dict[Path, list[str]] = {}
  for name in expected:
    by_file.setdefault(files[name], []).append(name)
  safetensors_io.read_tensors(by_file, consume)
  state = nnx.from_flat_state([(p, v.replace(values[p])) for p, v in variables.items()])
  return nnx.merge(graphdef, state)


def _json_or_empty(file: Path) -> dict:
  """A JSON file's object, or ``{}`` when there is no such file."""
  return json.loads(file.read_text()) if file.is_file() else {}


def save_hf(model: Qwen, path: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            tokenizer: Any = None, dtype: str | None = None, source: str | Path | None = None) -> Path:
  """Writes ``model`` as a Hugging Face checkpoint that ``AutoModelForCausalLM`` loads.

  Writes ``config.json``, ``generation_config.json`` and safetensors in ``dtype`` (default: the
  parameter dtype; ``bfloat16`` halves a float32 master copy), split into shards of at most
  ``max_shard_bytes`` with an index when larger; a tied model has no ``lm_head.weight``.
  A model with LoRA adapters is written merged (:func:`~rft_jax.models.lora_model.merged`: the
  plain weights ``W + alpha/r A B``). ``tokenizer`` (optional) is saved alongside. ``source``: the HF directory the model came from;
  the fields of its ``config.json`` that the model does not define (``pad_token_id``, ...) are
  kept, and its ``generation_config.json`` (sampling defaults, stop tokens) is copied as it is.

  Raises:
    CheckpointError: the model holds parameters the key table does not know.
  """
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  model = merged(model)
  config: QwenConfig = model.config
  variables = dict(nnx.to_flat_state(nnx.state(model)))
  expected = hf_keys.expected_tensors(config)
  unmapped = sorted(".".join(map(str, p)) for p in variables
                    if p not in {s.rule.nnx for s in expected.values()})
  if unmapped:
    raise CheckpointError(f"save_hf: parameters with no Hugging Face name: {unmapped}")

  # The dtype of the tensors as written (a model may have been cast after it was built).
  written = jnp.dtype(dtype) if dtype else variables[("embed_tokens",)].get_value().dtype

  def fetch(name: str) -> np.ndarray:
    spec = expected[name]
    array = variables[spec.rule.nnx].get_value()
    if spec.index:
      array = array[spec.index]
    return hf_keys.to_hf(np.asarray(jax.device_get(array.astype(written))), spec)

  sizes = {name: math.prod(s.hf_shape) * written.itemsize for name, s in expected.items()}
  safetensors_io.write_sharded(path, sizes, fetch, max_shard_bytes)
  source_config = _json_or_empty(Path(source) / CONFIG_FILE) if source else {}
  hf_config = {**source_config, **config.to_hf_dict()}
  hf_config["dtype"] = hf_config["torch_dtype"] = written.name
  (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
  generation = _json_or_empty(Path(source) / GENERATION_CONFIG_FILE) if source else {}
  generation = generation or {"bos_token_id": hf_config["bos_token_id"],
                              "eos_token_id": hf_config["eos_token_id"]}
  (path / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
  if tokenizer is not None:
    tokenizer.save_pretrained(str(path))
  return path
