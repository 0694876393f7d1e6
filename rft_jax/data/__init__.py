"""Local math datasets (DAPO-Math-17k, AIME, generic jsonl/parquet), the held-out split, and
the prompt stream whose state is checkpointed. Beside them: the data settings
(:mod:`~rft_jax.data.config`), a question's prompt (:mod:`~rft_jax.data.prompts`) and the
pass-rate filter of ``rft-jax filter`` (:mod:`~rft_jax.data.filter`)."""

from rft_jax.data.datasets import FORMATS, DatasetError, LoadReport, MathExample, load_math_dataset, split_validation
from rft_jax.data.pipeline import Prompt, PromptStream, tokenize_prompts

__all__ = ["FORMATS", "DatasetError", "LoadReport", "MathExample", "Prompt", "PromptStream",
           "load_math_dataset", "split_validation", "tokenize_prompts"]
