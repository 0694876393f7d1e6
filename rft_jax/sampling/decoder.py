"""A sampling program's model, set up once per call for decoding: one set-up for the static loop,
the continuous pool and the multi-turn pool.

Each program builds a :class:`Decoder` inside its trace from its :class:`DecodeBackend`
(:func:`backend_for`: the one choice of the decode step, :mod:`rft_jax.models.decode.backend`)
and calls :meth:`Decoder.prefill`, :meth:`Decoder.step` or :meth:`Decoder.paged_step`; none of
them looks at the platform itself.
"""

from __future__ import annotations

import os

import jax
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Int

from rft_jax.models.decode import feature_major, fused_decode
from rft_jax.models.decode.backend import DecodeBackend, choose_backend, cpu_kernel_takes
from rft_jax.models.kv_cache import KVCache
from rft_jax.parallel import TP_RULES, first_device, state_shardings
from rft_jax.parallel import platform_of as parallel_platform_of
from rft_jax.sampling import routing_record

# XLA:CPU spends most of a sampler's compile time in LLVM, on the elementwise kernels around the
# matrix products (library kernels, compiled already). LLVM at -O2 instead of XLA's -O3 compiles
# faster and runs as fast (docs/results/cpu.md#the-cpu-samplers-compile-time). A level set in
# XLA_FLAGS wins (the test suite compiles at -O0: tests/conftest.py).
CPU_COMPILER_OPTIONS = ({} if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
                        else {"xla_backend_optimization_level": 2})


def platform_of(mesh: Mesh | None) -> str:
  """:func:`rft_jax.parallel.platform_of`, looked up here (tests set it to compile another
  platform's program on CPU)."""
  return parallel_platform_of(mesh)


def devices_of(mesh: Mesh | None) -> int:
  """How many devices ``mesh`` has (one without a mesh: the default device)."""
  return 1 if mesh is None else mesh.devices.size


def on_cpu(mesh: Mesh | None) -> bool:
  """Whether a program on ``mesh`` runs on CPU (where it compiles with
  :data:`CPU_COMPILER_OPTIONS`)."""
  return platform_of(mesh) == "cpu"


def backend_for(config, spec, mesh: Mesh | None, rows: int) -> DecodeBackend:
  """The decode backend of a program of ``rows`` rows for ``config`` on ``mesh``'s devices;
  ``spec`` (a :class:`~rft_jax.sampling.loop.DecodeSpec`) gives the cache dtype and, for a
  paged pool, the pages' settings."""
  platform = platform_of(mesh)
  kv_pages = getattr(spec, "kv_pages", None)
  return choose_backend(
      config, platform=platform, devices=devices_of(mesh), rows=rows, cache_dtype=spec.cache_dtype,
      kv_pages=kv_pages, paged_attention=getattr(spec, "paged_attention", "auto"),
      page_size=getattr(spec, "page_size", 16),
      device_kind=None if kv_pages is None else first_device(mesh).device_kind)


def cpu_attention_for(cache: KVCache, mesh: Mesh | None):
  """The CPU decode step's attention for ``cache`` on ``mesh``: the compiled kernel
  (:mod:`rft_jax.models.decode.cpu_attention`) where :func:`cpu_kernel_takes` says, else
  ``feature_major.attend``."""
  takes = cpu_kernel_takes(platform_of(mesh), devices_of(mesh), cache.dtype)
  return DecodeBackend("cpu", "feature_major", takes).attention


def decode_state(model, mesh: Mesh | None) -> nnx.State:
  """The state an accelerator's program decodes with, made once per call: the matrices in the
  compute dtype (:meth:`~rft_jax.models.Qwen.state_in_compute_dtype`: with the paper's float32
  parameters a step reads half the bytes) and sharded over the mesh's ``model`` axis only
  (:data:`~rft_jax.parallel.TP_RULES`). Laid out as the learner keeps them, FSDP over ``data``,
  the loop gathers every layer's weights over ``data`` at every step (the collectives a step:
  ``docs/results/gpu.md#the-decode-step-against-the-memory-bound``); gathered here, once per
  call, it runs none, holding a copy of the weights replicated over ``data``, which costs no
  more memory than the per-step gathers did (the paper's configs:
  ``docs/results/plans.md#the-papers-six-configs-dense-cache-v5p``)."""
  state = model.state_in_compute_dtype()
  if mesh is None:
    return state
  return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh, TP_RULES))


class Decoder:
  """The model of a sampling program, set up for its :class:`DecodeBackend` (inside the trace).

  On an accelerator the weights are :func:`decode_state`'s; GPUs slice the layers apart once
  and hold them; on CPU the feature-major step's transposed weights are made once, after the
  prefill (:meth:`decode_weights`), and layers are sliced at ``layer_ids`` (index arguments: XLA:CPU
  then compiles one set of per-layer kernels for every layer).
  """

  def __init__(self, graphdef: nnx.GraphDef, state: nnx.State, backend: DecodeBackend, *,
               mesh: Mesh | None, layer_ids=None, routed: bool = False):
    self._init(graphdef, state, nnx.merge(graphdef, state), backend, mesh, layer_ids, routed)

  @classmethod
  def of(cls, graphdef: nnx.GraphDef, state: nnx.State, spec, *, mesh: Mesh | None, rows: int,
         layer_ids=None) -> Decoder:
    """The decoder of a program of ``rows`` rows with ``spec`` (a
    :class:`~rft_jax.sampling.loop.DecodeSpec`), its backend from :func:`backend_for`; an MoE
    model's routing recorded as ``spec.record_routing`` says."""
    decoder = cls.__new__(cls)
    model = nnx.merge(graphdef, state)
    decoder._init(graphdef, state, model, backend_for(model.config, spec, mesh, rows), mesh,
                  layer_ids, routing_record.records_routing(model, spec))
    return decoder

  def _init(self, graphdef, state, model, backend: DecodeBackend, mesh, layer_ids, routed):
    if not backend.on_cpu:
      model = nnx.merge(graphdef, decode_state(model, mesh))
    self.model, self.backend, self.mesh, self.routed = model, backend, mesh, routed
    self.layers = model.unstacked_layers(layer_ids if backend.on_cpu else None)
    self.step_layers = self.layers if backend.slices_layers_once else None
    self.weights: feature_major.DecodeWeights | None = None

  @property
  def config(self):
    return self.model.config

  def decode_weights(self, weights: feature_major.DecodeWeights | None = None) -> None:
    """Makes the CPU step's transposed weights (:attr:`weights`) now, outside any decode loop,
    or takes ``weights`` made earlier (by a program of their own); nothing off CPU."""
    if self.backend.on_cpu:
      self.weights = (feature_major.decode_weights(self.model, self.layers) if weights is None
                      else weights)

  def prefill(self, ids: Int[Array, "B P"], mask: Int[Array, "B P"], cache: KVCache):
    """``(last logits [B, V], cache, prompt routing or None)``
    (:func:`rft_jax.sampling.routing_record.prefill`); then the decode weights
    (:meth:`decode_weights`: after the prefill, which does not need them)."""
    out = routing_record.prefill(self.model, ids, mask, cache, mesh=self.mesh, layers=self.layers,
                                 routed=self.routed)
    self.decode_weights()
    return out

  def step(self, tokens: Int[Array, "R"], cache: KVCache, live: Bool[Array, "R"]):
    """One decode step on a dense cache: ``((logits, cache, fed expert ids or None),
    vocab_axis)``; ``[V, R]`` logits on CPU, whose rows not ``live`` skip attention, else
    ``[R, V]``."""
    asked = routing_record.asked(self.routed)
    if self.backend.on_cpu:
      if self.weights is None:
        raise RuntimeError("Decoder.step: make the CPU weights first (prefill or decode_weights)")
      out = feature_major.decode_step(self.model, self.weights, tokens, cache, self.backend.attention,
                                      live=live, **asked)
      return routing_record.split_step(out, self.routed), 0
    if self.config.is_moe:
      out = self.model.decode_step(tokens, cache, layers=self.step_layers, **asked)
    else:
      out = fused_decode.decode_step(self.model, tokens, cache, self.step_layers, self.backend.step)
    return routing_record.split_step(out, self.routed), 1

  def paged_step(self, tokens: Int[Array, "S"], cache, writing: Bool[Array, "S"]):
    """One decode step on a paged cache (:meth:`~rft_jax.models.Qwen.paged_decode_step` with the
    backend's paged attention): ``((logits [S, V], cache, fed ids or None), 1)``."""
    out = self.model.paged_decode_step(
        tokens, cache, writing, layers=self.layers if self.backend.on_cpu else self.step_layers,
        kind=self.backend.paged, mesh=self.mesh, **routing_record.asked(self.routed))
    return routing_record.split_step(out, self.routed), 1
