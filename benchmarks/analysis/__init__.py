"""One-off analyses: of the demo's checkpoint, batches and runs, and issue 16's fidelity
figures of the entropy statistics."""
