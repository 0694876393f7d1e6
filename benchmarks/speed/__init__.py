"""Time and memory of rft_jax's parts on this machine (the sampler, the CPU decode step and its
attention kernel, the learner step, ``load_hf``, ``token_stats``); ``learner_step`` and
``sampler`` also hold the models and presets that the other groups import as ``speed.*``."""
