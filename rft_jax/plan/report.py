"""The report of :func:`rft_jax.plan.fit.plan` in words: a few lines, GiB per device (``rft-jax
plan`` without ``--json``)."""

from __future__ import annotations

from typing import Any

from rft_jax.plan.topology import GiB


def format_report(report: dict[str, Any]) -> str:
  """The report as a few human-readable lines (GiB per device)."""
  g = lambda b: f"{b / GiB:.1f}"
  l, s = report["learner"], report["sampler"]
  mesh = report["mesh"]
  critic_state = f" + the critic's state {g(l['resident_bytes'])}" if l["resident_bytes"] else ""
  lines = [
      f"{report['topology']}: {report['devices']} x {report['device_kind']}, "
      f"{g(report['hbm_bytes_per_device'])} GiB each; mesh data={mesh['data']} "
      f"model={mesh['model']}",
      *_parameter_lines(report, g),
      f"learner  {l['rows']} rows x {l['sequence_length']} tokens, micro-batch "
      f"{l['micro_batch_size']}: parameters {g(l['parameter_bytes'])} + optimizer "
      f"{g(l['optimizer_state_bytes'])} + KL reference {g(l['reference_bytes'])} GiB; arguments {g(l['argument_bytes'])} + temp "
      f"{g(l['temp_bytes'])} + outputs-aliased {g(l['output_bytes'] - l['alias_bytes'])}{critic_state} = "
      f"{g(l['total_bytes'])} GiB  {'fits' if l['fits'] else 'DOES NOT FIT'}  "
      f"(compiled in {l['compile_seconds']:.0f} s)",
      *_lora_lines(report["model"].get("lora"), l, g),
      *_critic_lines(report.get("critic"), g),
      f"sampler  {s['prompts_per_call']} prompts x {s['rollouts_per_call'] // s['prompts_per_call']} per call, "
      f"{s['rows_in_flight']} rows in flight ({s['scheduler']}) {_cache_words(s)}: KV cache {g(s['kv_cache_bytes'])} GiB; arguments {g(s['argument_bytes'])} + temp "
      f"{g(s['temp_bytes'])} + outputs-aliased {g(s['output_bytes'] - s['alias_bytes'])} + "
      f"{_resident_words(report)} {g(s['resident_bytes'])} = {g(s['total_bytes'])} GiB  "
      f"{'fits' if s['fits'] else 'DOES NOT FIT'}  (compiled in {s['compile_seconds']:.0f} s)",
      *(f"{name}: the compiler refused it ({part['compiler_refused']}); arguments and outputs not "
        "counted" for name, part in (("learner", l), ("critic", report.get("critic")), ("sampler", s))
        if part and part.get("compiler_refused")),
      *(f"warning: {w}" for w in report["warnings"]),
      f"fits: {'yes' if report['fits'] else 'NO'}",
  ]
  return "\n".join(lines)


def _parameter_lines(report: dict[str, Any], g) -> list[str]:
  """The parameters, those a token uses, and each group's bytes per device (an MoE model's
  routed experts first), in words."""
  p, m = report.get("parameters"), report["model"]
  if p is None:
    return []
  count = lambda n: f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.3g}M"
  active = (f" ({count(p['active_parameters'])} active per token: {m['experts_per_token']} of "
            f"{m['experts']} experts)" if p["active_parameters"] != p["parameters"] else "")
  groups = "; ".join(f"{name} {count(q['parameters'])}: {g(q['bytes_per_device'])} of "
                     f"{g(q['bytes'])} GiB per device {' '.join(q['specs'])}"
                     for name, q in p["groups"].items() if name == "routed experts")
  return [f"params   {count(p['parameters'])}{active}" + (f"; {groups}" if groups else "")]


def _resident_words(report: dict[str, Any]) -> str:
  """What stays resident beside the sampler, in words."""
  if report["model"].get("lora") is None:
    return "optimizer state, reference and critic"
  return "optimizer state, reference, critic and the train state's adapted weights and adapters"


def _cache_words(s: dict[str, Any]) -> str:
  """How the sampler report's cache holds its rows, in words."""
  if s["kv_pages"] is None:
    return f"x {s['cache_slots']} slots"
  return (f"on {s['kv_pages']} pages of {s['page_size']} tokens per data shard ({s['prompt_pages']} "
          f"for the prompts; the rest hold {s['rows_at_full_length']} rows at full length, or keep "
          f"every slot busy while samples average up to {s['tokens_per_slot']} tokens; "
          f"{s['max_kv_pages']} pages would fill the device)")


def _lora_lines(lora: dict[str, Any] | None, l: dict[str, Any], g) -> list[str]:
  """What LoRA trains, in words (nothing without it)."""
  if lora is None:
    return []
  return [f"lora     rank {lora['rank']}, alpha {lora['alpha']:g} on {', '.join(lora['targets'])}: "
          f"{l['trainable_parameters'] / 1e6:.3g}M trainable parameters ({g(l['trainable_parameter_bytes'])} GiB, "
          f"AdamW's moments of them only) beside the frozen base "
          f"({g(l['parameter_bytes'] - l['trainable_parameter_bytes'])} GiB); the sampler decodes merged "
          f"weights, the train state's resident beside it"]


def _critic_lines(c: dict[str, Any] | None, g) -> list[str]:
  """PPO's critic step in words (nothing without a critic)."""
  if c is None:
    return []
  return [f"critic   micro-batch {c['micro_batch_size']}: parameters {g(c['parameter_bytes'])} + optimizer "
          f"{g(c['optimizer_state_bytes'])} GiB; arguments {g(c['argument_bytes'])} + temp {g(c['temp_bytes'])} + "
          f"outputs-aliased {g(c['output_bytes'] - c['alias_bytes'])} + the policy's state "
          f"{g(c['resident_bytes'])} = {g(c['total_bytes'])} GiB  {'fits' if c['fits'] else 'DOES NOT FIT'}  "
          f"(compiled in {c['compile_seconds']:.0f} s)"]
