"""Pages to read about runs and policies: ``plots`` (the paper's figures from runs' metrics, ``rft-jax
plot``, the demo's plot) and ``attribution`` (each token's Theorem 2 forecast, ``rft-jax
attribute``). Used by the command line, the demo and ``rft_jax.figures``; imports none of them."""
