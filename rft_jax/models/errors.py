"""The error raised for a checkpoint or config that cannot be converted."""

from __future__ import annotations


class CheckpointError(ValueError):
  """A Hugging Face checkpoint does not match the decoder (names, shapes, config or files)."""
