"""``rft-jax plan`` over the paper's configs on real topologies (deviceless compiles)."""
