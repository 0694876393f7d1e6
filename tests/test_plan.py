"""`rft-jax plan`: a config's learner step and sampler compiled for a topology, deviceless."""

from __future__ import annotations

import json

import jax
import pytest

from rft_jax import cli
from rft_jax.models import QwenConfig
from rft_jax.plan.fit import _compiled_memory
from rft_jax.plan.topology import GiB

CONFIG = """
model: {{path: {model}, dtype: float32, param_dtype: float32, remat: true}}
data: {{prompts_per_step: 4, max_prompt_len: 16}}
sampling: {{n: 4, max_new_tokens: {new_tokens}, max_rollouts_per_call: 8}}
learner: {{micro_batch_size: 16}}
"""


def _setup(tmp_path, new_tokens: int = 16, head_dim: int = 16) -> tuple[str, str]:
  """A model directory holding only config.json (no weights, no tokenizer) and a run config
  (no data path); small programs to compile: one learner pass, one decode segment."""
  model = tmp_path / "model"
  model.mkdir()
  config = QwenConfig("qwen3", 256, 64, 128, 2, 4, 2, head_dim=head_dim)
  (model / "config.json").write_text(json.dumps(config.to_hf_dict()))
  path = tmp_path / "run.yaml"
  path.write_text(CONFIG.format(model=model, new_tokens=new_tokens))
  return str(path), str(model)


def _plan(capsys, *args) -> tuple[int, dict]:
  code = cli.main(["plan", *args, "--json"])
  return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("topology,devices,kl_coef,kv_pages", [("cpu:8", 8, 0.1, None),
                                                                ("v5p:2x2x1", 4, 0.0, 40)])
def test_plan_reports_bytes_per_device_and_fits(tmp_path, capsys, topology, devices, kl_coef,
                                                kv_pages):
  """One plan per topology, the cpu:8 one with a KL term: with kl_coef > 0 the step takes one
  more copy of the parameters (ref_dtype=float32: their bytes) and the sampler runs beside it;
  without, none. The TPU one samples on a paged KV cache (the Pallas TPU kernel, compiled)."""
  # The Pallas TPU paged kernel takes head_dim a multiple of 128 (the real models' 128).
  config, _ = _setup(tmp_path, head_dim=16 if kv_pages is None else 128)
  pages = [] if kv_pages is None else [f"sampling.kv_pages={kv_pages}", "sampling.page_size=8"]
  # The splash kernel's bfloat16 products need the default precision (conftest sets "highest").
  with jax.default_matmul_precision("default"):
    code, report = _plan(capsys, config, "--topology", topology, "mesh.model=2", f"learner.kl_coef={kl_coef}",
                         "learner.ref_dtype=float32", *pages)
  assert code == 0 and report["fits"] is True
  assert report["topology"] == topology and report["devices"] == devices
  assert report["mesh"] == {"data": devices // 2, "model": 2}
  for program in ("learner", "sampler"):
    part = report[program]
    for key in ("argument_bytes", "temp_bytes", "output_bytes", "total_bytes"):
      assert isinstance(part[key], int) and part[key] >= 0, (program, key)
    assert part["fits"] is True and part["total_bytes"] <= report["hbm_bytes_per_device"]
  learner, sampler = report["learner"], report["sampler"]
  print(f"\n[plan {topology}] learner {learner}\nsampler {sampler}")
  # AdamW's two float32 moments laid out like the float32 parameters: twice their bytes per
  # device, plus step counters (replicated moments would be 2 x the whole model on every device).
  assert 0 <= learner["optimizer_state_bytes"] - 2 * learner["parameter_bytes"] <= 16
  assert learner["rows"] == 16 and learner["sequence_length"] == 32  # 16-token bucket + 16
  # max_rollouts_per_call=8 holds 2 prompts of 4 samples, but every data shard gets a prompt.
  data = devices // 2
  assert sampler["prompts_per_call"] == max(2, data) and sampler["rollouts_per_call"] == 4 * max(2, data)
  # Continuous batching (the default), one decode slot per rollout: the cache holds them all.
  assert sampler["scheduler"] == "continuous"
  assert sampler["rows_in_flight"] == sampler["rollouts_per_call"]
  reference = learner["parameter_bytes"] if kl_coef > 0 else 0
  assert learner["reference_bytes"] == reference
  assert sampler["resident_bytes"] == learner["optimizer_state_bytes"] + reference
  if kv_pages is None:
    assert sampler["kv_pages"] is None
  else:
    # 2 layers x keys and values x 1 KV head per device (2 over model=2) x 8 tokens x 128 x 4 bytes
    assert sampler["page_bytes"] == 2 * 2 * 1 * 8 * 128 * 4
    assert sampler["kv_cache_bytes"] == kv_pages * sampler["page_bytes"]
    # One prompt per data shard of 16 slots (2 pages); 38 pages hold 12 samples of 16 tokens,
    # each with up to 7 tokens of a partial prompt page (3 pages).
    assert sampler["prompt_pages"] == 2 and sampler["rows_at_full_length"] == 12
    assert sampler["tokens_per_slot"] == 38 * 8 // 4  # 4 slots per shard
    assert sampler["max_kv_pages"] > kv_pages  # a tiny model: the device has room for more
    # The compiled program holds the pages: one data shard's per device, not the mesh's.
    assert sampler["kv_cache_bytes"] <= sampler["temp_bytes"] + sampler["argument_bytes"]
  if topology.startswith("v5p"):
    assert report["device_kind"] == "TPU v5" and report["hbm_bytes_per_device"] > 90 * 2**30


def test_plan_counts_a_bfloat16_kl_reference_at_half_the_parameter_bytes(tmp_path):
  """With kl_coef > 0 and ref_dtype=bfloat16 the step's copy of the float32 parameters takes
  half their bytes (the float32 copy is test_plan_reports_bytes_per_device_and_fits's)."""
  from rft_jax.plan.devices import topology
  from rft_jax.plan.fit import plan
  from rft_jax.train.config import load_config

  config, _ = _setup(tmp_path)
  report = plan(load_config(config, ["learner.kl_coef=0.1", "learner.ref_dtype=bfloat16"], required=()),
                topology("cpu:8"), sampler=False)["learner"]
  assert report["reference_bytes"] == report["parameter_bytes"] // 2


def test_plan_counts_float32_moments_of_bfloat16_parameters(tmp_path):
  """model.param_dtype=bfloat16: AdamW's moments are bfloat16 under learner.optim.moment_dtype=auto
  (2 x the parameters' bytes) and float32 under float32 (4 x), in the plan's optimizer bytes and in
  what stays resident beside the sampler."""
  from rft_jax.plan.devices import topology
  from rft_jax.plan.fit import plan
  from rft_jax.train.config import load_config

  config, _ = _setup(tmp_path)
  reports = {}
  for moments in ("auto", "float32"):
    cfg = load_config(config, ["model.param_dtype=bfloat16", "model.dtype=bfloat16",
                               f"learner.optim.moment_dtype={moments}"], required=())
    reports[moments] = plan(cfg, topology("cpu:1"), sampler=False)["learner"]
  auto, float32 = reports["auto"], reports["float32"]
  assert auto["parameter_bytes"] == float32["parameter_bytes"] == auto["trainable_parameters"] * 2
  assert 0 <= auto["optimizer_state_bytes"] - 2 * auto["parameter_bytes"] <= 16  # step counters
  assert 0 <= float32["optimizer_state_bytes"] - 4 * float32["parameter_bytes"] <= 16
  assert float32["optimizer_state_bytes"] > auto["optimizer_state_bytes"]
  assert float32["argument_bytes"] > auto["argument_bytes"]  # the compiled step takes them


def test_plan_counts_ppos_critic_beside_the_policy(tmp_path, capsys):
  """learner.advantage=gae (PPO) trains a critic: its parameters (the policy's decoder, no
  unembedding, and a scalar head) and AdamW moments stay resident beside the learner step and
  the sampler, and its own step is compiled with the policy's state beside it."""
  from rft_jax.plan.devices import topology
  from rft_jax.plan.fit import plan
  from rft_jax.train.config import load_config

  config, _ = _setup(tmp_path)
  cfg = load_config(config, ["learner.advantage=gae", "critic.micro_batch_size=16"], required=())
  report = plan(cfg, topology("cpu:8"))
  learner, critic, sampler = report["learner"], report["critic"], report["sampler"]
  # The critic's decoder is the policy's without its untied unembedding (256 x 64 floats); the
  # head adds 65 floats, replicated.
  assert critic["parameter_bytes"] == learner["parameter_bytes"] - 256 * 64 * 4 // 8 + 65 * 4
  assert 0 <= critic["optimizer_state_bytes"] - 2 * critic["parameter_bytes"] <= 16
  critic_state = critic["parameter_bytes"] + critic["optimizer_state_bytes"] + 4  # and its int32 step
  assert learner["critic_state_bytes"] == learner["resident_bytes"] == critic_state
  assert critic["resident_bytes"] == learner["parameter_bytes"] + learner["optimizer_state_bytes"]
  assert sampler["resident_bytes"] == learner["optimizer_state_bytes"] + critic_state
  assert critic["temp_bytes"] > 0 and critic["fits"] and report["fits"]
  grpo = plan(load_config(config, [], required=()), topology("cpu:8"), sampler=False)
  assert grpo["critic"] is None and grpo["learner"]["resident_bytes"] == 0
  assert grpo["learner"]["total_bytes"] == learner["total_bytes"] - critic_state
  cli.main(["plan", config, "learner.advantage=gae", "critic.micro_batch_size=16", "--topology", "cpu:8"])
  assert "critic   micro-batch 16: parameters" in capsys.readouterr().out


def test_learner_step_memory_grows_linearly_in_length(tmp_path):
  """The compiled learner step (remat, 2 rows) at T = 4k and 8k: its temporaries about double
  from 4k to 8k with the blockwise attention; with the materialised einsum they quadruple."""
  from rft_jax.plan.devices import topology
  from rft_jax.plan.fit import plan
  from rft_jax.train.config import load_config

  config, model = _setup(tmp_path)

  def temp(t: int, kind: str) -> int:
    cfg = load_config(config, [f"model.attention={kind}", "data.prompts_per_step=1",
                               "sampling.n=2", "sampling.max_rollouts_per_call=null",
                               f"sampling.max_new_tokens={t - 16}", "learner.micro_batch_size=2"],
                      required=())
    return plan(cfg, topology("cpu:1"), sampler=False)["learner"]["temp_bytes"]

  blockwise = [temp(t, "blockwise") for t in (4096, 8192)]
  einsum = [temp(t, "reference") for t in (4096, 8192)]
  print(f"\n[learner temp MiB at T=4k/8k] blockwise {[b >> 20 for b in blockwise]}, "
        f"einsum {[b >> 20 for b in einsum]}")
  assert blockwise[1] / blockwise[0] < 2.5
  assert einsum[1] / einsum[0] > 3.5  # the check tells quadratic from linear
  assert blockwise[1] < einsum[1] / 4


def test_layout_warnings_name_what_is_replicated():
  from rft_jax.plan.fit import layout_warnings

  qwen2_5_7b = QwenConfig.qwen2_5_7b()  # 28 query heads, 4 key/value heads
  assert layout_warnings(qwen2_5_7b, 1) == [] and layout_warnings(qwen2_5_7b, 4) == []
  warnings = layout_warnings(qwen2_5_7b, 8)
  assert len(warnings) == 2 and "28 query heads" in warnings[0] and "KV cache" in warnings[1]


def test_plan_says_when_it_does_not_fit(tmp_path, capsys):
  """A sampler call whose KV cache alone exceeds a fake device's share of host memory."""
  config, _ = _setup(tmp_path, new_tokens=2**18, head_dim=128)
  code, report = _plan(capsys, config, "--topology", "cpu:8")
  assert code == 1 and report["fits"] is False and report["sampler"]["fits"] is False
  assert report["sampler"]["kv_cache_bytes"] > report["hbm_bytes_per_device"]


def test_plan_errors_are_one_line(tmp_path, capsys):
  config, _ = _setup(tmp_path)
  assert cli.main(["plan", config, "--topology", "v99:1x1"]) == 2
  assert "v99:1x1" in capsys.readouterr().err
  assert cli.main(["plan", config, "--topology", "cpu:64"]) == 2
  assert "xla_force_host_platform_device_count=64" in capsys.readouterr().err
  assert cli.main(["plan", config, "model.path=", "--topology", "cpu:8"]) == 2
  assert "model.path is required" in capsys.readouterr().err


def test_a_program_the_compiler_refuses_for_memory_is_reported_as_not_fitting():
  """The TPU compiler refuses a program whose temporaries alone exceed the device (a 7B sampler
  call on v5e did): the plan reports the temporaries it names and 'does not fit', and any other
  compile error still surfaces."""
  message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
             "temporaries (52.22G) exceeds available HBM (15.75G).")

  def refused():
    raise jax.errors.JaxRuntimeError(message)

  report = _compiled_memory(refused, hbm=16 * GiB, resident=GiB)
  assert report["fits"] is False and report["compiler_refused"] == message
  assert report["temp_bytes"] == int(52.22 * GiB) and report["total_bytes"] == report["temp_bytes"] + GiB

  smem = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space smem. "
          "Used 1.00M of 1.00M smem. Exceeded smem capacity by 4.1K.")  # a paged-attention page table

  def refused_smem():
    raise jax.errors.JaxRuntimeError(smem + "\n  details")

  report = _compiled_memory(refused_smem, hbm=16 * GiB, resident=GiB)
  assert report["fits"] is False and report["compiler_refused"] == smem and report["temp_bytes"] == 0

  def broken():
    raise jax.errors.JaxRuntimeError("INTERNAL: something else")

  with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
    _compiled_memory(broken, hbm=16 * GiB)
