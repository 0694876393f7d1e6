"""The sampler's decode step, every implementation of it, and the one place that chooses among
them (:mod:`~rft_jax.models.decode.backend`).

* :mod:`~rft_jax.models.decode.feature_major`: the CPU step, weight-first products;
* :mod:`~rft_jax.models.decode.cpu_attention` (and ``cpu_attention.cc``): its attention as one
  compiled kernel;
* :mod:`~rft_jax.models.decode.fused_decode`, :mod:`~rft_jax.models.decode.decode_attention`,
  :mod:`~rft_jax.models.decode.decode_projections`: one GPU's step in five Pallas kernels a layer;
* :mod:`~rft_jax.models.decode.paged_kv`: the paged KV cache and its attention kernels.

The model's own :meth:`~rft_jax.models.Qwen.decode_step` (XLA) is the reference each of them
equals.
"""
