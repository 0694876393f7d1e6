"""Tiny random Hugging Face Qwen checkpoints written to temporary directories (no downloads).

``make_tiny_qwen`` builds a ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` with transformers and
torch, gives every tensor (norm scales and biases included) random values so that a wrong
mapping shows in the logits, and saves it with ``save_pretrained``. ``hf_logits`` runs the
torch model as the reference. Reused by the model, sampler and learner tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _quiet_transformers() -> None:
  from transformers.utils import logging

  logging.disable_progress_bar()
  logging.set_verbosity_error()

# A Qwen2.5-style chat template (system default omitted), enough for prompt-format tests.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_hf_config(family: str = "qwen3", *, tie: bool = True, heads: int = 4,
                   kv_heads: int = 2, hidden: int = 32, layers: int = 2, vocab: int = 128,
                   intermediate: int = 64, head_dim: int | None = None,
                   attention_bias: bool = False, rope_theta: float = 10000.0):
  """A transformers ``Qwen2Config`` / ``Qwen3Config`` of toy size."""
  from transformers import Qwen2Config, Qwen3Config

  common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                tie_word_embeddings=tie, rms_norm_eps=1e-6, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
  if family == "qwen2":
    return Qwen2Config(**common)
  if family == "qwen3":
    return Qwen3Config(head_dim=head_dim or hidden // heads, attention_bias=attention_bias,
                       **common)
  raise ValueError(f"unknown family {family!r}")


def random_weights(model, unit_scale: tuple[str, ...] = ()) -> None:
  """Redraws every parameter of a torch ``model`` from the current seed, in order: norms about
  1 (``1 + 0.2 N(0, 1)``), parameters whose name ends with one of ``unit_scale`` ``N(0, 1)``
  (e.g. an MoE router, so that its top-k is distinct), the rest ``0.15 N(0, 1)``."""
  import torch

  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith(unit_scale):
        p.copy_(torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))


def make_tiny_qwen(root: Path, family: str = "qwen3", *, tie: bool = True, seed: int = 0,
                   max_shard_size: str | None = None, dtype: str = "float32", **config_kw
                   ) -> Path:
  """Saves a random tiny checkpoint under ``root/<name>`` and returns the directory.

  Args:
    root: parent directory (e.g. ``tmp_path``).
    family: ``'qwen2'`` or ``'qwen3'``.
    tie: tied input/output embeddings.
    seed: torch seed of the random weights.
    max_shard_size: e.g. ``"20KB"`` to force a sharded checkpoint with an index.
    dtype: ``"float32"`` or ``"bfloat16"`` storage.
    **config_kw: passed to :func:`tiny_hf_config` (heads, kv_heads, hidden, layers, ...).
  """
  import torch
  from transformers import AutoModelForCausalLM

  _quiet_transformers()
  config = tiny_hf_config(family, tie=tie, **config_kw)
  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  random_weights(model)
  model = model.to(getattr(torch, dtype))
  name = f"{family}_{'tied' if tie else 'untied'}_s{seed}_" + "_".join(
      f"{k}{v}" for k, v in sorted(config_kw.items())) + (f"_{max_shard_size}" if max_shard_size
                                                          else "") + f"_{dtype}"
  out = Path(root) / name
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(out, **kwargs)
  return out


def hf_model(path: Path):
  """The checkpoint as a float32 torch model in eval mode (eager attention)."""
  import torch
  from transformers import AutoModelForCausalLM

  _quiet_transformers()
  return AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(model, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
              position_ids: np.ndarray | None = None) -> np.ndarray:
  """float32 logits ``[B, T, V]`` of the torch model."""
  import torch

  def t(x):
    return None if x is None else torch.as_tensor(np.asarray(x), dtype=torch.long)

  with torch.no_grad():
    out = model(input_ids=t(input_ids), attention_mask=t(attention_mask),
                position_ids=t(position_ids))
  return out.logits.float().numpy()


def make_tiny_tokenizer(root: Path, vocab: int = 128, words: list[str] | None = None,
                        name: str = "tokenizer") -> Path:
  """A word-level fast tokenizer with the Qwen chat special tokens, ``words`` (default a few of a
  question's) and :data:`CHAT_TEMPLATE`, saved under ``root/name``."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  words = words or ["what", "is", "1+1", "?", "be", "brief"]
  table = {w: i for i, w in enumerate(specials + ["system", "user", "assistant", "\n"] + words)}
  table.update({f"w{i}": i for i in range(len(table), vocab)})
  tok = Tokenizer(models.WordLevel(table, unk_token="<|endoftext|>"))
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(pattern="\n", behavior="isolated"), pre_tokenizers.WhitespaceSplit()])
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>",
                                 additional_special_tokens=specials[1:])
  fast.chat_template = CHAT_TEMPLATE
  out = Path(root) / name
  fast.save_pretrained(out)
  return out


def read_json(path: Path) -> dict:
  return json.loads(Path(path).read_text())
