"""Float32 accuracy of rft_jax's reductions over the vocabulary against float64: ``token_stats``
beside verl's and TRL's entropy (``token_stats_error``), and every other one (``vocab_reductions``)."""
