"""Measurement harnesses for cgx (kept apart from the test suite).

Not an installed package: run its tools from the repository root, e.g.
``python -m benchmarks.netsim selftest``.
"""
