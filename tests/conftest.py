"""Test-wide settings. The fake device count is set here, once, before JAX loads."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

# JIT compilation makes the first example slow; shapes are drawn from small fixed sets.
hypothesis.settings.register_profile("rft_jax", deadline=None, max_examples=60, derandomize=True)
hypothesis.settings.load_profile("rft_jax")
