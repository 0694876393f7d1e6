"""rft_jax: reinforcement fine-tuning of Qwen models in JAX, built around the entropy
dynamics of GRPO (arXiv 2602.03392)."""

__version__ = "0.1.0"
