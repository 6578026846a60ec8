"""Workloads shipped with unbroken: run by the demo, the tests and ``examples/``.

They live in the package (``python -m unbroken.workloads.mlp``) so that
``unbroken demo`` works from any folder, not just from a checkout.
"""
