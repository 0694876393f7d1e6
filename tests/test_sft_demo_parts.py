"""The demo's building blocks: the synthetic task, the character tokenizer, SFT."""

import numpy as np
import pytest
from flax import nnx

from rft_jax.demo.build import demo_model_config
from rft_jax.demo.task import (SFT_SEED, addition_problems, carrying_columns, heldout_problems, slipped_sum,
                               worked_answer)
from rft_jax.demo.tokenizer import build_char_tokenizer
from rft_jax.models import Qwen, chat_token_ids, load_tokenizer
from rft_jax.rewards import RewardConfig, score_batch
from rft_jax.train.sft import SFTConfig, encode_pairs, sft


def test_task_is_deterministic_and_graded_by_the_math_reward():
  a, b = addition_problems(50, seed=1), addition_problems(50, seed=1)
  assert a == b and len({p.id for p in a}) == 50
  assert all(int(p.answer) == sum(map(int, p.id.split("+"))) for p in a)
  texts = [worked_answer(p) for p in a[:4]] + ["no box " + a[4].answer]
  result = score_batch(texts, [p.answer for p in a[:5]], ["stop"] * 5, [10] * 5, RewardConfig(num_workers=1))
  assert result.reward.tolist() == [1, 1, 1, 1, 0]


def test_held_out_problems_are_in_no_training_set(tmp_path):
  from rft_jax.demo.run import write_demo_data
  held = {p.id for p in heldout_problems()}
  assert len(held) == 256
  warm_start = addition_problems(8000, seed=SFT_SEED, exclude=held)  # the build's problems
  assert len({p.id for p in warm_start}) == 8000 and not held & {p.id for p in warm_start}
  train_path, heldout_path = write_demo_data(str(tmp_path), train_size=2000)
  read = lambda path: {line.split('"id": "')[1].split('"')[0] for line in open(path)}
  assert read(heldout_path) == held and len(read(train_path)) == 2000 and not held & read(train_path)
  with pytest.raises(ValueError, match="only 100"):
    addition_problems(100, seed=0, max_digits=1, exclude={"1+2"})


def test_a_slipping_teacher_forgets_exactly_one_carry():
  rng = np.random.default_rng(0)
  assert (carrying_columns(12, 13), carrying_columns(47, 385), carrying_columns(95, 5)) == ([], [0, 1], [0, 1])
  assert slipped_sum(12, 13, rng) == 25  # no column carries: nothing to forget
  assert {slipped_sum(47, 385, rng) for _ in range(50)} == {422, 332}  # units or tens carry dropped
  assert {slipped_sum(95, 5, rng) for _ in range(50)} == {90, 0}
  problems = addition_problems(400, seed=2)
  answers = [worked_answer(p, slip_rate=0.5, rng=rng) for p in problems]
  wrong = [a for a, p in zip(answers, problems) if not a.endswith(f"{{{p.answer}}}")]
  carrying = [p for p in problems if slipped_sum(*map(int, p.id.split("+")), rng) != int(p.answer)]
  assert 0.35 < len(wrong) / len(carrying) < 0.65  # about half of the answers that can slip do
  assert all(a.split("=")[1].split(".")[0] == a.split("{")[1].rstrip("}") for a in answers)
  assert [worked_answer(p) for p in problems] == [worked_answer(p, slip_rate=0.0, rng=rng) for p in problems]


def test_char_tokenizer_round_trips_and_has_a_chat_template(tmp_path):
  build_char_tokenizer(str(tmp_path))
  tok = load_tokenizer(str(tmp_path))
  text = "What is 12 + 30? 12+30=42. \\boxed{42}"
  assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
  ids = chat_token_ids(tok, "What is 1 + 2?")
  assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.eos_token == "<|im_end|>"


def test_sft_lowers_the_response_loss(tmp_path):
  tok = build_char_tokenizer(str(tmp_path))
  config = demo_model_config(len(tok))
  model = Qwen(config.replace(num_hidden_layers=1, hidden_size=64, intermediate_size=128, head_dim=16), rngs=nnx.Rngs(0))
  problems = addition_problems(64, seed=0, max_digits=1)
  prompts = [chat_token_ids(tok, p.question) for p in problems]
  responses = [tok(worked_answer(p) + "<|im_end|>", add_special_tokens=False)["input_ids"] for p in problems]
  ids, mask, attention = encode_pairs(prompts, responses, max_len=64)
  assert mask.sum() == sum(len(r) for r in responses) and (attention.sum(1) == mask.sum(1) + [len(p) for p in prompts]).all()
  losses = []
  sft(model, ids, mask, attention, SFTConfig(steps=40, batch_size=16, lr=3e-3, warmup_steps=5),
      log=lambda step, loss: losses.append(loss))
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])


def _pairs(path, rows):
  import json

  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(path)


def test_sft_command_trains_from_files_and_reports_bad_rows(tmp_path, capsys):
  """``rft-jax sft``: HF directory + JSONL pairs in, a loadable HF directory out."""
  import re

  from rft_jax import cli
  from rft_jax.models import load_hf, save_hf

  init = str(tmp_path / "init")
  tok = build_char_tokenizer(init)
  config = demo_model_config(len(tok)).replace(num_hidden_layers=1, hidden_size=64,
                                               intermediate_size=128, head_dim=16)
  save_hf(Qwen(config, rngs=nnx.Rngs(0)), init, tokenizer=tok)
  problems = addition_problems(64, seed=0, max_digits=1)
  data = _pairs(tmp_path / "pairs.jsonl",
                [{"question": p.question, "response": worked_answer(p)} for p in problems])
  out = str(tmp_path / "out")
  args = ["sft", "--model", init, "--data", data, "--out", out, "--steps", "40",
          "--batch-size", "16", "--warmup-steps", "5", "--max-len", "64", "--log-every", "1",
          "--instruction", ""]  # as configs/demo.yaml (the training default would not fit max_len)
  assert cli.main(args) == 0
  printed = capsys.readouterr().out
  losses = [float(x) for x in re.findall(r"loss (\S+)", printed)]
  assert len(losses) == 40 and np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
  assert [int(n) for n in re.findall(r"sft step +(\d+)", printed)] == list(range(1, 41))  # from 1, as a run's
  trained = load_hf(out)
  assert trained.config == load_hf(init).config
  assert load_tokenizer(out).convert_tokens_to_ids("<|im_end|>") == tok.convert_tokens_to_ids("<|im_end|>")

  bad = _pairs(tmp_path / "bad.jsonl", [{"question": "What is 1 + 2?", "response": "3"},
                                        {"question": "What is 2 + 2?", "response": ""}])
  assert cli.main([*args[:4], bad, *args[5:]]) == 2
  assert "row 1: field 'response'" in capsys.readouterr().err
  assert cli.main([*args[:-4], "--max-len", "16", "--log-every", "1"]) == 2
  err = capsys.readouterr().err
  assert "row 0" in err and "exceed max_len=16" in err
  wrong_column = _pairs(tmp_path / "cols.jsonl", [{"question": "What is 1 + 2?", "answer": "3"}])
  assert cli.main([*args[:4], wrong_column, *args[5:]]) == 2
  assert "no column 'response'" in (err := capsys.readouterr().err) and "set --response-field" in err
