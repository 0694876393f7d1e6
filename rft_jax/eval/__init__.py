"""Evaluation metrics (pure numpy): Avg@K, unbiased pass@k, bootstrap best@k (biased,
for comparison), pass-rate histograms. Nothing here imports the rest of the project."""

from rft_jax.eval.metrics import avg_at_k
from rft_jax.eval.metrics import best_at_k_bootstrap
from rft_jax.eval.metrics import pass_at_k
from rft_jax.eval.metrics import pass_at_k_from_samples
from rft_jax.eval.metrics import pass_rate_histogram
from rft_jax.eval.metrics import plot_pass_rate_histogram

__all__ = [
    "avg_at_k",
    "best_at_k_bootstrap",
    "pass_at_k",
    "pass_at_k_from_samples",
    "pass_rate_histogram",
    "plot_pass_rate_histogram",
]
