"""Bad input is one error naming the file and the line, row or key -- never a traceback of a
library: the types ``rft-jax`` turns into one line (ConfigError, DatasetError, CheckpointError)."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rft_jax.data import DatasetError, load_math_dataset
from rft_jax.models import CheckpointError, QwenConfig, load_hf, load_tokenizer, read_config
from rft_jax.train.config import ConfigError, load_config

REQUIRED = ["model.path=/m", "data.train_path=/d.jsonl"]
ROW = {"question": "q", "answer": "1"}


def write(tmp_path, name, content):
  path = tmp_path / name
  path.write_bytes(content if isinstance(content, bytes) else content.encode())
  return str(path)


# ----------------------------------------------------------------------------- config YAML

@pytest.mark.parametrize("text,message", [
    ("steps: 3\nlearner:\n  lr: [1\n", r"line 4, column 1: did not find expected ',' or '\]' "
                                         r"\(while parsing a flow sequence at line 3, column 7\)"),
    ("steps: 3\n  seed: 1\n", r"line 2, column 7: mapping values are not allowed"),
    ("steps: 3\nsteps: 4\n", r"line 2, column 1: found duplicate key steps"),
])
def test_malformed_yaml_names_the_file_and_line(tmp_path, text, message):
  path = write(tmp_path, "c.yaml", text)
  with pytest.raises(ConfigError, match=r"c\.yaml: malformed YAML: " + message):
    load_config(path, REQUIRED)


def test_yaml_that_is_not_utf8_a_mapping_or_a_file(tmp_path):
  with pytest.raises(ConfigError, match=r"c\.yaml: line 2: not UTF-8 text \(byte 0xff\)"):
    load_config(write(tmp_path, "c.yaml", b"steps: 3\nrun_dir: a\xffb\n"), REQUIRED)
  with pytest.raises(ConfigError, match=r"l\.yaml: the top level must be a mapping .* not a list"):
    load_config(write(tmp_path, "l.yaml", "- steps: 3\n"), REQUIRED)
  with pytest.raises(ConfigError, match=r"cannot read the config file \(Is a directory\)"):
    load_config(str(tmp_path), REQUIRED)
  assert load_config(write(tmp_path, "e.yaml", "# nothing set\n"), REQUIRED).steps == 100


def test_override_that_is_not_yaml_names_the_override():
  with pytest.raises(ConfigError, match=r"override 'learner\.optim\.lr=\[1': the value is not valid YAML"):
    load_config(None, REQUIRED + ["learner.optim.lr=[1"])


def test_checks_of_the_yaml_values_name_the_file(tmp_path):
  with pytest.raises(ConfigError, match=r"c\.yaml: sampling\.n=1: group advantages"):
    load_config(write(tmp_path, "c.yaml", "sampling:\n  n: 1\n"), REQUIRED)


# ----------------------------------------------------------------------------- data files

@pytest.mark.parametrize("content", [b"", b"\n  \n"], ids=["no-bytes", "blank-lines"])
def test_empty_data_file(tmp_path, content):
  with pytest.raises(DatasetError, match=r"d\.jsonl: the file is empty \(no rows\)"):
    load_math_dataset(write(tmp_path, "d.jsonl", content))


def test_empty_parquet_file(tmp_path):
  path = str(tmp_path / "d.parquet")
  pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)
  with pytest.raises(DatasetError, match=r"d\.parquet: no rows"):
    load_math_dataset(path)


def test_non_utf8_byte_names_the_line_and_row(tmp_path):
  good = json.dumps(ROW).encode()
  path = write(tmp_path, "d.jsonl", good + b"\n\n" + good + b"\n" + b'{"question": "q\xff", "answer": "2"}\n')
  with pytest.raises(DatasetError, match=r"d\.jsonl: line 4 \(row 2\): not UTF-8 text \(byte 0xff at column 16\)"):
    load_math_dataset(path)


def test_non_utf8_string_in_a_parquet_file_names_the_row(tmp_path):
  text = pa.StringArray.from_buffers(2, pa.py_buffer(np.array([0, 2, 4], np.int32).tobytes()),
                                     pa.py_buffer(b"okq\xff"))  # arrow does not validate here
  path = str(tmp_path / "d.parquet")
  pq.write_table(pa.table({"question": text, "answer": pa.array(["1", "2"])}), path)
  with pytest.raises(DatasetError, match=r"d\.parquet: row 1: not UTF-8 text"):
    load_math_dataset(path)


def test_malformed_json_line_names_the_line(tmp_path):
  lines = [json.dumps(ROW), json.dumps(ROW), '{"question": "q", answer: 3}']
  with pytest.raises(DatasetError, match=r"d\.jsonl: line 3 \(row 2\): not valid JSON"):
    load_math_dataset(write(tmp_path, "d.jsonl", "\n".join(lines) + "\n"))
  with pytest.raises(DatasetError, match=r"e\.jsonl: line 2 \(row 1\): not a JSON object \(a list\)"):
    load_math_dataset(write(tmp_path, "e.jsonl", json.dumps(ROW) + "\n[1, 2]\n"))


def test_a_json_line_cut_short_or_with_a_repeated_key_is_named_alone(tmp_path, capfd):
  """A line whose closing brace is missing was reported at "column 1" (the newline's); a key
  given twice as pyarrow's "Trailing data at position 32"; and ``datasets`` logged two lines of
  its own before the error."""
  capfd.readouterr()
  cut = '{"question": "q", "answer": "2"'
  with pytest.raises(DatasetError) as exc:
    load_math_dataset(write(tmp_path, "d.jsonl", f"{json.dumps(ROW)}\n{cut}\n{json.dumps(ROW)}\n"))
  assert str(exc.value) == (f"{tmp_path / 'd.jsonl'}: line 2 (row 1): not valid JSON (Expecting ',' delimiter "
                            f"at column {len(cut) + 1}, the end of the line)")
  with pytest.raises(DatasetError, match=r"e\.jsonl: line 2 \(row 1\): the key 'question' appears twice"):
    load_math_dataset(write(tmp_path, "e.jsonl", json.dumps(ROW) + '\n{"question": "q", "answer": "1", "question": 3}\n'))
  assert capfd.readouterr().err == ""  # the error is the one line; datasets says nothing of its own


def test_a_file_with_no_usable_row_is_an_error_even_when_skipping(tmp_path):
  path = write(tmp_path, "d.jsonl", json.dumps({"question": "q", "answer": ""}) + "\n")
  with pytest.raises(DatasetError, match=r"d\.jsonl: none of its 1 rows has a question and an answer"):
    load_math_dataset(path, on_bad_row="skip")


# ----------------------------------------------------------------------------- model directory

@pytest.mark.parametrize("content,message", [
    (b'{"model_type": "qwen2",\n "vocab_size": }', r"not valid JSON: line 2, column 16"),
    (b'[1, 2]', r"the top level must be a JSON object, not a list"),
    (b'{"model_type": "qwen2", "hidden_size": 32}',
     r"missing key\(s\) vocab_size, intermediate_size, num_hidden_layers, num_attention_heads"),
    (b'{"model_type": "qwen2", "vocab_size": 8, "hidden_size": "32", "intermediate_size": 8, '
     b'"num_hidden_layers": 1, "num_attention_heads": 2}', r"hidden_size='32' must be a positive integer"),
    (b'{"model_type": "qwen2", "vocab_size": 8, "hidden_size": 32, "intermediate_size": 8, '
     b'"num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 2}',
     r"num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    (b'{"model_type": "qwen2", "name": "\xff"}', r"not UTF-8 text"),
])
def test_invalid_config_json_names_its_path(tmp_path, content, message):
  (tmp_path / "config.json").write_bytes(content)
  with pytest.raises(CheckpointError, match=rf"{tmp_path}/config\.json: {message}"):
    read_config(tmp_path)
  with pytest.raises(CheckpointError, match=rf"{tmp_path}/config\.json: "):
    load_hf(tmp_path)


def test_from_hf_dict_keeps_its_runtime_errors_apart():
  with pytest.raises(ValueError, match="attention='flash'") as info:
    QwenConfig.from_hf_dict(QwenConfig.qwen2_5_0_5b().to_hf_dict(), attention="flash")
  assert not isinstance(info.value, CheckpointError)


def test_invalid_safetensors_index_names_its_path(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(QwenConfig.qwen2_5_0_5b().to_hf_dict()))
  (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": [')
  with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not a safetensors index"):
    load_hf(tmp_path)


def test_a_directory_without_tokenizer_files_is_an_error_not_an_empty_tokenizer(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(QwenConfig.qwen2_5_0_5b().to_hf_dict()))
  with pytest.raises(CheckpointError, match=rf"{tmp_path}: no tokenizer \(none of tokenizer\.json"):
    load_tokenizer(tmp_path)
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(CheckpointError, match=rf"{tmp_path}: the tokenizer cannot be loaded"):
    load_tokenizer(tmp_path)
