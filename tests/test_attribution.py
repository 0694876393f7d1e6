"""Token-level attribution (``rft_jax.analysis.attribution``): each completion token's Theorem 2
forecast, the marked entropy mask, the class table and the page."""

from __future__ import annotations

import numpy as np
import pytest

from loop_fixtures import make_loop_files
from rft_jax.analysis.attribution import attribute, attribution_html, class_table
from rft_jax.data import MathExample
from rft_jax.demo.task import token_class
from rft_jax.models import load_hf, load_tokenizer
from rft_jax.rewards import RewardConfig
from rft_jax.rl.config import EntropyMaskConfig


def test_demo_token_classes_find_the_digits_that_receive_a_carry():
  problem = MathExample(question="What is 47 + 85?", answer="132", id="47+85")  # units and tens carry
  text = "47+85=132. \\boxed{132}"
  classes = [token_class(problem, text, i, i + 1) for i in range(len(text))]
  assert classes[:6] == ["operand digit"] * 2 + ["separator"] + ["operand digit"] * 2 + ["separator"]
  # 132: the hundreds and tens digits receive the carries of columns 1 and 0; the units none.
  assert classes[6:9] == ["carry digit", "carry digit", "sum digit"]
  assert classes[-4:-1] == ["carry digit", "carry digit", "sum digit"]
  assert token_class(MathExample("What is 12 + 3?", "15", "7"), "12+3=15", 5, 6) == "sum digit"  # from the question


@pytest.fixture(scope="module")
def attributed(tmp_path_factory):
  _, model_dir, _ = make_loop_files(tmp_path_factory.mktemp("attr"))
  model, tokenizer = load_hf(model_dir), load_tokenizer(model_dir)
  problems = [MathExample("what is 1+1 ?", "2", "a"), MathExample("1+1 ?", "1", "b")]
  # An untrained model's rewards all agree (zero advantages): a reward function of the length
  # gives the groups spread instead.
  rewards = RewardConfig(num_workers=1, functions=("reward_fixtures:odd_length",))
  mask = EntropyMaskConfig(kind="clip_b", mu_low=0.3, samples="all")
  out = attribute(model, tokenizer, problems, prompt_fn=lambda q: tokenizer(q)["input_ids"], k=4,
                  temperature=1.0, max_new_tokens=6, stop_ids=(), rewards=rewards, lr=1e-3, mask=mask)
  return out


def test_every_token_carries_its_theorem_2_forecast(attributed):
  assert len(attributed) == 8 and any(c.advantage != 0 for c in attributed)
  for c in attributed:
    assert len(c.tokens) == len(c.classes) == len(c.forecast) == 6
    assert np.all((c.p > 0) & (c.p <= 1)) and np.all(c.entropy >= 0)
    np.testing.assert_allclose(c.s_star, c.p * (c.entropy + np.log(c.p)), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(c.forecast, -1e-3 * c.advantage * (c.s_star - c.expected_s), rtol=1e-4, atol=1e-12)
  assert any(c.masked.any() for c in attributed)
  assert not any(c.masked.any() for c in attributed if c.advantage == 0)  # the mask reads A's sign


def test_the_class_table_and_the_page(attributed):
  table = class_table(attributed)
  assert sum(r["tokens"] for r in table) == 48
  total = sum(float(c.forecast.sum()) for c in attributed)
  assert sum(r["grpo"] for r in table) == pytest.approx(total, rel=1e-5, abs=1e-12)
  kept = sum(float(c.forecast[~c.masked].sum()) for c in attributed)
  assert sum(r["kept"] for r in table) == pytest.approx(kept, rel=1e-5, abs=1e-12)
  page = attribution_html([("start", attributed)], "Clip_B")
  assert page.count("<span") - page.count('<span class="meta"') == 48
  assert page.count('class="masked"') == sum(int(c.masked.sum()) for c in attributed)
  assert "E_p[S]=" in page and "<table>" in page
  assert "Outlined tokens are those Clip_B would take out" in page and "<th>Clip_B masks</th>" in page
  unmasked = attribution_html([("start", attributed)], None)  # a run without a mask: none named
  assert "Outlined tokens are those" not in unmasked and "masks</th>" not in unmasked
  assert "No entropy mask is marked: the run used none" in unmasked


def test_the_attribute_command_writes_the_page(tmp_path, capsys):
  from rft_jax import cli

  root, model_dir, data = make_loop_files(tmp_path)
  out = tmp_path / "page.html"
  assert cli.main(["attribute", "--model", str(model_dir), "--data", str(data), "--problems", "2", "--k", "2",
                   "--max-new-tokens", "4", "--out", str(out)]) == 0
  assert capsys.readouterr().out.strip() == str(out)
  page = out.read_text()
  assert page.count("title=") == 2 * 2 * 4  # every token of 2 x 2 answers
  # an HF directory trained with no mask: none is marked or named (--mask KIND marks one)
  assert "No entropy mask is marked" in page and "Clip_B masks" not in page and 'class="masked"' not in page
  assert cli.main(["attribute", "--model", str(model_dir), "--data", str(data), "--token-classes", "nowhere:f"]) == 2
  assert "--token-classes" in capsys.readouterr().err
