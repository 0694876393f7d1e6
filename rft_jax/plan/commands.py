"""``rft-jax plan --command eval|export``: will the commands run after training fit the run's mesh?

Both restore a checkpoint the way :func:`rft_jax.train.checkpoint.restore_policy` does: the
policy's parameters of the run's train state (:func:`rft_jax.train.run_state.run_state`) read
straight into their shards on the run's mesh, in the run's dtypes, and nothing else (neither AdamW's
moments nor PPO's critic); a LoRA run's policy is then merged (a copy of the targeted weights). Then

* ``export`` writes the Hugging Face tensors one at a time (:func:`rft_jax.models.hf.save_hf`), in
  the source checkpoint's dtype as ``export`` does by default: a tensor is cast to it on the devices (a sharded copy, at most the largest
  parameter's shard) and gathered to the host alone, so the host holds one tensor at a time (the
  largest Hugging Face tensor's bytes, reported);
* ``eval`` samples with the restored policy: the sampler's call is compiled as ``rft-jax plan`` compiles the rollouts', at
  ``evaluate``'s 64 prompts per call, ``--k`` samples each (``rft-jax eval``'s default 8) and the
  run's ``eval.max_new_tokens`` (else ``sampling.max_new_tokens``). The answer entropy's forward,
  a chunk of the evaluation's rows at a time, is smaller than the sampler's KV cache and is not
  compiled.

A command's peak per device is the larger of its restore (the parameters, plus the merged copy)
and what follows it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx

from rft_jax.models import hf_keys
from rft_jax.models.hf import checkpoint_dtype
from rft_jax.plan.fit import _bytes_per_device, _merged_sampler_state, _plan_sampler, planned_state
from rft_jax.plan.topology import GiB, Topology
from rft_jax.train.config import TrainConfig

EVAL_PROMPTS_PER_CALL = 64  # rft_jax.train.evaluate.evaluate's batch_prompts
EVAL_K = 8  # rft-jax eval's --k


def plan_command(cfg: TrainConfig, topo: Topology, command: str, progress: Callable[[str], None] = lambda m: None,
                 *, k: int = EVAL_K) -> dict[str, Any]:
  """The per-device bytes of ``rft-jax eval`` (``k`` samples per question) or ``rft-jax export``
  of a checkpoint of ``cfg``'s run on ``topo`` (see the module docstring); JSON-able, with
  ``fits``."""
  if command not in ("eval", "export"):
    raise ValueError(f"plan_command: {command!r} is not eval or export")
  config, mesh, built = planned_state(cfg, topo)
  policy = built.state if built.critic is None else built.state.policy
  graphdef, state = nnx.split(built.model)
  merged_bytes = 0
  if config.lora is not None:  # the merged weights: a copy of the targeted ones, in their layout
    graphdef, state, lora_resident = _merged_sampler_state(config, state)
    adapters = _bytes_per_device(nnx.state(built.model, nnx.LoRAParam))
    merged_bytes = lora_resident - adapters
  parameter_bytes = _bytes_per_device(policy.params)
  restore = {"parameter_bytes": parameter_bytes, "merged_bytes": merged_bytes,
             "not_read_bytes": _bytes_per_device(built.state) - parameter_bytes}
  restore["total_bytes"] = restore["parameter_bytes"] + merged_bytes
  report = {"command": command, "topology": topo.name, "devices": len(topo.devices),
            "device_kind": topo.devices[0].device_kind, "mesh": dict(mesh.shape),
            "hbm_bytes_per_device": topo.hbm_bytes,
            "model": {"model_type": config.model_type, "param_dtype": cfg.model.param_dtype,
                      "lora": config.lora is not None},
            "restore": restore}
  if command == "export":
    written = jnp.dtype(checkpoint_dtype(cfg.model.path) or cfg.model.param_dtype)  # as export writes
    flat = dict(nnx.to_flat_state(state))
    tensors = hf_keys.expected_tensors(config.replace(lora=None)).values()

    def cast_shard_bytes(tensor) -> int:
      """One tensor's cast: its share of its stacked parameter's shard (the stacking axes, layers
      and experts, are indexed away), in the written dtype."""
      stacked = flat[tensor.rule.nnx].get_value()
      share = _bytes_per_device([stacked]) * math.prod(tensor.hf_shape) // stacked.size
      return share * written.itemsize // stacked.dtype.itemsize

    largest_shard = max(map(cast_shard_bytes, tensors))
    host = max(math.prod(t.hf_shape) for t in tensors) * written.itemsize
    report["export"] = {"largest_shard_bytes": largest_shard, "host_bytes": host,
                        "total_bytes": restore["total_bytes"] + largest_shard}
    peak = report["export"]["total_bytes"]
  else:
    # The evaluation's calls as the sampler sees them (a copy: not a training config, whose
    # checks tie sampling to the learner).
    eval_cfg = copy.copy(cfg)
    eval_cfg.data = dataclasses.replace(cfg.data, prompts_per_step=EVAL_PROMPTS_PER_CALL)
    eval_cfg.sampling = dataclasses.replace(cfg.sampling, n=k, temperature=cfg.eval.temperature,
                                            max_new_tokens=cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
                                            max_rollouts_per_call=None)
    progress(f"compiling the evaluation's sampler ({EVAL_PROMPTS_PER_CALL} prompts x {k}) for {topo.name} ...")
    report["sampler"] = _plan_sampler(eval_cfg, config.replace(lora=None), mesh, graphdef, state, topo, resident=0)
    progress(f"sampler: {report['sampler']['total_bytes'] / GiB:.1f} GiB per device, compiled in "
             f"{report['sampler']['compile_seconds']:.0f} s")
    peak = max(restore["total_bytes"], report["sampler"]["total_bytes"])
  report["peak_bytes"] = peak
  report["fits"] = bool(peak <= topo.hbm_bytes)
  return report


def format_command_report(report: dict[str, Any]) -> str:
  """:func:`plan_command`'s report in a few lines, GiB per device."""
  g = lambda b: f"{b / GiB:.1f}"
  r, mesh = report["restore"], report["mesh"]
  lines = [f"{report['topology']}: {report['devices']} x {report['device_kind']}, "
           f"{g(report['hbm_bytes_per_device'])} GiB each; mesh data={mesh['data']} model={mesh['model']}",
           f"restore  the policy's {report['model']['param_dtype']} parameters, sharded: {g(r['parameter_bytes'])} GiB"
           + (f" + the merged LoRA weights {g(r['merged_bytes'])} = {g(r['total_bytes'])} GiB"
              if report["model"]["lora"] else "")
           + f" (the optimizer state and a critic, {g(r['not_read_bytes'])} GiB, not read)"]
  if report["command"] == "export":
    e = report["export"]
    lines.append(f"export   one tensor at a time: its cast on the devices, at most {g(e['largest_shard_bytes'])} "
                 f"GiB per device beside the parameters = {g(e['total_bytes'])} GiB; the host holds one tensor, at most "
                 f"{g(e['host_bytes'])} GiB")
  else:
    s = report["sampler"]
    lines.append(f"eval     {s['prompts_per_call']} prompts x {s['rollouts_per_call'] // s['prompts_per_call']} "
                 f"per call, {s['rows_in_flight']} rows in flight ({s['scheduler']}): KV cache "
                 f"{g(s['kv_cache_bytes'])} GiB; arguments {g(s['argument_bytes'])} + temp {g(s['temp_bytes'])} + "
                 f"outputs-aliased {g(s['output_bytes'] - s['alias_bytes'])} = {g(s['total_bytes'])} GiB  "
                 f"(compiled in {s['compile_seconds']:.0f} s)")
  lines.append(f"peak     {g(report['peak_bytes'])} GiB per device; fits: {'yes' if report['fits'] else 'NO'}")
  return "\n".join(lines)
