"""Figures meant for a GPU or TPU: ``gpu.sh`` runs them on a CUDA machine; ``decode_kernels``
compiles for a topology without one."""
