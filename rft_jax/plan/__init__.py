"""Capacity planning, ``rft-jax plan``: will a run fit on a topology? Its programs compiled for
devices that need not be attached, and their memory per device.

``topology`` (the leaf: :class:`Topology`, :class:`PlanError`), ``devices`` (the devices of a
topology's name: CPU, TPU, GPU via ``gpu_topology``), ``fit`` (the compiles and their memory),
``report`` (the report in words).
"""
