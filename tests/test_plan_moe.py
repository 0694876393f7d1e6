"""`rft-jax plan` of a mixture-of-experts model (issue 54, point 2): the plan compiles, the routed
experts come out sharded over the mesh, and the report counts the parameters as the config says,
every one and those a token uses."""

from __future__ import annotations

import json
import os

import jax
from flax import nnx

from rft_jax import cli
from rft_jax.models import QwenConfig
from rft_jax.models.hf import abstract_model, read_config
from rft_jax.parallel import make_mesh, state_shardings, with_shardings
from rft_jax.plan.fit import layout_warnings
from rft_jax.plan.parameters import parameter_report
from rft_jax.plan.report import format_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = """
model: {{path: {model}, dtype: float32, param_dtype: float32, remat: true}}
data: {{prompts_per_step: 4, max_prompt_len: 16}}
sampling: {{n: 4, max_new_tokens: 16, max_rollouts_per_call: 8}}
learner: {{micro_batch_size: 16, entropy_mask: {{kind: clip_b, mu_low: 2.5}}}}
mesh: {{model: 2}}
"""


def moe_counts(d: dict) -> tuple[int, int]:
  """Every parameter and those one token uses, from an HF Qwen3-MoE ``config.json`` dict alone:
  per layer the attention (q, k, v, o; q and k norms), two norms, the router and E experts of
  three ``D x I`` matrices; the embedding, the unembedding unless tied, the final norm. A token
  uses k of the E experts."""
  D, L, E, k, I = (d[key] for key in ("hidden_size", "num_hidden_layers", "num_experts",
                                      "num_experts_per_tok", "moe_intermediate_size"))
  N, K, H, V = d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"], d["vocab_size"]
  attention = D * N * H + 2 * D * K * H + N * H * D + 2 * H
  layer = attention + 2 * D + D * E + 3 * E * D * I
  total = V * D * (1 if d["tie_word_embeddings"] else 2) + D + L * layer
  return total, total - L * 3 * (E - k) * D * I


def test_qwen3_30b_a3b_counts_and_expert_shards_from_its_config_json():
  """The shipped config.json of Qwen3-30B-A3B: 30.5B parameters, 3.35B active per token (Qwen's
  model card: 30.5B, 3.3B activated), and its 128 experts per layer over a data=2 x model=4 mesh,
  each device holding 32 experts' halves: an eighth of their bytes. Shapes only, nothing compiled."""
  path = os.path.join(ROOT, "configs", "models", "Qwen3-30B-A3B")
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  config = read_config(path)
  abstract = nnx.state(abstract_model(config))
  mesh = make_mesh(data=2, model=4, devices=jax.devices()[:8])
  report = parameter_report(with_shardings(abstract, state_shardings(abstract, mesh)), config)
  total, active = moe_counts(hf)
  assert (report["parameters"], report["active_parameters"]) == (total, active)
  assert round(total / 1e9, 1) == 30.5 and round(active / 1e9, 2) == 3.35
  experts = report["groups"]["routed experts"]
  assert experts["parameters"] == 48 * 3 * 128 * 2048 * 768
  assert experts["bytes_per_device"] * 8 == experts["bytes"]
  assert sorted(experts["specs"]) == ["P(None, 'model', 'data', None)", "P(None, 'model', None, 'data')"]
  assert layout_warnings(config, 4) == []  # 32 heads, 4 KV heads, 128 experts: all divide


def test_plan_of_a_tiny_moe_compiles_with_experts_over_the_model_axis(tmp_path, capsys):
  """A tiny Qwen3-MoE (8 experts, 2 per token) planned from its config.json on cpu:8, mesh
  data=4 x model=2: the learner step (Clip_B) and the sampler compile and fit; the report counts
  the parameters as :func:`moe_counts` does, and the experts' bytes per device are an eighth of
  theirs (4 experts per device over model, the hidden width over data)."""
  config = QwenConfig("qwen3_moe", 256, 64, 96, 2, 4, 2, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
  model = tmp_path / "model"
  model.mkdir()
  hf = config.to_hf_dict()
  (model / "config.json").write_text(json.dumps(hf))
  run = tmp_path / "run.yaml"
  run.write_text(CONFIG.format(model=model))
  code = cli.main(["plan", str(run), "--topology", "cpu:8", "--json"])
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert code == 0 and report["fits"] and report["mesh"] == {"data": 4, "model": 2}
  assert report["model"]["experts"] == 8 and report["model"]["experts_per_token"] == 2
  p = report["parameters"]
  assert (p["parameters"], p["active_parameters"]) == moe_counts(hf)
  assert p["parameters"] == report["learner"]["trainable_parameters"]
  experts = p["groups"]["routed experts"]
  assert experts["parameters"] == 2 * 3 * 8 * 64 * 32
  assert experts["bytes_per_device"] * 8 == experts["bytes"] == experts["parameters"] * 4
  assert all(spec.startswith("P(None, 'model'") for spec in experts["specs"])
  assert report["learner"]["temp_bytes"] > 0 and report["sampler"]["temp_bytes"] > 0
  line = next(l for l in format_report(report).splitlines() if l.startswith("params"))
  assert f"{p['active_parameters'] / 1e6:.3g}M active per token: 2 of 8 experts" in line
  assert "routed experts" in line and "P(None, 'model'" in line


def test_layout_warnings_of_an_moe_model_name_experts_that_do_not_divide():
  """Experts that do not divide mesh.model go over it by their width; only when neither
  divides are they replicated, and the warning says so (the dense MLP width is not warned on)."""
  config = QwenConfig("qwen3_moe", 256, 64, 96, 2, 4, 2, head_dim=16, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=30, norm_topk_prob=True)
  assert layout_warnings(config, 2) == []
  assert layout_warnings(config, 4) == [
      "2 key/value heads do not divide mesh.model=4: those weights and the KV cache are "
      "replicated over 'model'",
      "6 routed experts (nor their width) do not divide mesh.model=4: those weights are "
      "replicated over 'model'"]
