"""The config tree: YAML + dotted overrides into dataclasses, with errors naming the key."""

import glob
import logging
import os
import re

import pytest

from rft_jax.train.config import ConfigError, TrainConfig, load_config
from rft_jax.train.resolve import sampling_params

REQUIRED = ["model.path=/m", "data.train_path=/d.jsonl"]


def write(tmp_path, text):
  path = tmp_path / "c.yaml"
  path.write_text(text)
  return str(path)


def test_yaml_and_overrides_merge_into_dataclasses(tmp_path):
  path = write(tmp_path, "steps: 7\nlearner:\n  lr: 2.0e-6\n  entropy_mask:\n    kind: clip_b\n")
  cfg = load_config(path, REQUIRED + ["sampling.n=4", "learner.micro_batch_size=4"])
  assert isinstance(cfg, TrainConfig)
  assert cfg.steps == 7 and cfg.learner.optim.lr == 2e-6 and cfg.sampling.n == 4
  assert cfg.learner.entropy_mask.kind == "clip_b" and cfg.learner.entropy_mask.resolved_mu_low == 2.5
  assert cfg.learner.temperature == cfg.sampling.temperature  # derived, one source of truth
  assert cfg.learner.max_len == cfg.sampling.max_new_tokens
  # `key=` on the command line is the empty string (compilation cache off, no instruction)
  cfg = load_config(path, REQUIRED + ["compilation_cache_dir=", "data.instruction=", "learner.entropy_mask.mu_low=null"])
  assert cfg.compilation_cache_dir == "" and cfg.data.instruction == "" and cfg.learner.entropy_mask.mu_low is None


@pytest.mark.parametrize("override,message", [
    ("learner.lrr=1", "lrr"),
    ("learner.optim.lr=fast", "learner.optim.lr"),
    ("sampling.n=1", "sampling.n=1"),
    ("learner.micro_batch_size=7", "do not split"),
    ("learner.temperature=0.5", "learner.temperature=0.5 differs from sampling.temperature"),
    ("learner.entropy_mask.kind=clipb", "entropy_mask.kind='clipb'"),
    ("rewards.scheme=nope", "nope"),
    ("model.dtype=float16", "model.dtype"),
    ("steps", "not of the form key=value"),
])
def test_bad_values_name_the_key(override, message):
  with pytest.raises(ConfigError, match=message):
    load_config(None, REQUIRED + [override])


def test_required_paths_and_missing_file(tmp_path):
  with pytest.raises(ConfigError, match="model.path is required"):
    load_config(None, ["data.train_path=/d"])
  with pytest.raises(ConfigError, match="config file not found"):
    load_config(str(tmp_path / "none.yaml"), REQUIRED)
  with pytest.raises(ConfigError, match=r"c.yaml: .*typo"):
    load_config(write(tmp_path, "typo: 1\n"), REQUIRED)


def test_errors_name_where_the_bad_value_came_from(tmp_path):
  """A value given on the command line is reported as the command line's (its override named),
  one in the YAML file as the file's, whatever else the other holds."""
  path = write(tmp_path, "steps: 3\nlearner:\n  lr: 2.0e-6\n")
  for overrides, source in ((["learner.optim.lr=1e39"], "the command line (learner.optim.lr=1e39): learner.optim.lr must be"),
                            (["steps=0"], "the command line (steps=0): steps must be > 0"),
                            (["sampling.n=x"], "the command line (sampling.n=x): Value 'x'"),
                            (["learner.micro_batch_size=7"], "the command line (learner.micro_batch_size=7): "
                                                             "data.prompts_per_step x sampling.n")):
    with pytest.raises(ConfigError) as raised:
      load_config(path, REQUIRED + overrides)
    assert str(raised.value).startswith(source) and "c.yaml" not in str(raised.value), raised.value
  bad = write(tmp_path, "steps: 3\nlearner:\n  lr: 1.0e39\n")
  for overrides in ([], ["steps=2"]):  # an unrelated override does not take the blame
    with pytest.raises(ConfigError, match=rf"^{bad}: learner.optim.lr must be a finite number in \(0, 1\], got 1e\+39$"):
      load_config(bad, REQUIRED + overrides)
  assert load_config(bad, REQUIRED + ["learner.optim.lr=1e-3"]).learner.optim.lr == 1e-3  # the command line wins
  typo = write(tmp_path, "sampling:\n  n: x\n")
  with pytest.raises(ConfigError, match=rf"^{typo}: Value 'x'"):
    load_config(typo, REQUIRED + ["steps=2"])


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "qwen*.yaml"))),
                         ids=os.path.basename)
def test_shipped_configs_load_once_paths_are_set(path):
  cfg = load_config(path, REQUIRED)
  assert cfg.data.prompts_per_step == 64 and cfg.learner.optim.lr == 4e-7
  assert cfg.sampling.temperature == 1.0 and cfg.eval.temperature == 0.7
  assert cfg.sampling.n == (16 if "qwen2_5" in path else 8)
  # Paged KV cache, all of a step's rollouts in one call: the dense continuous pool of a call's
  # rows at the full 8k does not fit a v5p chip (docs/scale.md).
  assert cfg.sampling.kv_pages and cfg.sampling.max_rollouts_per_call is None
  assert sampling_params(cfg, (2,)).kv_pages == cfg.sampling.kv_pages
  # qwen2_5_7b_kl_cov: kl_cov; qwen3_30b_a3b_clip_b_lora: clip_b (LoRA on the attention)
  name = re.sub(r"^qwen[\d_]+b_(a\d+b_)?", "", os.path.basename(path)[:-len(".yaml")])
  if name.endswith("_lora"):
    name = name[:-len("_lora")]
    assert cfg.model.lora is not None and "q_proj" in cfg.model.lora.targets
  method = ("entropy_mask", name) if name in ("clip_b", "clip_v") else ("entropy_method", name)
  if name.startswith("ppo"):  # PPO with a critic, alone or with a mask
    assert cfg.learner.advantage == "gae" and cfg.critic.cliprange_value == 0.5
    name = name[len("ppo_"):] if name != "ppo" else "grpo"
    method = ("entropy_mask", name)
  if name == "unlikely":
    assert cfg.learner.beta_rank == 0.25 and cfg.learner.entropy_method.kind == "none"
  elif name == "gspo":  # an objective, with its own clip (rft_jax/rl/objectives/gspo.py)
    assert cfg.learner.objective == "gspo" and cfg.learner.mini_batches > 1
    assert (cfg.learner.resolved_eps_low, cfg.learner.resolved_eps_high) == (3e-4, 4e-4)
  elif name != "grpo":
    assert getattr(cfg.learner, method[0]).kind == method[1]
  if name == "clip_cov":  # verl's 7B recipe clips at 1 (recipe/entropy/7b_clip_cov.sh)
    assert (cfg.learner.resolved_eps_low, cfg.learner.resolved_eps_high) == (1.0, 1.0)


def test_demo_config_loads_and_its_batches_split_on_eight_devices():
  cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml"))
  assert cfg.model.path.endswith(os.path.join("rft_jax", "demo", "checkpoint")) and cfg.data.instruction == ""
  assert os.path.isabs(cfg.model.path)  # resolved against the current directory when loaded
  assert (cfg.data.prompts_per_step * cfg.sampling.n) % (cfg.learner.micro_batch_size * cfg.learner.mini_batches) == 0
  assert cfg.learner.micro_batch_size % 8 == 0


def test_optimizer_settings_live_under_optim_and_old_flat_keys_still_load(tmp_path, caplog):
  """``learner.optim`` and ``critic.optim`` are one ``OptimizerConfig``; a config or run directory
  written with the old flat keys (``learner.lr``) loads, with one notice per source."""
  old = write(tmp_path, "steps: 5\nlearner:\n  lr: 2.0e-6\n  b1: 0.8\n  mini_batches: 2\n"
                        "critic:\n  weight_decay: 0.1\n")
  with caplog.at_level(logging.WARNING, logger="rft_jax.train.renamed_keys"):
    cfg = load_config(old, REQUIRED + ["learner.adam_eps=1e-6"])
  assert (cfg.learner.optim.lr, cfg.learner.optim.b1, cfg.learner.optim.adam_eps) == (2e-6, 0.8, 1e-6)
  assert (cfg.critic.optim.weight_decay, cfg.critic.optim.lr) == (0.1, 1e-5)  # the critic's own defaults
  assert [r.getMessage() for r in caplog.records] == [
      "the command line: learner.adam_eps is deprecated: use learner.optim.adam_eps",
      f"{old}: learner.lr, learner.b1, critic.weight_decay are deprecated: use learner.optim.lr, "
      "learner.optim.b1, critic.optim.weight_decay"]
  # total_steps: with a decaying schedule, the run's optimizer updates unless set.
  assert (cfg.learner.optim.total_steps, cfg.critic.optim.total_steps) == (None, None)  # constant
  cosine = ["learner.optim.schedule=warmup_cosine", "critic.optim.schedule=warmup_cosine"]
  cfg = load_config(old, REQUIRED + cosine)
  assert (cfg.learner.optim.total_steps, cfg.critic.optim.total_steps) == (5 * 2, 5)
  assert load_config(old, REQUIRED + cosine + ["learner.optim.total_steps=3"]).learner.optim.total_steps == 3
  # An old config.yaml wrote total_steps: 1000 with every schedule; it counted only for a decay.
  for schedule, kept in (("constant", None), ("warmup_cosine", 1000)):
    dump = write(tmp_path, f"learner:\n  schedule: {schedule}\n  total_steps: 1000\n")
    assert load_config(dump, REQUIRED).learner.optim.total_steps == kept
  # One check for both optimizers (critic.b1=1.5 was refused while learner.b1=1.5 was accepted).
  for override in ("learner.optim.b1=1.5", "critic.optim.b1=1.5", "learner.b1=1.5", "critic.b1=1.5"):
    section = override.split(".")[0]
    with pytest.raises(ConfigError, match=rf"{section}.optim.b1 must be in \[0, 1\), got 1.5"):
      load_config(None, REQUIRED + [override])


def test_an_old_run_directory_with_flat_optimizer_keys_is_compared_by_the_new_keys(tmp_path):
  """A ``config.yaml`` written before ``learner.optim`` existed (flat keys, ``total_steps: 1000``)
  resumes with the same settings, and a changed learning rate is still refused by name."""
  from omegaconf import OmegaConf

  from rft_jax.train.renamed_keys import rename_keys
  from rft_jax.train.run_dir import config_changes

  cfg = load_config(None, REQUIRED + ["learner.optim.lr=2e-6"])
  old = OmegaConf.to_container(OmegaConf.structured(cfg))
  optim = old["learner"].pop("optim")
  old["learner"].update(optim, total_steps=1000)  # the old layout
  renamed = OmegaConf.to_container(rename_keys(OmegaConf.create(old), "config.yaml"))
  assert config_changes(renamed, cfg) == []
  changed = load_config(None, REQUIRED + ["learner.optim.lr=3e-6"])
  assert config_changes(renamed, changed) == [("learner.optim.lr", 2e-6, 3e-6)]


def test_the_sampling_section_is_sampling_params_every_setting_reachable(tmp_path):
  """``sampling`` is :class:`SamplingParams` itself: every one of its settings is a config key
  (the pool's stages and the cache segments too), checked once, by SamplingParams, with the
  error naming the key; the run's stop tokens are the tokenizer's, then the configured ones."""
  import dataclasses

  from rft_jax.sampling import SamplingParams
  from rft_jax.train.config import config_keys

  assert type(TrainConfig().sampling) is SamplingParams
  keys = dict(config_keys())
  assert {f"sampling.{f.name}" for f in dataclasses.fields(SamplingParams)} <= set(keys)
  cfg = load_config(None, REQUIRED + ["sampling.pool_stages=3", "sampling.cache_segments=2",
                                      "sampling.min_segment_tokens=32", "sampling.stop_token_ids=[7,2]"])
  params = sampling_params(cfg, (2, 5))
  assert (params.pool_stages, params.cache_segments, params.min_segment_tokens) == (3, 2, 32)
  assert params.stop_token_ids == (2, 5, 7) and (params.n, params.max_new_tokens) == (16, 1024)
  for override, message in [("sampling.pool_stages=0", r"sampling\.pool_stages=0 must be >= 1"),
                            ("sampling.scheduler=eager", r"sampling\.scheduler='eager' is not one of"),
                            ("sampling.stop_token_ids=[-1]", r"sampling\.stop_token_ids\[0\]=-1")]:
    with pytest.raises(ConfigError, match=rf"the command line \({re.escape(override)}\): {message}"):
      load_config(None, REQUIRED + [override])
  # A run directory's config from before the section was SamplingParams loads as it was.
  path = write(tmp_path, "sampling:\n  n: 8\n  scheduler: static\n  decode_slots: null\n")
  assert load_config(path, REQUIRED).sampling == SamplingParams(n=8, max_new_tokens=1024,
                                                                 scheduler="static")


def test_routing_replay_without_recorded_routing_is_refused_when_the_config_loads(capsys):
  """``learner.routing_replay`` replays the experts the sampler recorded: with
  ``sampling.record_routing=false`` there are none, so the config check refuses the pair (one line
  naming both keys; the CLI's config error, exit 2) instead of the learner's first step."""
  from rft_jax import cli

  pair = ["learner.routing_replay=true", "sampling.record_routing=false"]
  with pytest.raises(ConfigError, match=r"learner\.routing_replay=true with sampling\.record_routing=false") as raised:
    load_config(None, REQUIRED + pair)
  assert "\n" not in str(raised.value)
  assert load_config(None, REQUIRED + pair[:1]).learner.routing_replay  # recording is on by default
  assert load_config(None, REQUIRED + pair[1:]).sampling.record_routing is False
  assert cli.main(["train", "--print-config", *pair, "model.path=m"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("rft-jax train: error: ") and "sampling.record_routing=false" in err
  assert len(err.strip().splitlines()) == 1
