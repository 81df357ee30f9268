"""Pallas GPU kernels for the sparse parts of jaxprune.

Each kernel has a pure-JAX reference that is the CPU path and the test oracle. This package
imports nothing from ``jaxprune``: the library calls the kernels, never the other way; math
that a kernel shares with its reference lives here (e.g. :mod:`pallas_kernels.nm_math`).
"""
