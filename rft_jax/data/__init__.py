"""Local math datasets (DAPO-Math-17k, AIME, generic jsonl/parquet), the held-out split, and
the prompt stream whose state is checkpointed."""

from rft_jax.data.datasets import FORMATS, DatasetError, LoadReport, MathExample, load_math_dataset, split_validation
from rft_jax.data.pipeline import Prompt, PromptStream, tokenize_prompts

__all__ = ["FORMATS", "DatasetError", "LoadReport", "MathExample", "Prompt", "PromptStream",
           "load_math_dataset", "split_validation", "tokenize_prompts"]
