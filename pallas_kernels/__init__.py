"""Pallas GPU kernels for the sparse parts of training.

Each kernel has a pure-JAX reference that is the CPU path and the test oracle. This package
imports nothing from the library that calls it: math that a kernel shares with its reference
lives here (e.g. :mod:`pallas_kernels.nm_math`).

The kernels (:mod:`pallas_kernels.nm_prune`, :mod:`pallas_kernels.pattern_spmm`) are written
for Pallas's Triton backend, ``jax.experimental.pallas.triton``, which JAX 0.11 deprecates
(lowering a kernel warns that the backend will be removed, pointing to Mosaic GPU or the
official Triton bindings). The library survives its removal as follows:

* :func:`triton_available` probes the import once. Only a caller that has asked it imports a
  kernel module, so ``import jaxprune`` never needs the Triton backend.
* Without it, every ``backend="auto"`` runs the pure-JAX reference (SDGP's auto already does on
  CUDA, where the reference measured faster) and ClickTrain's default sparse backend is the
  reference; an explicit ``backend="pallas"`` raises a ``ValueError`` saying so
  (:func:`check_triton`).
* While it exists the kernels stay available (``backend="pallas"``; ClickTrain's sparse
  execution times them per layer and keeps them only where they win) and the deprecation
  warning is left visible. Porting them to Mosaic GPU is deferred: it targets Hopper only and cannot be
  validated without such a GPU (``docs/design.md``, "GPU kernels and the Pallas Triton
  deprecation").
"""

from __future__ import annotations

import functools
import importlib

__all__ = ["check_triton", "triton_available"]


@functools.cache
def triton_available() -> bool:
  """Whether this JAX has Pallas's Triton backend (``jax.experimental.pallas.triton``).

  Tried once per process and cached. JAX 0.11's deprecation warning comes when a Triton kernel
  is lowered, not from this import, and nothing here silences it.

  Returns:
    ``True`` when the module imports, ``False`` when it is missing or fails to import.
  """
  try:
    importlib.import_module("jax.experimental.pallas.triton")
  except Exception:  # noqa: BLE001 (removed, or a stub that raises on import: unusable either way)
    return False
  return True


def check_triton(argument: str = "backend", value: str = "pallas") -> None:
  """Raises when the Pallas Triton backend is missing, naming the argument that asked for it.

  Callers look the probe up as ``pallas_kernels.triton_available`` at call time, so a test can
  patch it.

  Args:
    argument: the caller's argument that selected the kernels (for the message).
    value: the value it was given.

  Raises:
    ValueError: :func:`triton_available` is false.
  """
  if not triton_available():
    raise ValueError(
      f"{argument}={value!r}: the Pallas Triton backend (jax.experimental.pallas.triton) is "
      "unavailable in this JAX; use backend='reference' (or 'auto', which falls back to it)"
    )
