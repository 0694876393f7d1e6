"""Local dataset loading, the held-out split and the checkpointable prompt stream."""

import json

import datasets as hf_datasets
import pytest

from rft_jax.data import DatasetError, PromptStream, load_math_dataset, split_validation, tokenize_prompts


def write_jsonl(path, rows):
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  return str(path)


def test_published_formats_from_jsonl_parquet_and_disk(tmp_path):
  dapo = [{"prompt": f"What is {i}+1?", "solution": str(i + 1), "data_source": "x"} for i in range(5)]
  aime = [{"id": 60 + i, "problem": f"AIME {i}", "answer": str(100 + i), "year": 2024} for i in range(3)]
  examples, report = load_math_dataset(write_jsonl(tmp_path / "dapo.jsonl", dapo), "dapo_math_17k")
  assert [e.answer for e in examples] == ["1", "2", "3", "4", "5"] and report.kept == 5
  hf_datasets.Dataset.from_list(aime).to_parquet(str(tmp_path / "aime.parquet"))
  examples, _ = load_math_dataset(str(tmp_path / "aime.parquet"), "aime_2024")
  assert examples[1].question == "AIME 1" and examples[1].id == "61"
  hf_datasets.Dataset.from_list(aime).save_to_disk(str(tmp_path / "aime_dir"))
  examples, _ = load_math_dataset(str(tmp_path / "aime_dir"), "aime_2025")
  assert len(examples) == 3
  nested = [{"q": [{"role": "user", "content": "Solve"}], "reward_model": {"ground_truth": "7"}}]
  examples, _ = load_math_dataset(write_jsonl(tmp_path / "n.jsonl", nested), "jsonl",
                                  question_field="q", answer_field="reward_model.ground_truth")
  assert examples[0].question == "Solve" and examples[0].answer == "7"


def test_bad_rows_are_reported_with_index_and_field(tmp_path):
  rows = [{"question": "a", "answer": "1"}, {"question": "b", "answer": ""}, {"question": "c"},
          {"question": "d", "answer": "4"}]
  path = write_jsonl(tmp_path / "bad.jsonl", rows)
  with pytest.raises(DatasetError, match=r"bad.jsonl: row 1: field 'answer' \(answer\) is missing or empty"):
    load_math_dataset(path)
  examples, report = load_math_dataset(path, on_bad_row="skip")
  assert [e.question for e in examples] == ["a", "d"]
  assert [(i, f) for i, f, _ in report.skipped] == [(1, "answer"), (2, "answer")]
  assert report.rows == 4 and report.kept == 2


def test_missing_file_column_and_format_are_clear_errors(tmp_path):
  with pytest.raises(DatasetError, match="no such file"):
    load_math_dataset(str(tmp_path / "nope.jsonl"))
  path = write_jsonl(tmp_path / "cols.jsonl", [{"problem": "x", "answer": "1"}])
  with pytest.raises(DatasetError, match=r"no column 'question'.*columns: \['problem', 'answer'\]\); set data.question_field"):
    load_math_dataset(path)
  with pytest.raises(DatasetError, match="unknown dataset format 'dapo'"):
    load_math_dataset(path, "dapo")
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
    load_math_dataset(str(tmp_path / "x.csv"))


def test_validation_split_is_deterministic_and_disjoint(tmp_path):
  rows = [{"question": f"q{i}", "answer": str(i)} for i in range(50)]
  examples, _ = load_math_dataset(write_jsonl(tmp_path / "d.jsonl", rows))
  train, val = split_validation(examples, 10, seed=3)
  train2, val2 = split_validation(examples, 10, seed=3)
  assert val == val2 and train == train2 and len(val) == 10 and len(train) == 40
  assert not {e.id for e in train} & {e.id for e in val}
  assert split_validation(examples, 10, seed=4)[1] != val
  with pytest.raises(DatasetError, match=r"data\.val_size=50 \(validation size\) must be in \[0, 50\)"):
    split_validation(examples, 50, seed=0)


def test_prompt_stream_filters_long_prompts_and_resumes_across_epochs(tmp_path):
  rows = [{"question": "x" * (i % 7 + 1), "answer": str(i)} for i in range(10)]
  examples, _ = load_math_dataset(write_jsonl(tmp_path / "d.jsonl", rows))
  prompts, too_long = tokenize_prompts(examples, lambda q: [ord(c) for c in q], max_prompt_len=5)
  assert too_long == sum(1 for i in range(10) if i % 7 + 1 > 5) and len(prompts) == 10 - too_long
  stream = PromptStream(prompts, prompts_per_step=3, seed=0)
  seen = [[p.example.id for p in next(stream)] for _ in range(2)]  # one epoch = 2 batches of 3 of 8
  state = stream.get_state()
  rest = [[p.example.id for p in next(stream)] for _ in range(3)]
  resumed = PromptStream(prompts, prompts_per_step=3, seed=0)
  resumed.set_state(state)
  assert [[p.example.id for p in next(resumed)] for _ in range(3)] == rest
  first_epoch = [i for batch in seen for i in batch]
  assert len(set(first_epoch)) == 6  # no repeats within an epoch
  with pytest.raises(DatasetError, match="fewer than one batch"):
    PromptStream(prompts[:2], prompts_per_step=3, seed=0)
