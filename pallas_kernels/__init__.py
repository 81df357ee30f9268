"""Pallas GPU kernels for the sparse parts of training.

Each kernel has a pure-JAX reference that is the CPU path and the test oracle. This package
imports nothing from the library that calls it: math that a kernel shares with its reference
lives here (e.g. :mod:`pallas_kernels.nm_math`).
"""
