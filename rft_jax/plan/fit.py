"""``rft-jax plan``: will a run fit? Compile its learner step and sampler for a topology, deviceless.

The run's real programs (``Learner``'s train step; PPO's critic step when the run's algorithm
needs a critic; ``sample_loop``'s prefill and decode loop at the config's batch and maximum
length) are compiled for the devices of a named topology with
abstract inputs (``jax.ShapeDtypeStruct`` with their shardings): no weights, no data, no
accelerator. Only ``config.json`` is read from ``model.path``. The compiler's
``memory_analysis()`` gives each program's bytes per device; a program fits when its
arguments + outputs - aliased (donated) + temporaries, plus what stays resident beside it
(the optimizer state while the sampler runs), is at most the device's memory.

With ``model.lora`` the learner's state holds the frozen base (in ``param_dtype``) and the float32
adapters, AdamW's moments the adapters only; the sampler decodes the merged weights, a copy of
the targeted weights, while the train state's base and adapters stay resident beside it.

Topologies (:func:`rft_jax.plan.devices.topology`): TPU slices by name (``v5p:2x2x1``,
``v5e:2x4``, ``v6e:2x4``, ``v4:2x2x1``, ...; needs ``libtpu``, the ``tpu`` extra), NVIDIA GPUs
(``h100:8``, ``h100:2x8``, ``h200:8``; needs jax's CUDA plugin, see
:mod:`rft_jax.plan.gpu_topology`) and ``cpu:N`` (fake CPU devices; memory per device is the
host's RAM / N). MaxText's ``train_compile.py`` checks its configs the same way. The report in
words: :func:`rft_jax.plan.report.format_report`.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rft_jax.models import QwenConfig
from rft_jax.models.hf import abstract_model
from rft_jax.models.lora_model import adapted_weights
from rft_jax.models.decode.paged_kv import pages_for
from rft_jax.parallel import DATA_AXIS, MODEL_AXIS, axis_if_divides, make_mesh
from rft_jax.plan.parameters import parameter_report
from rft_jax.plan.topology import GiB, Topology
from rft_jax.rl.advantages.critic import Critic
from rft_jax.rl.learner import LearnerBatch
from rft_jax.sampling.buckets import batch_bucket, prompt_length_bucket
from rft_jax.sampling.generate import abstract_cache, call_spec, sampler_rules
from rft_jax.sampling.continuous import PoolSpec, pool_for
from rft_jax.sampling.loop import LoopSpec, cache_slots, loop_for
from rft_jax.train.config import TrainConfig
from rft_jax.train.resolve import mesh_axes, sampling_params
from rft_jax.train.run_state import RunState, model_config, run_state


def _bytes_per_device(tree) -> int:
  """Bytes of one device's shards of an abstract tree with shardings (the largest shard)."""
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def _compiled_memory(compile_program: Callable[[], Any], hbm: int, resident: int = 0
                     ) -> dict[str, Any]:
  """:func:`_memory` of ``compile_program()``; where the compiler refuses the program for its
  memory (the TPU compiler does when the temporaries alone exceed the device, or a kernel's
  operands its scalar memory), the temporaries it names (0 when it names none), ``fits`` False
  and its one line in ``compiler_refused`` (arguments and outputs then unknown, counted 0: the
  total is a lower bound)."""
  try:
    return _memory(compile_program(), hbm, resident)
  except jax.errors.JaxRuntimeError as exc:
    line = str(exc).splitlines()[0]
    if "RESOURCE_EXHAUSTED" not in line:
      raise
    needed = re.search(r"temporaries \(([\d.]+)([KMGT])\) exceeds", line)
    temp = 0 if needed is None else int(float(needed.group(1)) * 1024 ** " KMGT".index(needed.group(2)))
    return {"argument_bytes": 0, "output_bytes": 0, "alias_bytes": 0, "temp_bytes": temp,
            "resident_bytes": resident, "total_bytes": temp + resident, "fits": False,
            "compiler_refused": line}


def _memory(compiled, hbm: int, resident: int = 0) -> dict[str, Any]:
  m = compiled.memory_analysis()
  total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
           + m.temp_size_in_bytes + resident)
  return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
          "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
          "resident_bytes": resident, "total_bytes": total, "fits": total <= hbm}


def planned_state(cfg: TrainConfig, topo: Topology) -> tuple[QwenConfig, Mesh, RunState]:
  """What every plan of ``cfg`` on ``topo`` starts from: the run's model config, its mesh on the
  topology's devices and its abstract state there (:func:`rft_jax.train.run_state.run_state`)."""
  data, model_axis = mesh_axes(cfg, len(topo.devices))
  mesh = make_mesh(data=data, model=model_axis, devices=topo.devices)
  return model_config(cfg), mesh, run_state(cfg, mesh)


def plan(cfg: TrainConfig, topo: Topology, progress=lambda message: None, *,
         sampler: bool = True) -> dict[str, Any]:
  """Compiles the run's learner step and sampler for ``topo``; returns the JSON-able report
  (see the module docstring; per-device bytes, ``fits`` per program and overall).
  ``progress`` is called with a line before and after each compilation (minutes at 7B).
  ``sampler=False`` compiles the learner step only (the report's ``sampler`` is None)."""
  config, mesh, built = planned_state(cfg, topo)  # abstract: the state the run trains, on the topology
  graphdef, state = nnx.split(built.model)
  parameters = parameter_report(state, config)
  learner = built.learner
  train_state = built.state if built.critic is None else built.state.policy
  rows = cfg.data.prompts_per_step * cfg.sampling.n
  width = prompt_length_bucket(cfg.data.max_prompt_len) + cfg.sampling.max_new_tokens
  width = -(-width // 16) * 16
  row_sharding = NamedSharding(mesh, PartitionSpec(DATA_AXIS))
  token = lambda dtype: jax.ShapeDtypeStruct((rows, width), dtype, sharding=row_sharding)
  batch = LearnerBatch(
      input_ids=token(jnp.int32), attention_mask=token(jnp.int32), response_mask=token(jnp.int32),
      advantages=jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=row_sharding),
      sampler_logp=token(jnp.float32))
  progress(f"compiling the learner step ({rows} rows x {width} tokens) for {topo.name} ...")
  start = time.perf_counter()
  critic = None if built.critic is None else (built.critic, built.state.critic)
  critic_state_bytes = 0 if critic is None else _bytes_per_device(critic[1])  # resident beside the others
  learner_report = _compiled_memory(lambda: learner.lower_step(train_state, batch).compile(),
                                    topo.hbm_bytes, critic_state_bytes)
  learner_report.update(
      compile_seconds=time.perf_counter() - start,
      parameter_bytes=_bytes_per_device(train_state.params),
      trainable_parameter_bytes=_bytes_per_device(learner.trainable(train_state.params)),
      trainable_parameters=sum(int(np.prod(x.shape)) for x in jax.tree.leaves(learner.trainable(train_state.params))),
      optimizer_state_bytes=_bytes_per_device(train_state.opt_state),
      reference_bytes=_bytes_per_device(learner.abstract_reference(train_state.params) or {}),
      critic_state_bytes=critic_state_bytes,
      rows=rows, sequence_length=width, micro_batch_size=cfg.learner.micro_batch_size)
  progress(f"learner: {learner_report['total_bytes'] / GiB:.1f} GiB per device, compiled in "
           f"{learner_report['compile_seconds']:.0f} s")
  policy_bytes = (learner_report["parameter_bytes"] + learner_report["optimizer_state_bytes"]
                  + learner_report["reference_bytes"])
  critic_report = None
  if critic is not None:
    progress(f"compiling the critic step ({rows} rows x {width} tokens) ...")
    critic_report = _plan_critic_step(*critic, batch, topo, resident=policy_bytes)
    progress(f"critic: {critic_report['total_bytes'] / GiB:.1f} GiB per device, compiled in "
             f"{critic_report['compile_seconds']:.0f} s")

  sampler_report = None
  if sampler:
    progress("compiling the sampler ...")
    resident = (learner_report["optimizer_state_bytes"] + learner_report["reference_bytes"]
                + critic_state_bytes)
    if config.lora is not None:  # the sampler reads the merged weights; the train state stays
      graphdef, state, lora_resident = _merged_sampler_state(config, state)
      resident += lora_resident
    sampler_report = _plan_sampler(cfg, config.replace(lora=None), mesh, graphdef, state, topo,
                                   resident=resident)
    progress(f"sampler: {sampler_report['total_bytes'] / GiB:.1f} GiB per device, compiled in "
             f"{sampler_report['compile_seconds']:.0f} s")
  return {
      "topology": topo.name, "devices": len(topo.devices),
      "device_kind": topo.devices[0].device_kind,
      "mesh": dict(mesh.shape), "hbm_bytes_per_device": topo.hbm_bytes,
      "model": {"model_type": config.model_type, "layers": config.num_hidden_layers,
                "hidden_size": config.hidden_size, "dtype": cfg.model.dtype,
                "experts": config.num_experts, "experts_per_token": config.num_experts_per_tok,
                "param_dtype": cfg.model.param_dtype, "remat": cfg.model.remat,
                "attention": cfg.model.attention,
                "lora": None if config.lora is None else {
                    "rank": config.lora.rank, "alpha": config.lora.alpha,
                    "targets": list(config.lora.targets)}},
      "parameters": parameters,
      "learner": learner_report, "critic": critic_report, "sampler": sampler_report,
      "fits": all(r["fits"] for r in (learner_report, critic_report, sampler_report) if r is not None),
      "warnings": layout_warnings(config, mesh.shape[MODEL_AXIS]),
  }


def _merged_sampler_state(config: QwenConfig, state) -> tuple[Any, Any, int]:
  """The sampler's view of a LoRA model's abstract ``state`` (with shardings): the plain
  model's graph and state (the merged weights take the base weights' shapes, dtypes and
  layout), and the bytes per device of the train state's parameters the sampler's arguments do
  not already count (the targeted base weights and the adapters), resident while it runs."""
  flat = dict(nnx.to_flat_state(state))
  targets = adapted_weights(config)
  adapters = {p for pair in targets.values() for p in pair}
  plain = nnx.from_flat_state([(p, v) for p, v in flat.items() if p not in adapters])
  graphdef = nnx.split(abstract_model(config.replace(lora=None)))[0]
  resident = _bytes_per_device([flat[p].get_value() for p in (*targets, *adapters)])
  return graphdef, plain, resident


def _plan_critic_step(critic: Critic, state, batch: LearnerBatch, topo: Topology,
                      resident: int) -> dict[str, Any]:
  """The critic's compiled step (one AdamW step of the value loss) on the learner's batch shape;
  the policy's state (``resident`` bytes) stays beside it."""
  ids = batch.input_ids
  shifted = lambda dtype: jax.ShapeDtypeStruct((ids.shape[0], ids.shape[1] - 1), dtype, sharding=ids.sharding)
  start = time.perf_counter()
  report = _compiled_memory(
      lambda: critic.lower_step(state, ids, batch.attention_mask, shifted(jnp.int32),
                                shifted(jnp.float32), shifted(jnp.float32)).compile(),
      topo.hbm_bytes, resident)
  report.update(compile_seconds=time.perf_counter() - start, parameter_bytes=_bytes_per_device(state.params),
                optimizer_state_bytes=_bytes_per_device(state.opt_state),
                micro_batch_size=critic.config.micro_batch_size)
  return report


def layout_warnings(config: QwenConfig, model_axis: int) -> list[str]:
  """What the sharding rules cannot split over the ``model`` axis and silently replicate."""
  mlp = (("MLP width", config.intermediate_size),)
  if config.is_moe:  # experts over 'model' whole, or split by their width where they do not divide
    mlp = (("routed experts (nor their width)", config.num_experts),)
    mlp = () if config.moe_intermediate_size % max(model_axis, 1) == 0 else mlp
  sizes = (("query heads", config.num_attention_heads),
           ("key/value heads", config.num_key_value_heads), *mlp,
           ("vocabulary rows", config.vocab_size))
  return [f"{size} {name} do not divide mesh.model={model_axis}: those weights"
          f"{' and the KV cache' if 'key' in name else ''} are replicated over 'model'"
          for name, size in sizes if model_axis > 1 and size % model_axis]


def _plan_sampler(cfg: TrainConfig, config: QwenConfig, mesh, graphdef, state, topo: Topology,
                  resident: int) -> dict[str, Any]:
  """Compiles one sampler call (:func:`~rft_jax.sampling.generate.program_for` the run's
  scheduler and the mesh's devices): the prompts of one call at the longest prompt bucket. Its
  KV cache holds the rows in flight: continuous batching's pool of decode slots
  (``sampling.decode_slots``, the call's rollouts when unset) at full width, or, with
  ``sampling.kv_pages``, that many pages per data shard (:func:`page_plan`); or every rollout
  of the call at full width (the static scheduler)."""
  s = cfg.sampling
  params = sampling_params(cfg, stop_ids=(0,))
  # One call's prompts, as generate() slices a step's prompts (dummy rows included).
  data = mesh.shape[DATA_AXIS]
  max_prompts = None if s.max_rollouts_per_call is None else s.max_rollouts_per_call // s.n
  batch = batch_bucket(cfg.data.prompts_per_step, data, max_prompts)
  width = prompt_length_bucket(cfg.data.max_prompt_len)
  slots = cache_slots(width, s.max_new_tokens)
  spec = call_spec(params, batch * s.n, data)
  in_flight = spec.slots[0] if isinstance(spec, PoolSpec) else batch * s.n
  start = time.perf_counter()
  report = _compiled_memory(lambda: compile_sampler_call(mesh, graphdef, state, spec, batch, width),
                            topo.hbm_bytes, resident)
  report.update(compile_seconds=time.perf_counter() - start, prompts_per_call=batch,
                rollouts_per_call=batch * s.n, rows_in_flight=in_flight,
                scheduler=params.scheduler, prompt_length=width, cache_slots=slots,
                kv_pages=None)
  if params.scheduler == "continuous" and params.kv_pages is not None:
    pages = page_plan(config, mesh, params, batch // data, width, in_flight // data,
                      spare=topo.hbm_bytes - report["total_bytes"])
    report.update(kv_cache_bytes=pages["kv_pages"] * pages["page_bytes"], **pages)
  else:
    cache = abstract_cache(config, in_flight, slots, mesh=mesh, rules=sampler_rules())
    report.update(kv_cache_bytes=_bytes_per_device(cache))
  return report


def page_plan(config: QwenConfig, mesh, params, prompts: int, prompt_length: int, slots: int,
              spare: int) -> dict[str, int]:
  """What a paged cache of ``params.kv_pages`` pages per data shard holds, for one shard's
  ``prompts`` prompts of ``prompt_length`` slots and ``slots`` decode slots, and how many pages
  would fit in ``spare`` more bytes per device.

  Returns:
    ``page_bytes``: one page's keys and values over every layer, per device (the KV heads
    split over ``model`` when they divide it); ``kv_pages``; ``max_kv_pages``: the budget that
    fills the device if the compiled program's other bytes do not grow with pages (on a small
    model compiled for v5p its temporaries grow by the pages' bytes and no more,
    ``benchmarks/plan/sampler_memory.py``; plan the budget chosen);
    ``prompt_pages``: the prompts' pages, which stay for the call; ``rows_at_full_length``:
    samples of ``max_new_tokens`` the other pages hold at once, per shard, each with its copy of
    a partial prompt page;
    ``tokens_per_slot``: the mean sample length up to which every decode slot stays busy
    without an eviction.
  """
  heads = config.num_key_value_heads
  local_heads = heads // mesh.shape[MODEL_AXIS] if axis_if_divides(mesh, heads) else heads
  page_bytes = (2 * config.num_hidden_layers * local_heads * params.page_size * config.head_dim
                * jnp.dtype(config.dtype).itemsize)  # the cache is in the compute dtype
  prompt_pages = prompts * pages_for(prompt_length, params.page_size)
  free = params.kv_pages - prompt_pages
  # A sample's own pages: its copy of the prompt's last partial page (up to page_size - 1
  # prompt tokens, as the prompt's length falls) and its max_new_tokens.
  full_row_pages = pages_for(params.max_new_tokens + params.page_size - 1, params.page_size)
  return {"page_size": params.page_size, "page_bytes": page_bytes, "kv_pages": params.kv_pages,
          "max_kv_pages": params.kv_pages + spare // page_bytes,  # floor: fewer when short
          "prompt_pages": prompt_pages,
          "rows_at_full_length": max(free, 0) // full_row_pages,
          "tokens_per_slot": max(free, 0) * params.page_size // max(slots, 1)}


def compile_sampler_call(mesh, graphdef, state, spec: LoopSpec | PoolSpec, batch: int,
                         width: int):
  """The compiled sampler program (the static loop for a :class:`LoopSpec`, continuous
  batching's for a :class:`PoolSpec`, built for the mesh's devices) for ``batch`` prompts of
  ``width`` tokens, its inputs abstract and laid out as ``generate`` lays them out (rows over
  ``data``, scalars replicated); ``state`` abstract, with shardings."""
  rows = NamedSharding(mesh, PartitionSpec(DATA_AXIS))
  scalar = NamedSharding(mesh, PartitionSpec())
  inputs = [jax.ShapeDtypeStruct(shape, dtype, sharding=rows) for shape, dtype in (
      ((batch, width), jnp.int32), ((batch, width), jnp.int32), ((batch, 3), jnp.uint32),
      ((batch,), jnp.bool_))]
  scalars = [jax.ShapeDtypeStruct((), dtype, sharding=scalar)
             for dtype in (jnp.uint32, jnp.float32, jnp.int32, jnp.float32)]
  layers = nnx.merge(graphdef, state).config.num_hidden_layers
  layer_ids = tuple(jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar)
                    for _ in range(layers))  # as layer_indices(L)
  program = pool_for(mesh) if isinstance(spec, PoolSpec) else loop_for(mesh)
  return program.lower(graphdef, state, *inputs, *scalars, layer_ids, spec=spec, mesh=mesh,
                       rules=sampler_rules()).compile()


def while_loop_bodies(hlo: str) -> dict[str, list[str]]:
  """The instruction lines of each while loop's body in compiled HLO text (``as_text()``), by
  the body computation's name."""
  computations, current, bodies = {}, None, []
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
    if header:
      current = computations.setdefault(header.group(1), [])
    elif line.rstrip() == "}":  # a computation's end (multi-line backend configs have "}}, ...")
      current = None
    elif current is not None:
      current.append(line)
      bodies += re.findall(r" while\(.*body=%([^,\s]+)", line)
  return {body: computations[body] for body in bodies}
